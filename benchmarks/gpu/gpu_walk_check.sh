#!/usr/bin/env bash
# Checks the timing of a trial on one CUDA GPU (benchmarks/gpu/README.md, "Warming up before timing"): walks a
# forward grid as `tuner search` times its trials, then re-times the default and the walk's best alone,
# while nvidia-smi samples the SM clock every 100 ms, so that a slow default can be told apart from a slow
# clock.
#
#   benchmarks/gpu/gpu_walk_check.sh OUT_DIR [PROBLEM [WALK_SECONDS]]
#       defaults: gpu-causal-d128-mha-r1-l4096-bf16; 120 s of walk
#
# OUT_DIR gets walk.log, clocks.csv (timestamp, SM clock MHz, power W, GPU utilization %) and the walk's
# landscape JSON (its "noise" holds the re-timings). Fits a device call: WALK_SECONDS + about 60 s.
# On the lent GPU machine, install the wheels of ../shared/tools/gpu-prepare.sh first.
set -uo pipefail
out=${1:?usage: benchmarks/gpu/gpu_walk_check.sh OUT_DIR [PROBLEM [WALK_SECONDS]]}
problem=${2:-gpu-causal-d128-mha-r1-l4096-bf16}
walk=${3:-120}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu --format=csv,noheader,nounits -lms 100 \
    > "$out/clocks.csv" &
sampler=$!
timeout $((walk + 90)) python3 benchmarks/search/landscape.py "$problem" --part fwd --deadline "$walk" --compile-ahead 2 \
    > "$out/walk.log" 2>&1
status=$?
kill "$sampler"
cp benchmarks/search/results/landscape-triton-*-"$problem".json "$out/" 2>/dev/null
exit $status
