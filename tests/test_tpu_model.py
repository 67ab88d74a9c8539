"""The analytic TPU model (`tuner.models.tpu_model`) that ranks compiled variants: its FLOPs are those of the
tiles the schedules visit, in the ring and in the other strategies' rings over the Pallas kernel, a
transfer-bound ring takes its transfers' time, and every rate it uses names its source."""

import dataclasses

import numpy as np
import pytest

from tuner import registry
from tuner.models import tiles as tile_pairs
from tuner.models import tpu_model
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import Problem

CHIP = tpu_model.CHIPS["v5e"]


def test_full_attention_visits_every_tile_and_causal_about_half():
    full = Problem(seq_len=2048, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16", causal=False, ring_size=4)
    tiles = FwdParams(block_q=128, block_kv=128)
    local = full.local_len
    got = tpu_model.predict(full, CHIP, fwd=tiles)
    assert got.flops == 4 * local * local * full.heads * full.head_dim * full.ring_size  # 2 matmuls, every step
    causal = tpu_model.predict(Problem(**{**full.__dict__, "causal": True}), CHIP, fwd=tiles)
    assert 0.5 * got.flops < causal.flops < 0.6 * got.flops  # zigzag: balanced, the diagonal tiles whole
    assert causal.seconds < got.seconds
    bigger = tpu_model.predict(Problem(**{**full.__dict__, "causal": True}), CHIP, fwd=FwdParams(512, 512))
    assert bigger.flops > causal.flops  # larger tiles compute more of the masked diagonal


def test_packed_documents_are_counted_as_the_positions_alone():
    """The tiles a ring visits are counted by positions only, an upper bound where documents let tiles be
    skipped: a problem with segment ids gets the work of the same problem without them (it used to raise)."""
    plain = Problem(seq_len=2048, heads=4, kv_heads=2, head_dim=64, ring_size=4)
    packed = Problem(**{**plain.__dict__, "segments": 4})
    for params in ({"fwd": FwdParams(128, 128)}, {"bwd": BwdParams(128, 128, 128, 128)}):
        assert tpu_model.predict(packed, CHIP, **params).flops == tpu_model.predict(plain, CHIP, **params).flops


def test_a_transfer_bound_ring_takes_its_transfers_time_and_float32_is_slower():
    small = Problem(batch=1, seq_len=512, heads=1, kv_heads=1, head_dim=128, dtype="bfloat16", causal=False,
                    ring_size=4)
    got = tpu_model.predict(small, CHIP, bwd=BwdParams(128, 128, 128, 128))
    per_step = got.ici_bytes / small.ring_size / CHIP.ici_link
    assert got.seconds >= small.ring_size * per_step
    wide = Problem(seq_len=8192, heads=16, kv_heads=1, head_dim=128, dtype="bfloat16", causal=False, ring_size=4)
    bf16 = tpu_model.predict(wide, CHIP, fwd=FwdParams(512, 512))
    f32 = tpu_model.predict(Problem(**{**wide.__dict__, "dtype": "float32"}), CHIP, fwd=FwdParams(512, 512))
    assert f32.seconds > 3 * bf16.seconds  # compute-bound: six bf16 passes per float32 matmul
    with pytest.raises(ValueError, match="exactly one"):
        tpu_model.predict(wide, CHIP)


@pytest.mark.parametrize("causal", [False, True])
def test_the_strategies_visit_the_tiles_of_what_their_exchange_gathered(causal):
    """all_to_all's one step is the whole sequence in the layout's device-major order against itself: on a
    contiguous layout, a ring of one; all_gather's devices split its query tiles; the hybrid's ring over its
    ring positions is the ring over that many devices."""
    problem = Problem(seq_len=4096, heads=8, kv_heads=8, head_dim=128, ring_size=4, causal=causal, layout="zigzag")
    whole = tile_pairs.visited(problem, 256, 512, "all_to_all")
    assert whole.shape == (1, 4) and len(set(whole.flat)) == 1
    assert tile_pairs.visited(problem, 256, 512, "all_gather").sum() == whole[0, 0]
    one = dataclasses.replace(problem, ring_size=1, layout="contiguous")
    contiguous = dataclasses.replace(problem, layout="contiguous")
    assert tile_pairs.visited(contiguous, 256, 512, "all_to_all")[0, 0] == tile_pairs.visited(one, 256, 512)[0, 0]
    hybrid = dataclasses.replace(problem, a2a_size=2)
    assert np.array_equal(tile_pairs.visited(hybrid, 256, 512, "hybrid"),
                          tile_pairs.visited(dataclasses.replace(problem, ring_size=2), 256, 512))
    assert (whole[0, 0] < 16 * 8) == causal  # a causal mask skips tiles
    with pytest.raises(ValueError, match="two mesh axes"):
        tile_pairs.visited(problem, 256, 512, "hybrid")


@pytest.mark.parametrize("strategy, group", [("all_to_all", None), ("all_gather", None), ("hybrid", 2)])
def test_the_tiles_counted_inside_an_exchange_are_the_ones_its_kernel_computes(strategy, group):
    """The scan kernel inside each exchange, counted as it runs (`count_work`, per inner ring position; an
    exchange's devices all run at position 0, the hybrid's at their ring position), computes exactly the
    tile area `tiles.visited` counts: the gathered sequence is in the order the model assumes (its 512-token
    tiles straddle the zigzag's 256-token chunks, so a sequence counted in token order fails)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec

    from tuner.kernels.params import BwdParams
    from tuner.strategies.configs import TileConfig
    from tuner.support.work import count_work

    problem = Problem(seq_len=2048, heads=4, kv_heads=4, head_dim=8, ring_size=4, a2a_size=group or 1,
                      layout="zigzag", causal=True)
    axes = ("ring", "a2a") if group else ("sp",)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(-1, group) if group else np.array(jax.devices()[:4]), axes)
    implementation, config = registry.get(strategy), TileConfig(FwdParams(512, 512), BwdParams(512, 512))
    seq = PartitionSpec(None, axes if group else "sp")
    attend = jax.shard_map(
        lambda q, k, v: implementation.attend(q, k, v, spec=problem.spec, config=config,
                                              axis_name=axes if group else "sp", layout=problem.layout),
        mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq, check_vma=False)
    x = jnp.zeros((1, problem.seq_len, problem.heads, problem.head_dim), jnp.float32)
    with count_work() as counts:
        jax.block_until_ready(jax.jit(attend)(x, x, x))
    area = tile_pairs.visited(problem, 512, 512, strategy) * 512 * 512
    per_position = area.sum(axis=0) * (group or 1)  # every device of a hybrid's position runs its ring
    want = {0: int(area.sum())} if group is None else dict(enumerate(int(a) for a in per_position))
    assert dict(counts["tile_area"]) == want


def test_an_exchange_over_pallas_is_timed_on_what_its_kernel_runs():
    """all_to_all over the Pallas kernel: the ring's work, on H/P heads of the whole sequence, in one step that
    sends nothing (its exchange costs the same whatever the tiles, and is not timed); the model ranks its
    tiles for the warm start; an implementation over another kernel is refused, naming it."""
    problem = Problem(seq_len=8192, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16", ring_size=4)
    fwd = FwdParams(512, 1024)
    ring = tpu_model.predict(problem, CHIP, fwd=fwd)
    exchanged = tpu_model.predict(problem, CHIP, fwd=fwd, implementation="all_to_all_pallas_tpu")
    assert exchanged.flops == ring.flops and exchanged.ici_bytes == 0 < ring.ici_bytes
    implementation = registry.get("all_to_all_pallas_tpu")
    shapes = registry.tile_shapes(implementation, problem.shapes, problem.ring_size)
    assert (shapes.q_len, shapes.heads) == (8192, 2)
    default = implementation.default_config(shapes, problem.spec)
    picks = tpu_model.ranked(problem, "TPU v5 lite", implementation, implementation.space(shapes, problem.spec),
                             default, ("fwd",))
    assert picks and all(a[0] <= b[0] for a, b in zip(picks, picks[1:]))
    best, config = picks[0]
    assert best == tpu_model.predict(problem, CHIP, fwd=config.fwd, implementation=implementation.name).seconds
    assert best != tpu_model.predict(problem, CHIP, fwd=config.fwd).seconds  # not the ring's time
    with pytest.raises(ValueError, match="all_to_all_triton"):
        tpu_model.predict(problem, CHIP, fwd=fwd, implementation="all_to_all_triton")


def test_every_chip_names_its_source():
    for chip in tpu_model.CHIPS.values():
        assert chip.source.startswith("cloud.google.com/tpu/docs/") and chip.flops > 0 and chip.ici_link > 0


def test_a_kernels_vmem_is_read_from_its_scoped_region_not_from_the_start_of_vmem():
    """The compiler reports how far into VMEM a kernel's use reaches; where XLA keeps VMEM below the
    kernel's region (v5p: 4 MiB), the kernel's own use is the reach less the region's offset."""
    from tuner.models import hlo

    def line(name, offset, size, reach):
        return (f'  %{name} = f32[8]{{0}} custom-call(), custom_call_target="tpu_custom_call", backend_config='
                f'{{"scoped_memory_configs":[{{"memory_space":"1","offset":"{offset}","size":"{size}"}}],'
                f'"used_scoped_memory_configs":[{{"memory_space":"1","offset":"0","size":"{reach}"}}]}}')

    text = "\n".join([line("ring_attention_fwd.1", 4 << 20, 32 << 20, 9 << 20),
                      line("ring_attention_dq.2", 0, 64 << 20, 3 << 20), "  %other = f32[8]{0} add()"])
    assert hlo.kernel_vmem(text) == {"ring_attention_fwd.1": (32 << 20, 5 << 20),
                                     "ring_attention_dq.2": (64 << 20, 3 << 20)}


def test_a_transfer_overlaps_only_a_kernel_scheduled_between_its_start_and_its_completion():
    """The reader of a scheduled loop body pairs each collective-permute's completion with its start: a
    transfer started and completed on the same side of every kernel is reported, one started in an
    earlier iteration (a rotated loop) counts as in flight from the body's start."""
    from tuner.models import hlo

    def body(*ops):
        lines = []
        for op in ops:
            kind, _, name = op.partition(":")
            if kind == "start":
                lines.append(f"  %cp.{name} = (f32[8]) collective-permute-start(%x), channel_id=1")
            elif kind == "done":
                lines.append(f"  %d.{name} = f32[8] collective-permute-done(%cp.{name})")
            else:
                lines.append("  %k = f32[8] custom-call(), custom_call_target=\"tpu_custom_call\"")
        text = "\n".join(["%body (p: f32[8]) -> f32[8] {", *lines, "}", "ENTRY %main {",
                          "  %w = f32[8] while(%p), condition=%cond, body=%body", "}"])
        (parsed,) = hlo.loop_bodies(text)
        return parsed

    assert hlo.overlap_problem(body("start:a", "start:b", "kernel", "done:a", "kernel", "done:b")) is None
    assert hlo.overlap_problem(body("done:a", "kernel")) == "1 of 1 transfers overlap no kernel: cp.a"
    assert hlo.overlap_problem(body("start:a", "done:a")) == "no kernel in the loop body"
    assert hlo.overlap_problem(body("kernel", "done:a", "start:b", "kernel", "done:b")) is None
    assert hlo.overlap_problem(body("start:a", "kernel", "start:b", "done:b", "kernel", "done:a")) == \
        "1 of 2 transfers overlap no kernel: cp.b"


def test_the_vmem_estimate_admits_no_kernel_the_compiler_rejects_and_bounds_every_use():
    """Over the kernel compile results of every generation (`benchmarks/tpu/tpu_vmem_kernels.py`: each tile
    point of each kernel compiled alone by the production TPU compiler, failures included), the VMEM
    estimate the constraint rules by is at least the use the compiler reports wherever it compiled, and
    over the chip's limit wherever it did not: the constraint never admits a variant the compiler
    rejects; likewise for the kernels `benchmarks/tpu/tpu_vmem.py` compiled inside the whole ring. (How much it
    over-estimates is `python benchmarks/tpu/tpu_vmem_fit.py`'s report.)"""
    import json
    import re
    from pathlib import Path

    from tuner.kernels import tpu_memory

    results = Path(__file__).parent.parent / "benchmarks" / "tpu" / "results"
    records = [json.loads(line) for line in (results / "tpu_vmem_kernels.jsonl").read_text().splitlines()]
    for r in json.loads((results / "tpu_vmem.json").read_text()):  # inside the whole ring (tpu_vmem.py)
        block_q, block_kv, *compute = (int(n) for n in re.findall(r"\d+", r["tiles"]))
        records.append(dict(r, block_q=block_q, block_kv=block_kv, block_kv_compute=compute[0] if compute else None,
                            vmem_given=r["vmem_limit"]))
    limits = {r["target"]: r["vmem_given"] for r in records if r["vmem_given"]}
    assert {r["target"] for r in records} == set(limits) and len(limits) >= 4, sorted(limits)
    assert {(r["kernel"], r["dtype"]) for r in records} == set(tpu_memory.VMEM_MULTIPLES)
    for r in records:
        estimate = tpu_memory.vmem_bytes(r["kernel"], r["block_q"], r["block_kv"], r["head_dim"], r["dtype"], 1,
                                         r["block_kv_compute"])
        if r["compiled"]:
            assert r["vmem_used"] <= estimate, r
        else:
            assert estimate > limits[r["target"]], r


def test_each_generations_default_tiles_are_the_ones_chosen_from_its_compile_results():
    """`tpu_memory.GENERATION_TILES` is what `python benchmarks/tpu/tpu_defaults.py` chose from the compile
    results (benchmarks/tpu/results/tpu_defaults.json), for every generation; each default compiled there and
    the VMEM estimate admits it for float32 at D=128, so the defaults of a chip never wait for its
    constraint to cut them."""
    import json
    from pathlib import Path

    from tuner.kernels import tpu_memory

    results = Path(__file__).parent.parent / "benchmarks" / "tpu" / "results"
    chosen = json.loads((results / "tpu_defaults.json").read_text())
    by_chip = {c["chip"]: (FwdParams(**c["fwd"]), BwdParams(**c["bwd"])) for c in chosen["chips"]}
    assert by_chip == tpu_memory.GENERATION_TILES and set(by_chip) == {"v4", "v5e", "v5p", "v6e"}
    for name, (fwd, bwd) in tpu_memory.GENERATION_TILES.items():
        limit = tpu_memory.vmem_limit_bytes(tpu_memory.chip_info(name))
        for kernel, block_q, block_kv, compute in (("fwd", fwd.block_q, fwd.block_kv, fwd.block_kv_compute),
                                                   ("dkv", bwd.block_q_dkv, bwd.block_kv_dkv, None),
                                                   ("dq", bwd.block_q_dq, bwd.block_kv_dq, None)):
            assert tpu_memory.vmem_bytes(kernel, block_q, block_kv, 128, "float32", 1, compute) <= limit, name
