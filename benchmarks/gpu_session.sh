#!/usr/bin/env bash
# The GPU session's one command where ../shared/GPU-PLAN.md and issue 57 look for it; the script and its
# documentation are benchmarks/gpu/gpu_session.sh.
exec bash "$(dirname "$0")/gpu/gpu_session.sh" "$@"
