"""Why the Triton kernels load their tiles without TMA: what a tensor descriptor needs at launch.

    python benchmarks/gpu/triton_tma.py

Compiles, for sm_90 and sm_100 (no GPU needed), a kernel that loads one 64x64 bf16 tile through a
device-side tensor descriptor (`tl.make_tensor_descriptor`, the only kind a kernel called from JAX could
use: jax_triton passes pointers, not host-side descriptors), and prints the global scratch memory the
kernel asks its launcher for and whether the PTX builds a tensor map and copies with TMA. jaxlib's
Triton launcher (`jaxlib/gpu/triton_kernels.cc`, `KernelCall::Launch`) passes a null pointer for that
scratch, so the descriptor would be written through a null pointer on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget


@triton.jit
def copy_tile(X, Y, N: tl.constexpr):
    """Rows 0..63 of an [N, 64] array X, loaded through a tensor descriptor, stored to Y."""
    desc = tl.make_tensor_descriptor(X, shape=[N, 64], strides=[64, 1], block_shape=[64, 64])
    tile = desc.load([0, 0])
    rows, cols = tl.arange(0, 64), tl.arange(0, 64)
    tl.store(Y + rows[:, None] * 64 + cols[None, :], tile)


def main() -> None:
    aligned = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=copy_tile, signature={"X": "*bf16", "Y": "*bf16", "N": "constexpr"},
                                       constexprs={"N": 128}, attrs={(0,): aligned, (1,): aligned})
    print(f"triton {triton.__version__}")
    for capability in (90, 100):
        kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32))
        ptx = kernel.asm["ptx"]
        print(f"sm_{capability}: global scratch {kernel.metadata.global_scratch_size} B "
              f"(align {kernel.metadata.global_scratch_align}), tensor map built in the kernel: "
              f"{'tensormap' in ptx}, TMA copy: {'cp.async.bulk.tensor' in ptx}")


if __name__ == "__main__":
    main()
