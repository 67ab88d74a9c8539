"""A training step of a small transformer stack with ring attention, compiled under activation
checkpointing with several policies: what each one makes the backward pass move and hold (nothing runs).

    python benchmarks/remat/remat_step.py                          # 4 simulated CPU devices
    python benchmarks/remat/remat_step.py --tpu v5e:2x2 --tokens 32768 --layers 4

The step: `--layers` layers under `jax.lax.scan` (each: q/k/v projections, the loader's ring attention on
global arrays, causal, an output projection, a residual), the gradient of a loss over the parameters and
the input. Per policy: the collective-permute bytes a device moves in the step (the ring's hops, with the
loops' trip counts), the compiled temp bytes a device and those in the host's memory, the largest
all-gather (bytes a token of the batch), and the largest gradient difference from the step without
checkpointing where `--run` runs them (CPU only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu
    from tuner.support import libtpu

    libtpu.quiet_without_chips()  # this host is one of its own to libtpu, which then prints nothing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tuner  # noqa: E402
from tuner.models import hlo  # noqa: E402

POLICIES = {
    "none (no jax.checkpoint)": None,
    "jax.checkpoint, nothing saved": jax.checkpoint_policies.nothing_saveable,
    "jax.checkpoint, dots saved": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention_residuals()": tuner.save_attention_residuals(),
    "save_attention_residuals(dots)": tuner.save_attention_residuals(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    "save_attention_residuals(offload=True)": tuner.save_attention_residuals(offload=True),
}


def step(mesh: Mesh, *, tokens: int, heads: int, dim: int, layers: int, dtype, policy: str, backend: str = "auto"):
    """(the jitted gradient of the stack's loss, its arguments) for one policy of `POLICIES`."""
    width = heads * dim
    attn = tuner.get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=True, backend=backend)

    def layer(x, w):
        q, k, v = (jnp.einsum("bte,ef->btf", x, w[i]).reshape(*x.shape[:2], heads, dim) for i in range(3))
        out = attn(q, k, v).reshape(x.shape)
        return x + jnp.einsum("bte,ef->btf", out, w[3]), None

    chosen = POLICIES[policy]
    if policy != "none (no jax.checkpoint)":
        layer = jax.checkpoint(layer, policy=chosen)

    def loss(params, x):
        y, _ = jax.lax.scan(layer, x, params)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    on_cpu = mesh.devices.flat[0].platform == "cpu"

    def placed(array: np.ndarray, spec: P):
        """On the CPU's devices the array; for a TPU topology, which runs nothing, its shape."""
        sharding = NamedSharding(mesh, spec)
        if on_cpu:
            return jax.device_put(array, sharding)
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=sharding)

    rng = np.random.default_rng(0)
    x = placed(rng.standard_normal((1, tokens, width)).astype(dtype), P(None, "sp"))
    params = placed((rng.standard_normal((layers, 4, width, width)) / np.sqrt(width)).astype(dtype), P())
    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu", metavar="TOPOLOGY", help="compile for this TPU topology (e.g. v5e:2x2), not the CPU")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--backend", default="auto", help="the loader's backend (auto: its own choice)")
    parser.add_argument("--policies", nargs="+", type=int, help="only these policies (their indices in the table)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    parser.add_argument("--run", action="store_true", help="on the CPU, run each step and compare its gradients")
    args = parser.parse_args(argv)
    if args.tpu:
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=args.tpu).devices)
        dtype = jnp.bfloat16
    else:
        devices, dtype = jax.devices()[:4], jnp.float32
    mesh = Mesh(np.asarray(devices), ("sp",), axis_types=(AxisType.Auto,))
    print(f"{len(devices)} {devices[0].platform} devices, {args.layers} layers, {args.tokens} tokens, "
          f"{args.heads} heads of {args.dim}, {jnp.dtype(dtype).name}")
    print(f"{'policy':40s} {'permute MiB':>11s} {'temp MiB':>9s} {'host MiB':>9s} {'gather B/token':>14s}"
          + ("  max |grad diff|" if args.run else ""))
    reference, rows = None, []
    for index, policy in enumerate(POLICIES):
        if args.policies and index not in args.policies:
            continue
        grad, arguments = step(mesh, tokens=args.tokens, heads=args.heads, dim=args.dim, layers=args.layers,
                               dtype=dtype, policy=policy, backend=args.backend)
        compiled = grad.lower(*arguments).compile()
        text = compiled.as_text()
        moved = hlo.collective_bytes(text)["collective-permute"] / 2**20
        memory = compiled.memory_analysis()
        temp = memory.temp_size_in_bytes / 2**20
        host = getattr(memory, "host_temp_size_in_bytes", 0) / 2**20
        gathered = hlo.gathers(text)
        largest = gathered[0][1] / args.tokens if gathered else 0.0
        rows.append(dict(policy=policy, permute_mib=moved, temp_mib=temp, host_temp_mib=host,
                         largest_gather_bytes_a_token=largest))
        line = f"{policy:40s} {moved:11.2f} {temp:9.2f} {host:9.2f} {largest:14.1f}"
        if args.run and not args.tpu:
            grads = compiled(*arguments)
            reference = grads if reference is None else reference
            rows[-1]["max_grad_difference"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(reference, grads))
            line += f"  {rows[-1]['max_grad_difference']:.1e}"
        print(line, flush=True)
    if args.json:
        setting = dict(platform=devices[0].platform, topology=args.tpu, devices=len(devices), layers=args.layers,
                       tokens=args.tokens, heads=args.heads, dim=args.dim, dtype=jnp.dtype(dtype).name,
                       backend=args.backend, jax=jax.__version__)
        Path(args.json).write_text(json.dumps(dict(setting=setting, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
