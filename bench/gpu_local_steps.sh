#!/usr/bin/env bash
# Issue 46's GPU check, in one go on one GPU host: how busy a PyTorch worker keeps the GPU under per-step
# ASP and under local steps (asynchronous local SGD with H = 4 and 16, asynchronous DiLoCo with H = 16), with
# bench/gpu_util.py's real ResNet-18 (batch 128), one worker and then four. Each case's steps (local steps
# included) are about the same; each part writes its JSON into OUT as soon as it ends.
#
#     SITE=/tmp/site bash bench/gpu_local_steps.sh OUT [ASP_STEPS]
set -u
out=$1 steps=${2:-120}
root=$(pwd) site=${SITE:-}
mkdir -p "$out"
part() {  # part NAME TIMEOUT ARGS...: gpu_util's JSON into OUT/NAME.json, its stderr's tail into OUT/NAME.err
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    PYTHONPATH="${site:+$site:}$root" timeout "$limit" python3 "$root/bench/gpu_util.py" --device cuda "$@" \
        >"$out/$name.json" 2>"$out/$name.err.full"
    echo "$name: rc $? in $((SECONDS - t0)) s"
    tail -c 4000 "$out/$name.err.full" >"$out/$name.err"; rm -f "$out/$name.err.full"
}
local_sgd() { echo --set protocol.name="$1" --set protocol.local_steps="$2"; }
# shellcheck disable=SC2046  # the options split on purpose
{
part asp 90 --steps "$steps"
part local_sgd_4 90 --steps $((steps / 4)) $(local_sgd async_local_sgd 4)
part local_sgd_16 90 --steps $((steps / 16)) $(local_sgd async_local_sgd 16)
part diloco_16 90 --steps $((steps / 16)) $(local_sgd async_diloco 16) \
    --set 'protocol.inner_optimizer={name: adamw, learning_rate: 0.001}' \
    --set 'protocol.outer_optimizer={name: nesterov, learning_rate: 0.7, params: {momentum: 0.9}}'
part asp_4w 120 --steps "$steps" --workers 4
part local_sgd_16_4w 120 --steps $((steps / 16)) --workers 4 $(local_sgd async_local_sgd 16)
}
