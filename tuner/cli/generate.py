"""`tuner generate`: render a kernel backend's standard variants (`tuner.kernels.codegen`), and report what they
build to without the hardware -- Triton kernels compiled for GPU targets (sm_80, sm_90, sm_100, ...) as
jax_triton compiles them (16-byte aligned pointers): shared memory, registers, spills, the MMA instructions
and whether they are the architecture's tensor-core path, the occupancy those imply
(`tuner.kernels.triton_compile.resources`); Pallas kernels lowered for TPU (the Mosaic kernels at the default tiles).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tuner.kernels import codegen
from tuner.kernels import pallas_tpu
from tuner.kernels import triton as triton_backend
from tuner.support.tables import table

# The backends with templates, by name.
TEMPLATED: dict[str, ModuleType] = {"triton": triton_backend, "pallas_tpu": pallas_tpu}


@dataclass
class Generated:
    """What `generate` did: the files rendered into `folder` (name, dtype, head dim, features), and the
    report of the `targets` compiled for (a row per kernel) or of the lowering (a row per variant)."""

    folder: str | os.PathLike
    files: list[list[Any]]
    report: list[dict[str, Any]]
    targets: Sequence[int]
    lowered: bool

    def render(self) -> str:
        """The files as a table, where they went, and the compile table or the lowering count."""
        lines = [table(["file", "dtype", "D", "features"], self.files),
                 f"rendered {len(self.files)} variants into {self.folder}"]
        if self.targets:
            lines.append(table(["file", "kernel", "target", "tiles", "warps", "stages", "smem KiB", "regs", "stack B",
                                "mma", "tensor core", "blocks/SM", "warps/SM", "limited by"],
                               [[r["file"], r["kernel"], r["target"], f"{r['block_q']}x{r['block_kv']}",
                                 r["num_warps"], r["num_stages"], f"{r['shared'] / 1024:.0f}", r["registers"],
                                 r["spill_bytes"], r["mma"], "yes" if r["tensor_core"] else "no",
                                 r.get("blocks_per_sm", "?"), r.get("warps_per_sm", "?"), r.get("limited_by", "?")]
                                for r in self.report]))
        if self.lowered:
            report = self.report
            lines.append(f"lowered {len(report)} variants for TPU at their default tiles for a "
                         f"{report[0]['local_len']}-token shard: {sum(r['mosaic_kernels'] for r in report)} Mosaic "
                         f"kernels" if report else "nothing to lower")
        return "\n".join(lines)


def generate(backend: str, *, out: str | os.PathLike | None = None, targets: Sequence[int] = (),
             lower: bool = False, dtypes: Sequence[str] | None = None) -> Generated:
    """Render the standard variants of `backend` (one of `TEMPLATED`; only `dtypes` when given) into
    `out` (default: the generated-kernel folder); compile each Triton kernel for `sm_<target>` of every
    target, or with `lower` export each Pallas variant for TPU (pallas_tpu)."""
    folder = out or codegen.generated_dir()
    files, report = [], []
    for variant in TEMPLATED[backend].standard_variants():
        if dtypes is not None and variant.features["dtype"] not in dtypes:
            continue
        path = codegen.render(variant, out)
        on = [k for k in ("causal", "window", "chunk", "segments", "softcap") if variant.features[k]]
        files.append([path.name, variant.features["dtype"], variant.features["head_dim"], ",".join(on) or "full"])
        for capability in targets:
            for entry in triton_backend.standard_resources(variant, capability):
                report.append({"file": path.name, **variant.features, **entry})
        if lower:
            shapes, spec = codegen.standard_shapes(variant)
            fwd, bwd = pallas_tpu.PallasTpuBackend().default_params(shapes.q_len, shapes.kv_len, shapes.head_dim)
            report.append({"file": path.name, **variant.features, "local_len": shapes.q_len,
                           "fwd_params": fwd.to_dict(), "bwd_params": bwd.to_dict(),
                           "mosaic_kernels": pallas_tpu.lower(shapes, spec, fwd, bwd)})
    return Generated(folder, files, report, targets, lower)
