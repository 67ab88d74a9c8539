"""The first call of a packed documents-layout call with no packing declared: called on arrays (the rows'
tile read on the host, one ring compiled) against the same call under `jax.jit` (a ring per tile, the rows
choosing in the step).

    python benchmarks/documents/packed_first_call.py              # ring 8 simulated, 4096 tokens, 5 processes each
    python benchmarks/documents/packed_first_call.py --runs 9 --length 1024

Each measurement is a fresh process (compiled programs are per process), the two ways interleaved. The
row is one document of half the sequence and 16 short ones; q, k and v differ; the forward only (a
gradient is traced, so it always compiles a ring per tile). Reported: the medians of the first call
(compile and run) and of the second, their ratio, and the host's cost of choosing on each call after the
first. Writes
`benchmarks/documents/results/packed_first_call-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit

DEVICES = 8
WAYS = ("on arrays", "under jax.jit")


def measure(way: str, length: int) -> dict[str, float]:
    """One process's first and second call, in seconds, and the host's choice per call in ms."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}")
    os.environ["TUNER_HOME"] = tempfile.mkdtemp()  # an empty cache: the packed default runs
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from tuner import get_tuned_ring_attention

    lengths = [length // 2] + [length // 32] * 16
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((1, length, 4, 64)), jnp.float32)
               for i in range(3))
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents")

    def direct(q, k, v, s):  # every array an argument: a closed-over one would be a constant of the program
        return attn(q, k, v, q_segment_ids=s, kv_segment_ids=s)

    call = direct if way == WAYS[0] else jax.jit(direct)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        jax.block_until_ready(call(q, k, v, seg))
        times.append(time.perf_counter() - start)
    options = dict(q_segment_ids=seg, kv_segment_ids=seg)
    choice = min(timeit.repeat(lambda: attn._global.rows_tile(q, k, v, options), number=20, repeat=5)) / 20
    return dict(first_s=times[0], second_s=times[1], host_choice_ms=1000 * choice)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per way (default 5)")
    parser.add_argument("--length", type=int, default=4096, help="tokens in the row (default 4096)")
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.length % (32 * DEVICES):
        parser.error(f"--length must be a multiple of {32 * DEVICES}, got {args.length}")
    if args.one:
        print(json.dumps(measure(args.one, args.length)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.runs):
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, "--one", way, "--length", str(args.length)],
                                 check=True, capture_output=True, text=True).stdout
            runs[way].append(json.loads(out.strip().splitlines()[-1]))
    medians = {way: {name: statistics.median(run[name] for run in runs[way]) for name in runs[way][0]}
               for way in WAYS}
    for way in WAYS:
        print(f"{way:>14}: first call {medians[way]['first_s']:.2f} s, second {medians[way]['second_s']:.3f} s")
    ratio = medians[WAYS[0]]["first_s"] / medians[WAYS[1]]["first_s"]
    print(f"first call on arrays / under jax.jit: {ratio:.2f}; the host's choice "
          f"{medians[WAYS[0]]['host_choice_ms']:.2f} ms a call")
    out = os.path.join(os.path.dirname(__file__), "results",
                       f"packed_first_call-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(dict(ring=DEVICES, length=args.length, runs=runs, medians=medians, first_call_ratio=ratio), f,
                  indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
