#!/usr/bin/env bash
# Item 1 of the GPU plan on one CUDA GPU: tune the Triton ring (one device) for head dim 128, bf16,
# B*S = 16k tokens, hidden 2048, S = 4k and 16k, causal and not; after each sequence length's two searches,
# time its tuned tiles against the default ones, cuDNN and XLA in one run (benchmarks/gpu/gpu_attention.py
# --tuned), so that a call cut short keeps every length it finished.
#
#   benchmarks/gpu/gpu_tune.sh OUT_DIR [SECONDS_PER_SEARCH [SEQ_LENS [DEADLINE_SECONDS]]]
#       defaults: 150 s of trials per problem; 4096,16384; no deadline
#
# SECONDS_PER_SEARCH bounds a search's trials, counted once its reference and default are built (80 to
# 110 s on an H200 on 2026-11-26). DEADLINE_SECONDS bounds the whole script: a search starts only if
# 150 s are left, its trials are cut to fit, and a benchmark starts only if 45 s are left. Under a
# device call's 10 minutes: `benchmarks/gpu/gpu_tune.sh OUT 50 4096,16384 540`.
#
# OUT_DIR gets gpu.sqlite (the tuned rows; `tuner export --db OUT_DIR/gpu.sqlite FILE` writes them as
# JSON lines for cache_db/), its studies, search.log, bench.log and gpu_attention-SEQ.json per length.
# On the lent GPU machine, install the wheels of ../shared/tools/gpu-prepare.sh first.
set -uo pipefail
out=${1:?usage: benchmarks/gpu/gpu_tune.sh OUT_DIR [SECONDS_PER_SEARCH [SEQ_LENS [DEADLINE_SECONDS]]]}
per=${2:-150}
seqs=${3:-4096,16384}
deadline=${4:-0}
mkdir -p "$out"
db="$out/gpu.sqlite"
export PYTHONUNBUFFERED=1
start=$(date +%s)

# Seconds left before the deadline (a large number without one).
left() {
    if [ "$deadline" -eq 0 ]; then echo 999999; else echo $((start + deadline - $(date +%s))); fi
}

for seq in ${seqs//,/ }; do
    for causal in --causal --no-causal; do
        room=$(left)
        if [ "$room" -lt 150 ]; then
            echo "gpu_tune: skipped S=$seq $causal: ${room}s left before the deadline" | tee -a "$out/search.log"
            continue
        fi
        trials_s=$(( per < room - 120 ? per : room - 120 ))
        timeout $(( trials_s + 120 )) python3 -m tuner.cli search --device gpu --backend triton --batch $((16384 / seq)) \
            --seq-len "$seq" --heads 16 --kv-heads 16 --head-dim 128 --dtype bfloat16 "$causal" --ring-size 1 \
            --trials 200 --timeout "$trials_s" --db "$db" 2>&1 | tee -a "$out/search.log"
    done
    room=$(left)
    if [ "$room" -lt 45 ]; then
        echo "gpu_tune: skipped the benchmark of S=$seq: ${room}s left before the deadline" | tee -a "$out/bench.log"
        continue
    fi
    timeout "$room" python3 benchmarks/gpu/gpu_attention.py --head-dims 128 --seq-lens "$seq" --objectives fwd,bwd \
        --runs 7 --tuned "$db" --out "$out/gpu_attention-$seq.json" 2>&1 | tee -a "$out/bench.log"
done
