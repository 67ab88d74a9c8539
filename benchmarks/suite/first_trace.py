"""What a ring's first trace costs before XLA compiles it: the seconds to lower the gradient of a causal zigzag
ring of 4 simulated CPU devices over the cudnn kernel's XLA twin (1 x 128 tokens, 2 heads, D=16, bfloat16,
chunks of 8: the kernel that asks the trace the most), and how many programs were compiled while it traced.

    python benchmarks/suite/first_trace.py
    python benchmarks/suite/first_trace.py --backend scan

Those programs were the rules the trace ran on the positions it knows (`tuner/semantics/known.py`), as jax
programs, and single operations that made constants: 47, then 15; since the rules run in NumPy, none. Run
it in a fresh process each time: a second trace in one process reuses what the first compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner.kernels.params import BwdParams, FwdParams  # noqa: E402
from tuner.semantics.spec import AttentionSpec  # noqa: E402
from tuner.strategies.ring import run_ring  # noqa: E402


@contextlib.contextmanager
def compiles_counted() -> Iterator[list[float]]:
    """The seconds of each XLA compile while the block runs (jax.monitoring's compile events), in a list
    that grows as they happen."""
    seconds: list[float] = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def lower_ring_gradient(backend: str = "cudnn") -> None:
    """Trace and lower, not compile, the gradient of the module's ring, built anew over `backend`."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    spec = AttentionSpec(scale=0.25, causal=True)
    q = jax.ShapeDtypeStruct((1, 128, 2, 16), jnp.bfloat16)

    def local(q, k, v):
        return run_ring(q, k, v, spec=spec, backend=backend, fwd_params=FwdParams(8, 8),
                        bwd_params=BwdParams(8, 8), axis_name="sp", layout="zigzag", interpret=True)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    jax.jit(jax.grad(lambda q, k, v: sharded(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))).lower(q, q, q)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cudnn", choices=["cudnn", "scan"], help="the block kernel")
    args = parser.parse_args(argv)
    with compiles_counted() as compiles:
        start = time.perf_counter()
        lower_ring_gradient(args.backend)
        seconds = time.perf_counter() - start
    print(f"{args.backend}: lowered in {seconds:.2f} s; {len(compiles)} programs compiled while tracing, "
          f"{sum(compiles):.2f} s of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
