"""The ring compiled by XLA:GPU for an H100, on a host without a GPU: what one device copies, sends and
holds, this tree against another commit.

    python benchmarks/gpu/xla_gpu_compile.py --implementations cudnn scan --rings 1 4 8 --against HEAD~1

XLA:GPU compiles for a GPU it is told about (`tuner/models/targets/h100.txtpb`, the device description XLA
reads in place of a GPU's) through `jax.experimental.topologies`, as `tuner.tuning.gpu_topology` does;
nothing runs. That needs jax's CUDA plugin of the
installed jax's version, best in a virtual environment of its own (with it, jax looks for a GPU at every
start):

    python -m venv /tmp/gpu-venv && /tmp/gpu-venv/bin/pip install -e . \\
        "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    /tmp/gpu-venv/bin/python benchmarks/gpu/xla_gpu_compile.py ...

For each implementation, ring size and mask (causal zigzag, and no mask), the ring of the implementation's
default tiles is compiled as a forward and as a forward and backward, 4096 tokens a device, 16 heads of
128, bfloat16, batch 1. From the compiled module (`tuner.models.hlo`) it reads the bytes a device writes
with kernels that compute nothing (`moved_bytes`: copies, slices), the bytes its collective permutes
receive and any all-gather (there must be none), and from `memory_analysis()` its temporaries; each side's
module is read by this tree's reader. The Triton
ring is not among them: jax_triton asks the GPU for its compute capability when it lowers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from revisions import check_tree, this_and_against, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# the chips described in this tree (`tuner/models/targets/`), whichever tree's `tuner` a worker compiles
DESCRIBED = os.path.join(HERE, os.pardir, os.pardir, "tuner", "models", "targets")
TARGETS = {name.removesuffix(".txtpb"): os.path.join(DESCRIBED, name) for name in sorted(os.listdir(DESCRIBED))}
OBJECTIVES = ("fwd", "fwd+bwd")
LOCAL_TOKENS = 4096


def worker(args: argparse.Namespace) -> None:
    """One JSON line per (implementation, ring, mask, objective), compiled by this process's `tuner`."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # the host's devices; the GPU is the topology's
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # no GPU, so no driver to check
    check_tree()
    import jax
    from jax.experimental import topologies

    from tuner import registry
    from tuner.semantics.problem import Problem
    from tuner.tuning.workload import Workload, vjp_of

    with open(TARGETS[args.target]) as f:
        config_text = f.read()
    folder = tempfile.mkdtemp(dir=args.hlo_dir)  # this tree's, beside the other's
    for ring in args.rings:
        devices = topologies.get_topology_desc(args.target, "cuda", target_config=config_text,
                                               topology=f"1x1x{ring}").devices
        for name in args.implementations:
            for causal in (True, False):
                problem = Problem(seq_len=LOCAL_TOKENS * ring, heads=16, kv_heads=16, head_dim=128,
                                  dtype="bfloat16", causal=causal, ring_size=ring, layout="zigzag", batch=1)
                workload = Workload(problem, devices=devices)
                with jax.sharding.use_abstract_mesh(workload.mesh.abstract_mesh):
                    config = registry.default_config(registry.get(name), problem.shapes, problem.spec, None)
                fn = workload.attend(name, config)
                inputs, dout = workload.structs()

                def forward_and_backward(x, cotangent, fn=fn):
                    out, vjp = vjp_of(fn, x)
                    return out, vjp(cotangent)

                for objective in OBJECTIVES:
                    lowered = (jax.jit(fn).lower(inputs) if objective == "fwd"
                               else jax.jit(forward_and_backward).lower(inputs, dout))
                    compiled = lowered.compile()
                    row = {"implementation": name, "ring": ring, "causal": causal, "objective": objective}
                    path = os.path.join(folder, "{implementation}-{ring}-{causal}-{objective}.hlo".format(**row))
                    with open(path, "w") as f:
                        f.write(compiled.as_text())
                    print(json.dumps({**row, "hlo": path, "temp": compiled.memory_analysis().temp_size_in_bytes}),
                          flush=True)


def read(row: dict) -> dict:
    """A worker's row with what this tree's `tuner.models.hlo` reads in its compiled module (the same reader
    for both trees)."""
    from tuner.models import hlo

    with open(row["hlo"]) as f:
        text = f.read()
    return {**row, "moved": hlo.moved_bytes(text), "received": hlo.collective_bytes(text),
            "gathers": len(hlo.gathers(text)), "cudnn_calls": text.count('custom_call_target="__cudnn$fmha'),
            "conditionals": text.count(" conditional(")}


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=tuple(TARGETS), default="h100")
    parser.add_argument("--implementations", nargs="+", default=["cudnn", "scan"])
    parser.add_argument("--rings", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--against", help="a git revision to compare with")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hlo-dir", help=argparse.SUPPRESS)  # where the workers write the compiled modules
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    with tempfile.TemporaryDirectory() as folder:
        forwarded = [*(argv if argv is not None else sys.argv[1:]), "--hlo-dir", folder]
        this, that = ({(r["implementation"], r["ring"], r["causal"], r["objective"]): read(r) for r in rows}
                      for rows in this_and_against(os.path.abspath(__file__), forwarded, args.against))
    print(f"XLA:GPU for {args.target}, {LOCAL_TOKENS} tokens a device, H=16, D=128, bfloat16, zigzag; MiB a device"
          + (f"; before: {args.against}" if args.against else ""))
    header = (f"{'implementation':<15} {'ring':>4} {'mask':<7} {'objective':<8} {'copied':>8} {'before':>8} "
              f"{'sliced':>8} {'before':>8} {'received':>9} {'temp':>8} {'before':>8} {'cuDNN':>5} {'branches':>8}")
    print(header)
    rows = []
    for key, row in this.items():
        name, ring, causal, objective = key
        before = that.get(key)
        rows.append({**{k: v for k, v in row.items() if k != "hlo"},
                     "before": before and {k: v for k, v in before.items() if k != "hlo"}})
        print(f"{name:<15} {ring:>4} {'causal' if causal else 'none':<7} {objective:<8} "
              f"{_mib(row['moved']['copy']):>8} {_mib(before and before['moved']['copy']):>8} "
              f"{_mib(row['moved']['slice']):>8} {_mib(before and before['moved']['slice']):>8} "
              f"{_mib(row['received']['collective-permute']):>9} {_mib(row['temp']):>8} "
              f"{_mib(before and before['temp']):>8} {row['cudnn_calls']:>5} {row['conditionals']:>8}")
        if row["gathers"]:
            print(f"  {row['gathers']} all-gathers: the ring must not gather")
    write_results(args.out, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
