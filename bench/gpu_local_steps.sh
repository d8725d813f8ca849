#!/usr/bin/env bash
# Issue 46's GPU check, in one go on one GPU host: how busy a PyTorch worker keeps the GPU under per-step
# ASP and under local steps (asynchronous local SGD with H = 4 and 16, asynchronous DiLoCo with H = 16), with
# bench/gpu_util.py's real ResNet-18 (batch 128). Each case computes about the same number of batches; the
# one-worker cases repeat REPEATS times in turn (ABC ABC ...), so that drift hits them alike; then four
# workers share the GPU under ASP and local SGD (H = 16). Every case's JSON is gathered into OUT/all.json.
#
#     SITE=/tmp/site REPEATS=3 bash bench/gpu_local_steps.sh OUT [ASP_STEPS]
set -u
out=$1 steps=${2:-120} repeats=${REPEATS:-1}
root=$(pwd) site=${SITE:-}
mkdir -p "$out/parts"
part() {  # part NAME TIMEOUT ARGS...: gpu_util's JSON into OUT/parts/NAME.json, its stderr's tail with it
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    PYTHONPATH="${site:+$site:}$root" timeout "$limit" python3 "$root/bench/gpu_util.py" --device cuda "$@" \
        >"$out/parts/$name.json" 2>"$out/parts/$name.err.full"
    echo "$name: rc $? in $((SECONDS - t0)) s"
    tail -c 2000 "$out/parts/$name.err.full" >"$out/parts/$name.err"; rm -f "$out/parts/$name.err.full"
}
local_sgd() { echo --set protocol.name="$1" --set protocol.local_steps="$2"; }
diloco=(--set 'protocol.inner_optimizer={name: adamw, learning_rate: 0.001}'
        --set 'protocol.outer_optimizer={name: nesterov, learning_rate: 0.7, params: {momentum: 0.9}}')
# shellcheck disable=SC2046  # the options split on purpose
for r in $(seq 1 "$repeats"); do
    part "asp.$r" 90 --steps "$steps"
    part "local_sgd_4.$r" 90 --steps $((steps / 4)) $(local_sgd async_local_sgd 4)
    part "local_sgd_16.$r" 90 --steps $((steps / 16)) $(local_sgd async_local_sgd 16)
    part "diloco_16.$r" 90 --steps $((steps / 16)) $(local_sgd async_diloco 16) "${diloco[@]}"
done
part asp_4w 120 --steps "$steps" --workers 4
part local_sgd_16_4w 120 --steps $((steps / 16)) --workers 4 $(local_sgd async_local_sgd 16)
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
cases = {}
for p in sorted((out / "parts").glob("*.json")):
    try:
        cases[p.stem] = json.loads(p.read_text())
    except ValueError:
        cases[p.stem] = {"error": (out / "parts" / f"{p.stem}.err").read_text()[-2000:]}
(out / "all.json").write_text(json.dumps(cases, indent=1))
PY
