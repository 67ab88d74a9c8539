"""Reading a compiled program's scheduled HLO (`compiled.as_text()`) for what the ring cares about: in
which order a loop body starts its transfers, runs its kernel and waits for the transfers, and how much
VMEM each kernel asked for and uses."""

from __future__ import annotations

import re

RING_OPS = ("collective-permute-start", "collective-permute-done", "conditional")
KERNEL_TARGETS = ("tpu_custom_call",)  # Mosaic kernels


def loop_bodies(hlo: str) -> list[list[str]]:
    """For each while loop of the module, in the order the loops appear, the ring-relevant instructions
    of its body in scheduled order: "collective-permute-start", "collective-permute-done",
    "conditional" (a step's skippable kernel) and "kernel" (a Mosaic custom call)."""
    computations = {}
    for block in re.split(r"\n(?=\S.*\{\n)", hlo):
        name = re.match(r"%?(\S+)", block.split("\n", 1)[0])
        ops = []
        for line in block.split("\n")[1:]:
            op = next((op for op in RING_OPS if f" {op}(" in line), None)
            if op is None and any(target in line for target in KERNEL_TARGETS):
                op = "kernel"
            if op is not None:
                ops.append(op)
        computations[name.group(1) if name else ""] = ops
    bodies = re.findall(r"\swhile\(.*?body=%?([\w.\-]+)", hlo)
    return [computations[body] for body in bodies if body in computations]


def kernel_vmem(hlo: str) -> dict[str, tuple[int, int]]:
    """Per Mosaic kernel of the module (by instruction name), the scoped VMEM it asked for and the VMEM
    the compiler reports it uses, in bytes (`scoped_memory_configs` and `used_scoped_memory_configs` of
    its backend config)."""
    kernels = {}
    for line in hlo.split("\n"):
        if "tpu_custom_call" not in line:
            continue
        name = re.match(r"\s*%?(\S+) =", line)
        asked = re.search(r'"scoped_memory_configs":\[\{[^]]*?"size":"(\d+)"', line)
        used = re.search(r'"used_scoped_memory_configs":\[\{[^]]*?"size":"(\d+)"', line)
        if name and asked and used:
            kernels[name.group(1)] = (int(asked.group(1)), int(used.group(1)))
    return kernels


def overlap_problem(body: list[str]) -> str | None:
    """Why the transfers of a loop body (from `loop_bodies`) do not all overlap its compute -- some
    collective-permute starting after the kernel (or its branch) or completing before it -- or None."""
    compute = [i for i, op in enumerate(body) if op in ("conditional", "kernel")]
    starts = [i for i, op in enumerate(body) if op == "collective-permute-start"]
    dones = [i for i, op in enumerate(body) if op == "collective-permute-done"]
    if not compute or not starts:
        return f"no {'kernel' if not compute else 'transfer'} in the loop body"
    late = sum(i > min(compute) for i in starts)
    early = sum(i < max(compute) for i in dones)
    if late or early:
        return f"{late} of {len(starts)} transfers start after the kernel, {early} complete before it"
    return None


__all__ = ["kernel_vmem", "loop_bodies", "overlap_problem"]
