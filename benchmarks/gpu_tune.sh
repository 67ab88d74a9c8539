#!/usr/bin/env bash
# Item 1 of the GPU plan on one CUDA GPU: tune the Triton ring (one device) for head dim 128, bf16,
# B*S = 16k tokens, hidden 2048, S = 4k and 16k, causal and not; then time the tuned tiles against the
# default ones, cuDNN and XLA in one run (benchmarks/gpu_attention.py --tuned).
#
#   benchmarks/gpu_tune.sh OUT_DIR [SECONDS_PER_SEARCH [SEQ_LENS]]   # defaults: 150 s of trials per
#                                                                    # problem; 4096,16384
#
# On an H200 the reference and the default took 80 to 110 s to build before a search's trials (which
# SECONDS_PER_SEARCH bounds): where a call is limited to 10 minutes, pass one sequence length per call
# and 90 s (`benchmarks/gpu_tune.sh OUT 90 4096`).
#
# OUT_DIR gets gpu.sqlite (the tuned rows; `tuner export --db OUT_DIR/gpu.sqlite FILE` writes them as
# JSON lines for cache_db/), the studies, both logs and gpu_attention.json.
# On the lent GPU machine, install the wheels of ../shared/tools/gpu-prepare.sh first.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_tune.sh OUT_DIR [SECONDS_PER_SEARCH [SEQ_LENS]]}
per=${2:-150}
seqs=${3:-4096,16384}
mkdir -p "$out"
db="$out/gpu.sqlite"
export PYTHONUNBUFFERED=1
for seq in ${seqs//,/ }; do
    for causal in --causal --no-causal; do
        timeout $((per + 120)) python3 -m tuner.cli search --device gpu --batch $((16384 / seq)) --seq-len "$seq" \
            --heads 16 --kv-heads 16 --head-dim 128 --dtype bfloat16 "$causal" --ring-size 1 \
            --trials 200 --timeout "$per" --db "$db" 2>&1 | tee -a "$out/search.log"
    done
done
python3 benchmarks/gpu_attention.py --head-dims 128 --seq-lens "$seqs" --objectives fwd,bwd --runs 7 \
    --tuned "$db" --out "$out/gpu_attention.json" 2>&1 | tee "$out/bench.log"
