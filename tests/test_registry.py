"""The registry is open: a toy implementation, defined and registered by this test alone (no module of
`tuner/` names it), is searched by `tuner search`, stored in the cache, chosen by the loader's `auto`,
explained, listed, and exact against the dense reference. A second toy runs over two mesh axes, as the
hybrid does: `tuner search --a2a-size` tunes it and the loader runs it on a 2-D mesh, with no edit of the
tuning or runtime layers. Also: the built-in implementations' configs round-trip through `to_dict` /
`from_dict`, and registering checks names."""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

from tuner import BwdParams, FwdParams, get_tuned_ring_attention, registry
from tuner.cache import Cache
from tuner.cli import main
from tuner.strategies.configs import NoConfig, TileConfig
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import AttentionSpec

TOY = "toy_chunked"
TOY_GRID = "toy_grid"
PROBLEM = ["--seq-len", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--ring-size", "4"]


@dataclass(frozen=True)
class ChunkConfig:
    """The toy's one setting: how many queries it attends at once."""

    chunk: int = 16

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {"fwd": {"chunk": self.chunk}, "bwd": {}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkConfig:
        chunk = data.get("fwd", {}).get("chunk")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0 or data.get("bwd") != {}:
            raise ValueError(f"fwd_params.chunk must be a positive int and bwd_params empty, got {data!r}")
        return cls(chunk)


class QueryChunked:
    """Gathered attention in plain jax.numpy: all-gather K/V, then the queries a chunk at a time."""

    name = TOY
    summary = "all-gather K/V, jax.numpy attention a query chunk at a time"
    config_type = ChunkConfig
    gathered = True

    def available(self, target: registry.Target) -> str | None:
        return None

    def supports(self, spec, dtype, head_dim: int, *, return_lse: bool = False) -> str | None:
        extras = (spec.window, spec.chunk_size, spec.softcap, spec.has_segments, spec.has_bias, spec.num_sinks,
                  return_lse)
        return "anything but the causal mask" if any(extras) else None

    def default_config(self, shapes, spec) -> ChunkConfig:
        return ChunkConfig()

    def space(self, shapes, spec) -> registry.Space:
        return registry.ChoiceSpace(ChunkConfig, fwd={"chunk": (8, 16, 32, 64)})

    def violation(self, shapes, spec, config: ChunkConfig, parts) -> str | None:
        return None if shapes.q_len % config.chunk == 0 else f"chunk {config.chunk} does not divide {shapes.q_len}"

    def check(self, config: ChunkConfig) -> None:
        if not isinstance(config, ChunkConfig):
            raise ValueError(f"{TOY} takes a ChunkConfig, got {config!r}")

    packages = ()

    def code_hash(self) -> str:
        return "toy-1"

    def vma_checked(self, target: registry.Target) -> bool:
        return True

    def attend(self, query, key, value, *, spec: AttentionSpec, config: ChunkConfig, axis_name, layout: str,
               interpret: bool = False, **arrays):
        from tuner.semantics import layouts

        size, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
        q_pos = layouts.local_positions(layout, query.shape[1], size, rank)
        kv_pos = lax.all_gather(layouts.local_positions(layout, key.shape[1], size, rank), axis_name, tiled=True)
        key, value = (lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (key, value))
        return chunked_attention(query, key, value, q_pos, kv_pos, spec, config)


def chunked_attention(query, key, value, q_pos, kv_pos, spec: AttentionSpec, config: ChunkConfig):
    """The local queries (at positions `q_pos`) against the whole gathered K/V (at `kv_pos`), `config.chunk`
    queries at a time, in jax.numpy."""
    b, tq, h, d = query.shape
    key, value = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (key, value))

    def chunk(start):
        q = lax.dynamic_slice_in_dim(query, start, config.chunk, axis=1).astype(jnp.float32)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, key.astype(jnp.float32)) * spec.scale
        if spec.causal:
            pos = lax.dynamic_slice_in_dim(q_pos, start, config.chunk)
            logits = jnp.where(kv_pos[None, None, None, :] <= pos[None, None, :, None], logits, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), value.astype(jnp.float32))

    out = lax.map(chunk, jnp.arange(0, tq, config.chunk))  # [chunks, B, chunk, H, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, tq, h, d).astype(query.dtype)


class GridChunked(QueryChunked):
    """The toy over two mesh axes `(ring_axis, group_axis)`: all-gather K/V over both, then the queries a
    chunk at a time. Declaring the hybrid's strategy is what makes it run over two axes."""

    name = TOY_GRID
    summary = "over two mesh axes: all-gather K/V over both, jax.numpy attention a query chunk at a time"
    strategy = "hybrid"

    def shape_violation(self, shapes, ring_size: int, group: int) -> str | None:
        return None if shapes.q_len % 8 == 0 else f"each device's {shapes.q_len} queries are not a multiple of 8"

    def attend(self, query, key, value, *, spec: AttentionSpec, config: ChunkConfig, axis_name, layout: str,
               interpret: bool = False, **arrays):
        from tuner.semantics import layouts

        q_pos = layouts.grouped_positions(layout, query.shape[1], axis_name)
        kv_pos = lax.all_gather(layouts.grouped_positions(layout, key.shape[1], axis_name), axis_name, tiled=True)
        key, value = (lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (key, value))
        return chunked_attention(query, key, value, q_pos, kv_pos, spec, config)


@pytest.fixture
def toy(monkeypatch):
    # The in-process CLI below asks the CPU client for its ring's devices: start the client first, with
    # the suite's devices (tests/conftest.py), so later tests in this process keep them.
    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the CLI sets its own
    implementation = registry.register(QueryChunked())
    yield implementation
    registry.unregister(TOY)


@pytest.fixture(scope="module")
def toy_db(tmp_path_factory) -> Path:
    """The cache a `tuner search` of the toy (3 trials, in this process) stored its winner in: one search
    for the tests that read it."""
    jax.devices()  # as in `toy`
    db = tmp_path_factory.mktemp("toy") / "tuning.sqlite"
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out:
        patch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        registry.register(QueryChunked())
        try:
            status = main(["search", "--device", "cpu", "--backend", TOY, *PROBLEM, "--trials", "3", "--runs", "1",
                           "--db", str(db)])
        finally:
            registry.unregister(TOY)
    assert status == 0, out.getvalue()
    return db


def test_a_toy_registered_here_is_searched_stored_chosen_and_explained(toy, toy_db, capsys):
    db = toy_db
    rows = Cache(db).rows()
    assert [r["backend"] for r in rows] == [TOY]
    stored = ChunkConfig.from_dict({"fwd": json.loads(rows[0]["fwd_params"]), "bwd": {}})

    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=db)
    q = jax.ShapeDtypeStruct((1, 256, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 16), jnp.float32)
    decision = attn.explain(q, kv, kv)
    assert (decision.backend, decision.source, decision.config) == (TOY, "exact", stored)
    assert TOY in decision.reason

    rng = np.random.default_rng(0)
    query = rng.standard_normal((1, 256, 4, 16)).astype(np.float32)
    key, value = (rng.standard_normal((1, 256, 2, 16)).astype(np.float32) for _ in range(2))
    got, want = jax.jit(lambda *a: (attn(*a), dense_attention(*a, causal=True)[0]))(query, key, value)  # one compile
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)

    assert main(["list", "--db", str(db)]) == 0
    listed = capsys.readouterr().out
    assert TOY in listed and "invalid" not in listed


@pytest.fixture
def toy_grid(monkeypatch):
    jax.devices()  # as in `toy`
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    implementation = registry.register(GridChunked())
    yield implementation
    registry.unregister(TOY_GRID)


def test_a_toy_over_two_axes_is_searched_and_run_by_the_loader_on_a_2d_mesh(toy_grid, tmp_path, capsys):
    db = tmp_path / "tuning.sqlite"
    status = main(["search", "--device", "cpu", "--backend", TOY_GRID, *PROBLEM, "--a2a-size", "2",
                   "--trials", "3", "--runs", "1", "--db", str(db)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f'axis_name=("ring", "a2a"), backend="{TOY_GRID}", causal=True' in out  # the loader call it prints
    [row] = Cache(db).rows()
    assert (row["backend"], row["ring_size"], row["q_len"]) == (TOY_GRID, 4, 64)  # its own shapes: no key hook
    stored = ChunkConfig.from_dict({"fwd": json.loads(row["fwd_params"]), "bwd": {}})

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("ring", "a2a"))
    attn = get_tuned_ring_attention(axis_name=("ring", "a2a"), causal=True, mesh=mesh, db=db, backend=TOY_GRID)
    rng = np.random.default_rng(1)
    query = rng.standard_normal((1, 256, 4, 16)).astype(np.float32)  # NumPy: slicing it below compiles nothing
    key, value = (rng.standard_normal((1, 256, 2, 16)).astype(np.float32) for _ in range(2))
    decision = attn.explain(query, key, value)
    assert (decision.backend, decision.source, decision.config) == (TOY_GRID, "exact", stored)
    got, want = jax.jit(lambda *a: (attn(*a), dense_attention(*a, causal=True)[0]))(query, key, value)  # one compile
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match=f"backend '{TOY_GRID}' runs over 2 mesh axis"):
        get_tuned_ring_attention(axis_name="sp", backend=TOY_GRID)
    with pytest.raises(ValueError, match="queries are not a multiple of 8"):  # its shape hook, asked with the group
        attn.explain(*(x[:, :16] for x in (query, key, value)))


def test_without_the_toy_its_rows_are_passed_over_not_fatal(toy, toy_db):
    db = toy_db
    registry.unregister(TOY)
    try:
        mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
        attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=db)
        q = jax.ShapeDtypeStruct((1, 256, 4, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, 256, 2, 16), jnp.float32)
        assert attn.explain(q, kv, kv).backend == "scan"
    finally:
        registry.register(QueryChunked())


@pytest.mark.parametrize("config", [
    TileConfig(FwdParams(64, 32), BwdParams(16, 32)),
    TileConfig(FwdParams(8, 4, num_warps=4, num_stages=2), BwdParams(4, 8, 8, 8, num_warps=2)),
    NoConfig(),
])
def test_configs_round_trip_and_hash(config):
    again = type(config).from_dict(config.to_dict())
    assert again == config and hash(again) == hash(config)


def test_tile_config_names_the_bad_field():
    with pytest.raises(ValueError, match="fwd_params has unknown key"):
        TileConfig.from_dict({"fwd": {"block_q": 8, "block_kv": 8, "tile": 3}, "bwd": BwdParams().to_dict()})
    with pytest.raises(ValueError, match="bwd_params: BwdParams.block_q_dkv"):
        TileConfig.from_dict({"fwd": FwdParams().to_dict(), "bwd": {"block_q_dkv": 0, "block_kv_dkv": 8}})


def test_register_checks_the_name_and_refuses_to_shadow():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.get("scan"))
    with pytest.raises(ValueError, match="identifier"):
        registry.register(type("Bad", (), {"name": "ring/x"})())
    with pytest.raises(ValueError, match="backend must be one of auto, scan"):
        registry.get("nope")


def test_choice_space_walks_each_part_and_names_its_configs():
    space = registry.ChoiceSpace(ChunkConfig, fwd={"chunk": (8, 16, 32)})
    assert space.grid(ChunkConfig(), ("fwd", "bwd")) == [ChunkConfig(8), ChunkConfig(16), ChunkConfig(32)]
    assert space.grid(ChunkConfig(), ("bwd",)) == [ChunkConfig()]  # nothing to tune in the backward pass
    params = space.params(ChunkConfig(32), ("fwd",))
    assert params == {"fwd.chunk": 32} and space.config(params, ChunkConfig()) == ChunkConfig(32)


def test_an_implementation_that_cannot_take_a_problem_is_refused_by_name():
    """`registry.taking`, which the TPU and GPU compile reports and the dry run start from: the
    implementation where it takes the problem wherever it runs (a TPU's, on this CPU host), else a
    `ValueError` with its name and why."""
    from dataclasses import replace

    from tuner.semantics.problem import Problem

    problem = Problem(batch=1, seq_len=1024, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16", causal=True,
                      ring_size=4, layout="zigzag")
    assert registry.taking("pallas_tpu", problem) is registry.get("pallas_tpu")
    with pytest.raises(ValueError, match=r"^all_to_all cannot run these shapes: .*head"):
        registry.taking("all_to_all", replace(problem, heads=6, kv_heads=6))
