#!/usr/bin/env bash
# One GPU session in one command: everything it measures goes under OUT (docs/cudnn.md, "On a GPU").
#
#   bash benchmarks/gpu/gpu_session.sh OUT              # on an H100 or H200: within 8 minutes
#   bash benchmarks/gpu/gpu_session.sh OUT --dry-run    # on a CPU: the same steps, interpreters and the
#                                                       # cudnn kernel's XLA twin, small sizes
#   PYTHON=/path/to/python bash benchmarks/gpu/gpu_session.sh OUT   # another interpreter than python3
#
# What it writes:
#   OUT/environment.json     GPU, jax, jaxlib and its extension version, cuDNN, triton, the cudnn binding
#   OUT/check-float32.json   the Triton ring and the cudnn-engine ring against XLA, forward and gradients,
#   OUT/check-bfloat16.json  causal and not, grouped-query heads (cuDNN refuses float32: recorded)
#   OUT/timings.json         a ring of one device with each engine against
#                            jax.nn.dot_product_attention(implementation="cudnn"), head dim 128, 4k and
#                            16k tokens, causal and not, forward and backward, interleaved, medians
#   OUT/auto.json            on the same problems, `tuner bench --mechanisms triton,cudnn`, then which
#                            engine backend="auto" runs: the one measured faster? (auto_pick.py)
#   OUT/zigzag-step.json     one causal zigzag ring step past the first: the cudnn kernel's halves read as
#                            prefixes, its `switch` per pair, and the two cuDNN calls alone (zigzag_step.py)
#   OUT/session.log          what each step printed; OUT/steps.txt each step's exit status
#
# The steps run in the order of what they are worth: environment, bf16 check, timings, auto, zigzag step,
# float32 check. Each has its own time limit, so a stuck step leaves the others' results; timings.json and
# auto.json are written row by row. The last three get what the others left of the session's 8 minutes:
# auto and the zigzag step if 30 s are left, the float32 check if 150 s are (else steps.txt says
# "skipped"). The exit status is that of the first step that failed.
set -uo pipefail

usage() {
    echo "usage: bash benchmarks/gpu/gpu_session.sh OUT [--dry-run]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
OUT=$1
shift
DRY=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        *) usage ;;
    esac
done
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's tuner, where it is not installed
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
: > "$OUT/session.log"
: > "$OUT/steps.txt"

# python3, as benchmarks/gpu/gpu_tune.sh ran on the lent machines (its python3 holds jax and torch); PYTHON
# names another interpreter
PY=${PYTHON:-python3}
BENCH=("$PY" benchmarks/gpu/gpu_attention.py)
if [ "$DRY" = 1 ]; then
    export JAX_PLATFORMS=cpu
    CHECK=(--interpret --tokens 32 --hidden 64 --head-dims 16 --seq-lens 32 --group 2)
    TIME=(--interpret --tokens 32 --hidden 32 --head-dims 16 --seq-lens 32 --runs 1 --calls 1 --warmup 0)
    LIMITS=(60 120 120 180)
    AUTO=(--engines scan,all_to_all --tokens 32 --hidden 32 --head-dim 16 --seq-lens 32 --runs 1 --calls 1)
    ZIGZAG=(--interpret --shard 64 --heads 2 --head-dim 16 --runs 1 --calls 1)
    TOTAL=660
else
    CHECK=(--tokens 2048 --hidden 2048 --head-dims 128 --seq-lens 1024 --group 4)
    TIME=(--tokens 16384 --hidden 2048 --head-dims 128 --seq-lens 4096,16384 --runs 7 --calls 3)
    LIMITS=(30 90 150 270)  # environment, bf16 check, the least the float32 check is started with, timings
    AUTO=(--tokens 16384 --hidden 2048 --head-dim 128 --seq-lens 4096,16384 --runs 5 --calls 3)
    ZIGZAG=(--shard 8192 --heads 16 --head-dim 128 --runs 7 --calls 3)
    TOTAL=480
fi
START=$(date +%s)

status=0
step() {  # step NAME LIMIT COMMAND...: run it under its time limit, log it, keep its exit status
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit}s): $*" >> "$OUT/session.log"
    start=$(date +%s)
    timeout "$limit" "$@" >> "$OUT/session.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start ))s" >> "$OUT/session.log"
    echo "$name $rc" >> "$OUT/steps.txt"
    if [ "$rc" != 0 ] && [ "$status" = 0 ]; then
        status=$rc
    fi
}

last() {  # last NAME LEAST COMMAND...: a step with what is left of the session's TOTAL, if at least LEAST
    local name=$1 least=$2 left
    shift 2
    left=$(( TOTAL - ($(date +%s) - START) ))
    if [ "$left" -ge "$least" ]; then
        step "$name" "$left" "$@"
    else
        echo "== $name: not run, ${left}s of the session's ${TOTAL}s left (it needs ${least}s)" >> "$OUT/session.log"
        echo "$name skipped" >> "$OUT/steps.txt"
    fi
}

CHECKED=("${BENCH[@]}" "${CHECK[@]}" --check-only --implementations ring,ring_cudnn,cudnn,xla)  # against XLA

step environment "${LIMITS[0]}" sh -c "'$PY' benchmarks/gpu/environment.py > '$OUT/environment.json'"
step check-bfloat16 "${LIMITS[1]}" "${CHECKED[@]}" --dtype bfloat16 --out "$OUT/check-bfloat16.json"
step timings "${LIMITS[3]}" "${BENCH[@]}" "${TIME[@]}" --objectives fwd,bwd \
    --implementations ring,ring_cudnn,ring_cudnn_shard,cudnn --out "$OUT/timings.json"
[ -f "$OUT/timings.json" ] && AUTO+=(--timings "$OUT/timings.json")
last auto 30 "$PY" benchmarks/gpu/auto_pick.py "${AUTO[@]}" --out "$OUT/auto.json"
last zigzag-step 30 "$PY" benchmarks/gpu/zigzag_step.py "${ZIGZAG[@]}" --out "$OUT/zigzag-step.json"
# float32 last: cuDNN refuses it, so it checks the Triton ring, whose exact float32 kernels compile slowly
# (35 to 41 s each for sm_90 on a 2-core CPU; on the H200 of 2026-11-30 the step ran out of its 90 s)
last check-float32 "${LIMITS[2]}" "${CHECKED[@]}" --dtype float32 --out "$OUT/check-float32.json"

cat "$OUT/steps.txt"
exit "$status"
