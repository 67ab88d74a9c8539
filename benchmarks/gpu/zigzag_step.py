"""One causal zigzag ring step past the first, timed on one device: what the cudnn kernel's block costs there.

    python benchmarks/gpu/zigzag_step.py --out OUT/zigzag-step.json                # on a CUDA GPU
    python benchmarks/gpu/zigzag_step.py --interpret --shard 64 --head-dim 16 --heads 2 --runs 1 --out F
                                                                                   # CPU: the XLA twin engine

A ring of `--ring` devices cannot run on one GPU, but one of its steps can: the cudnn kernel's block for
device 1 meeting the keys of device 0 in the zigzag layout, where of the two half pairs that differ between
devices exactly one runs. Three ways, forward and backward (without the lse, as a training step runs it),
interleaved, medians:

    prefixes  the kernel as the ring runs it where the layout's positions are known: the halves that run,
              read as a prefix of the queries (halves swapped) and of the keys, one cuDNN call under a
              padding mask, no slice and no branch (`tuner.kernels.cudnn_pairs.halves_as_prefixes`)
    switch    the kernel with the positions unknown: each chunk pair in a `lax.switch` on its kind
    floor     the two cuDNN calls the step needs (FULL on the halves that run, sliced), nothing around them

A row gives each one's median and its ratio to `floor`, and the largest difference between the results of
`prefixes` and `switch`, relative to the largest result: the same sums, rounded otherwise (cuDNN rounds a
query half's output and dq once over both key halves in `prefixes`, once a pair in `switch`), so within a
few bf16 resolutions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tuner.kernels import cudnn, cudnn_engine
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics import known, layouts
from tuner.semantics.spec import AttentionSpec
from tuner.tuning.timing import compile_timed, run_interleaved

WAYS = ("prefixes", "switch", "floor")


def step_inputs(shard: int, heads: int, head_dim: int, ring: int, seed: int = 0) -> dict:
    """Device 1's queries and device 0's keys (bf16, batch 1), their zigzag positions, and a cotangent."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, shard, heads, head_dim), dtype=np.float32), jnp.bfloat16)
                   for _ in range(4))
    q_pos, kv_pos = (jnp.asarray(layouts.local_positions_np("zigzag", shard, ring, rank)[None], jnp.int32)
                     for rank in (1, 0))
    return dict(q=q, k=k, v=v, do=do, q_pos=q_pos, kv_pos=kv_pos)


def ways(spec: AttentionSpec, shard: int, ring: int, interpret: bool) -> dict:
    """`{way: (forward, backward)}`: forward `(q, k, v, q_pos, kv_pos) -> (o, lse)`, backward
    `(q, k, v, o, lse, do, delta, q_pos, kv_pos) -> (dq, dk, dv)`."""
    block = known.ring_block("zigzag", shard, shard, ring, range(1, ring - 1))  # the ring loop's steps
    fwd_params, bwd_params = FwdParams(shard // 2, shard // 2), BwdParams(shard // 2, shard // 2)
    engine = cudnn_engine.engine(interpret)
    call = dict(scale=spec.scale, causal=False, window=None)
    found = {}
    for name, given in (("prefixes", block), ("switch", None)):
        found[name] = (
            lambda q, k, v, qp, kp, given=given: cudnn.forward(q, k, v, qp, kp, spec=spec, params=fwd_params,
                                                               interpret=interpret, known=given),
            lambda q, k, v, o, lse, do, delta, qp, kp, given=given: cudnn.backward(
                q, k, v, o, lse, do, delta, qp, kp, spec=spec, params=bwd_params, interpret=interpret, known=given,
                lse_cotangent=False))

    def halves(x, axis: int = 1):
        return jnp.split(x, 2, axis=axis)

    # device 1 meets device 0's keys, all earlier than its queries in the low half and the high half's
    # low one; so both its query halves read the low key half in full, and nothing reads the high one
    def floor_forward(q, k, v, qp, kp):
        (q_low, q_high), (k_low, _), (v_low, _) = halves(q), halves(k), halves(v)
        return engine.forward(q_low, k_low, v_low, **call), engine.forward(q_high, k_low, v_low, **call)

    def floor_backward(q, k, v, o, lse, do, delta, qp, kp):
        (q_low, q_high), (k_low, _), (v_low, _) = halves(q), halves(k), halves(v)
        (o_low, o_high), (do_low, do_high), (lse_low, lse_high) = halves(o), halves(do), halves(lse, 2)
        return (engine.backward(q_low, k_low, v_low, o_low, lse_low, do_low, **call),
                engine.backward(q_high, k_low, v_low, o_high, lse_high, do_high, **call))

    found["floor"] = (floor_forward, floor_backward)
    return found


def measure(shard: int, heads: int, head_dim: int, ring: int, runs: int, calls: int, interpret: bool) -> list[dict]:
    """The rows: forward and backward, each way's timing and its ratio to the floor."""
    spec = AttentionSpec(scale=head_dim ** -0.5, causal=True)
    inputs = step_inputs(shard, heads, head_dim, ring)
    found = ways(spec, shard, ring, interpret)
    q, k, v, do, qp, kp = (inputs[name] for name in ("q", "k", "v", "do", "q_pos", "kv_pos"))
    o, lse = jax.jit(found["prefixes"][0])(q, k, v, qp, kp)
    o = o.astype(jnp.bfloat16)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))
    arguments = {"fwd": (q, k, v, qp, kp), "bwd": (q, k, v, o, lse, do, delta, qp, kp)}
    rows = []
    for index, objective in enumerate(("fwd", "bwd")):
        compiled, compile_seconds = {}, {}
        given = arguments[objective]
        for name in WAYS:
            compiled[name], compile_seconds[name] = compile_timed(found[name][index], given)
        thunks = {name: (lambda i, fn=compiled[name], given=given: fn(*given)) for name in WAYS}
        prefixes, switch = (jax.tree.leaves(compiled[name](*given)) for name in ("prefixes", "switch"))
        finite = [(a.astype(jnp.float32), b.astype(jnp.float32)) for a, b in zip(prefixes, switch)]
        differ = max(float(jnp.max(jnp.where(jnp.isfinite(b), jnp.abs(a - b), 0.0)) /
                           jnp.max(jnp.where(jnp.isfinite(b), jnp.abs(b), 0.0))) for a, b in finite)
        timings = run_interleaved(thunks, runs=runs, calls=calls, compile_seconds=compile_seconds)
        floor = timings["floor"].median
        rows.append({"objective": objective, "prefixes_vs_switch_relative": differ,
                     **{name: {**timings[name].to_dict(), "of_floor": timings[name].median / floor if floor else None}
                        for name in WAYS}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ring", type=int, default=4, help="ring size the step belongs to (default 4)")
    parser.add_argument("--shard", type=int, default=8192, help="tokens a device holds (default 8192)")
    parser.add_argument("--heads", type=int, default=16, help="query and key heads (default 16)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs, medians (default 7)")
    parser.add_argument("--calls", type=int, default=3, help="calls a run (default 3)")
    parser.add_argument("--interpret", action="store_true", help="the cudnn kernel's XLA twin engine (CPU)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.ring < 3 or args.shard % 2:
        parser.error(f"--ring must be >= 3 (a step inside the loop) and --shard even, got {args.ring}, {args.shard}")
    start = time.perf_counter()
    rows = measure(args.shard, args.heads, args.head_dim, args.ring, args.runs, args.calls, args.interpret)
    command = ["python", "benchmarks/gpu/zigzag_step.py", *(sys.argv[1:] if argv is None else argv)]
    result = {"command": " ".join(command),
              "device": jax.devices()[0].device_kind, "ring": args.ring, "shard": args.shard, "heads": args.heads,
              "head_dim": args.head_dim, "interpret": args.interpret, "rows": rows,
              "seconds": time.perf_counter() - start}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(row["objective"], "  ".join(f"{name} {row[name]['median_s'] * 1e3:.3f} ms ({row[name]['of_floor']:.2f}x)"
                                          for name in WAYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
