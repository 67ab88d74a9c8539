"""XLA:CPU runs two collective-permutes at once in a program loaded back from JAX's persistent
compilation cache, and then aborts (benchmarks/cpu_ring/README.md, "A crash in XLA:CPU's collectives").

The program needs nothing of ring-tuner: on 4 simulated CPU devices, a loop whose body sends an array
to the next device (`lax.ppermute`), and ten more sends outside the loop that do not depend on it.
Each try runs the program `--calls` times in a fresh process, twice: compiled there ("fresh"), and loaded
back from a cache folder that an earlier process filled ("cached"). A try fails when its process does
not exit 0 (an abort, a heap corruption, or a hang past `--timeout`).

    python benchmarks/cpu_ring/cpu_cache_rendezvous.py            # 3 tries of each, 200 calls a try
    python benchmarks/cpu_ring/cpu_cache_rendezvous.py --ring     # the scan ring's fwd+bwd program instead
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROGRAM = '''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

jax.config.update("jax_compilation_cache_dir", sys.argv[1] or None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
mesh = Mesh(np.array(jax.devices()), ("x",))
sharded = NamedSharding(mesh, P("x"))


def shift(x):
    return jax.lax.ppermute(x, "x", [(i, (i + 1) % 4) for i in range(4)])


def program(looped, *others):
    looped = jax.lax.fori_loop(0, 4, lambda i, x: shift(jnp.sin(x)), looped)
    return looped, *(shift(x) for x in others)


step = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P("x"),) * 11, out_specs=(P("x"),) * 11))
args = [jax.device_put(jnp.ones(4 * 2**16), sharded)]
args += [jax.device_put(jnp.ones(4 * 2**14 + 4 * i), sharded) for i in range(10)]
for _ in range(int(sys.argv[2])):
    jax.block_until_ready(step(*args))
'''

RING = '''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import tuner

jax.config.update("jax_compilation_cache_dir", sys.argv[1] or None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
mesh = Mesh(np.array(jax.devices()), ("sp",))
q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((1, 4096, 8, 64)), jnp.float32) for i in range(3))
ring = jax.shard_map(lambda q, k, v: tuner.ring_attention(q, k, v, axis_name="sp", backend="scan"), mesh=mesh,
                     in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
step = jax.jit(jax.grad(lambda q, k, v: ring(q, k, v).sum(), argnums=(0, 1, 2)))
for _ in range(int(sys.argv[2])):
    jax.block_until_ready(step(q, k, v))
'''


def run(code: str, cache: str, calls: int, timeout: float) -> str:
    """One fresh process: 'ok', or how it ended."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["JAX_PLATFORMS"] = "cpu"
    try:
        proc = subprocess.run([sys.executable, "-c", code, cache, str(calls)], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"hung over {timeout:.0f} s"
    if proc.returncode == 0:
        return "ok"
    lines = [line for line in proc.stderr.splitlines() if "Check failed" in line or "malloc" in line
             or "corruption" in line or "free()" in line]
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    said = (lines or proc.stderr.splitlines()[-1:] or [""])[0]
    return f"{how}: {said[:160]}" if said else how


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=3, help="processes of each kind (default 3)")
    parser.add_argument("--calls", type=int, default=200, help="calls of the program per process (default 200)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a process counts as hung")
    parser.add_argument("--ring", action="store_true", help="the scan ring's fwd+bwd program, 10 calls a try")
    args = parser.parse_args()
    code, calls = (RING, 10) if args.ring else (PROGRAM, args.calls)
    print(f"jax {__import__('jax').__version__}; {'the scan ring' if args.ring else 'loop + sends'}; "
          f"{calls} calls a process")
    with tempfile.TemporaryDirectory() as folder:
        cache = str(Path(folder) / "jax-cache")
        filled = run(code, cache, 1, args.timeout)
        print(f"filling the cache: {filled}")
        for kind, where in (("fresh", ""), ("cached", cache)):
            ends = [run(code, where, calls, args.timeout) for _ in range(args.tries)]
            failed = sum(end != "ok" for end in ends)
            print(f"{kind:>6}: {failed}/{len(ends)} processes failed")
            for end in sorted(set(ends) - {"ok"}):
                print(f"        {end}")


if __name__ == "__main__":
    main()
