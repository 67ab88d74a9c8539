"""What a Triton template change does to the compiled code: one launch compiled from the template of a git
revision and from the working tree, side by side (issue 31: each kernel change's prediction and outcome).

    python benchmarks/gpu/triton_sass_diff.py --rev HEAD~1 [--variant causal/bfloat16/128] [--kernels all]
                                              [--tiles fwd=128x64,dkv=64x64,dq=64x64] [--warps 8] [--stages 2]
                                              [--target sm_90] [--local-len 4096] [--heads 16]

For each kernel, prints the resources of `tuner.kernels.triton_compile.resources` (registers, stack bytes, shared
memory, MMA family) and the count of a few SASS opcodes in the whole kernel: the float32 multiplies and
fused multiply-adds (FMUL, FFMA), the special-function unit's exponentials (MUFU.EX2) and the matrix
instructions, for both templates.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import jax.numpy as jnp

from tuner.kernels import codegen, triton_compile, triton_launch
from tuner.semantics.spec import LocalShapes
from tuner.support.tables import table

sys.path.insert(0, str(Path(__file__).parent))
from triton_resources import parse_variant  # noqa: E402 - the sweep's variant syntax

ROOT = Path(__file__).resolve().parents[2]
OPCODES = ("FMUL", "FFMA", "FADD", "MUFU.EX2", "HMMA", "HGMMA", "UTCHMMA")


def sass_counts(source: codegen.Variant, kernel: str, constants: dict, warps: int, stages: int,
                capability: int) -> Counter:
    """Opcode counts (the mnemonic with its first modifier) of the kernel's SASS."""
    compiled = triton_compile._compiled(source, kernel, tuple(sorted(constants.items())), warps, stages, capability)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([triton_compile._tool("cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True).stdout
    counts = Counter()
    for opcode in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+(?:\.[A-Z0-9]+)?)", sass):
        counts[opcode] += 1
        counts[opcode.split(".")[0]] += opcode != opcode.split(".")[0]
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="git revision whose template is the 'before'")
    parser.add_argument("--variant", default="causal/bfloat16/128")
    parser.add_argument("--tiles", default="fwd=128x64,dkv=64x64,dq=64x64")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--target", default="sm_90")
    parser.add_argument("--local-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
    spec, dtype, head_dim, value_head_dim = parse_variant(args.variant)
    shapes = LocalShapes(1, args.local_len, args.local_len, args.heads, args.heads, head_dim, dtype,
                         value_head_dim=value_head_dim)
    capability = int(args.target[3:])
    tiles = {part: tuple(int(t) for t in size.split("x")) for part, size in
             (item.split("=") for item in args.tiles.split(","))}
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:templates/triton/{triton_launch.TEMPLATE}"],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "triton").mkdir()
        (Path(folder) / "triton" / triton_launch.TEMPLATE).write_text(old)
        for label, templates in ((args.rev, Path(folder)), ("working tree", codegen.TEMPLATES)):
            codegen.TEMPLATES = templates
            triton_compile._compiled.cache_clear()  # its key is the variant's features, the same for both templates
            source = triton_launch.variant(spec, jnp.dtype(dtype), head_dim, value_head_dim)
            for part, (block_q, block_kv) in tiles.items():
                kernel = f"attention_{part}"
                constants = triton_launch.launch_constants(shapes, spec, block_q, block_kv)
                report = triton_compile.resources(source, kernel, constants, num_warps=args.warps,
                                          num_stages=args.stages, capability=capability)
                counts = sass_counts(source, kernel, constants, args.warps, args.stages, capability)
                rows.append([label, kernel, f"{block_q}x{block_kv}", report["registers"], report["spill_bytes"],
                             report["shared"] // 1024, report["mma"], *(counts[o] for o in OPCODES)])
    print(f"{args.variant}, {args.warps} warps, {args.stages} stages, {args.target}, {args.local_len} tokens")
    print(table(["template", "kernel", "tiles", "regs", "stack B", "smem KiB", "mma", *OPCODES], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
