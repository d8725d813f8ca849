#!/usr/bin/env bash
# Issue 45's GPU check, in one go on one GPU host: the GPU-only test, the PS's apply on 1-8 threads, and
# bench/gpu_util.py's real-ResNet-18 cases on the code before (BEFORE: a checkout of it) and now, one after
# the other on the same GPU. Each part writes its JSON into OUT as soon as it ends (a part that fails or
# runs out of time leaves the others').
#
#     bash bench/gpu_cases.sh BEFORE OUT [STEPS]
#
# The baseline's runs set eval.final_timeout_s (its evaluator slept through a long eval.every_s, and its PS
# waited a minute for the final score after training: not part of what is measured).
set -u
before=$(cd "$1" && pwd) out=$2 steps=${3:-100}
root=$(pwd) site=${SITE:-}
mkdir -p "$out"
path() { echo "${site:+$site:}$1"; }
part() {  # part NAME TIMEOUT CMD...: CMD's stdout into OUT/NAME.json, its stderr's tail into OUT/NAME.err
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" bash -c '"$@"' _ "$@" >"$out/$name.json" 2>"$out/$name.err.full"
    echo "$name: rc $? in $((SECONDS - t0)) s"
    tail -c 4000 "$out/$name.err.full" >"$out/$name.err"; rm -f "$out/$name.err.full"
}
now() { PYTHONPATH=$(path "$root") python3 "$root/bench/gpu_util.py" --device cuda --steps "$steps" "$@"; }
then_() { (cd "$before" && PYTHONPATH=$(path "$before") python3 "$root/bench/gpu_util.py" --device cuda \
    --steps "$steps" --set eval.final_timeout_s=2 "$@"); }
export -f path now then_
export root before steps site
fast=(--set runtime.pipeline_depth=1 --set runtime.wire_dtype=bfloat16)

part gpu_test 90 env PYTHONPATH="$(path "$root")" python3 -m pytest -q -p no:cacheprovider \
    tests/test_torch_copies.py -k gpu
part gpu_test_no_tf32 60 env PYTHONPATH="$(path "$root")" python3 -c "import torch, pytest
torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
raise SystemExit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_torch_copies.py', '-k', 'gpu']))"
part before 120 then_ --workers 1 4
part after 170 now --workers 1 4 --shards 1 4 "${fast[@]}"
part after_f32 80 now --workers 1 4 --set runtime.pipeline_depth=1
part before_shards 60 then_ --shards 4
part after_grpc 60 now "${fast[@]}" --set runtime.shared_memory=false
part after_depth0 60 now
part apply 60 env PYTHONPATH="$(path "$root")" python3 "$root/bench/apply.py" --threads 1 2 4 8 --blocks 2 --reps 3
