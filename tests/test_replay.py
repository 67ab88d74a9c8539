"""`benchmarks/search/replay.py` on synthetic landscapes of a tiny problem: the harness behind the sampler
table of docs/samplers.md. Without noise, a grid walk finds the best; a warm replay starts from the neighbour's best."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import optuna
import pytest

from tuner import registry
from tuner.semantics.problem import Problem

import scripts

replay = scripts.load("benchmarks/search/replay.py")

PROBLEM = Problem(batch=1, seq_len=256, heads=2, kv_heads=1, head_dim=16, causal=True, ring_size=2)


def write_landscape(path: Path, problem: Problem, best: tuple[int, int], device_kind: str = "cpu",
                    default: tuple[int, int] | None = None) -> None:
    """A forward landscape where every point takes 1 s plus 0.1 s per doubling away from `best`, no noise,
    recorded on `device_kind` with `default` tiles (the scan backend's where None)."""
    scan = registry.get("scan")
    space, default_config = scan.space(problem.shapes, problem.spec), scan.default_config(problem.shapes, problem.spec)
    recorded_default = default_config.to_dict()["fwd"]
    if default is not None:
        recorded_default.update(block_q=default[0], block_kv=default[1])
    points = []
    for config in space.grid(default_config, ("fwd",)):
        fwd = config.to_dict()["fwd"]
        steps = sum(abs(math.log2(fwd[n] / b)) for n, b in zip(("block_q", "block_kv"), best))
        points.append({"config": fwd, "status": "ok", "seconds": 1.0 + 0.1 * steps, "default_seconds": 2.0,
                       "rel": (1.0 + 0.1 * steps) / 2.0})
    path.write_text(json.dumps({"backend": "scan", "device": "cpu", "problem": dataclasses.asdict(problem),
                                "parts": {"fwd": {"points": points, "device_kind": device_kind,
                                                  "default": recorded_default,
                                                  "noise": {"default_rel": [1.0] * 5, "best_rel": [0.5] * 5}}}}))


@pytest.fixture
def landscapes(tmp_path) -> list[Path]:
    here, there = tmp_path / "landscape-here.json", tmp_path / "landscape-there.json"
    write_landscape(here, PROBLEM, best=(64, 32))
    write_landscape(there, dataclasses.replace(PROBLEM, seq_len=512), best=(64, 32))
    return [here, there]


def test_a_grid_walk_without_noise_ends_at_the_best(landscapes):
    recorded, _, _, space, default = replay.load(landscapes[0])
    land = {"fwd": replay.Landscape("fwd", recorded["parts"]["fwd"])}
    assert land["fwd"].sigma == 0.0
    points = len(space.grid(default, ("fwd",)))
    trace = replay.replay(land, space, default, "grid", seed=0, budget=points, grid_order=space.grid(default, ("fwd",)))
    assert len(trace) == points and trace[-1] == 1.0 and min(trace) == 1.0
    assert replay.trials_to_within(trace) <= points
    assert all(a >= b for a, b in zip(trace, trace[1:]))  # without noise the stored winner only improves


def test_a_warm_replay_starts_from_the_neighbours_best(landscapes):
    recorded, _, _, space, default = replay.load(landscapes[0])
    (warm,) = replay.warm_configs(landscapes[0], landscapes, "fwd")
    assert (warm.fwd.block_q, warm.fwd.block_kv) == (64, 32)
    land = {"fwd": replay.Landscape("fwd", recorded["parts"]["fwd"])}
    trace = replay.replay(land, space, default, "tpe", seed=0, budget=3, grid_order=space.grid(default, ("fwd",)),
                          warm=[warm])
    assert trace[1] == 1.0  # the second trial, the neighbour's best, is this problem's best


def test_a_walk_cut_short_is_neither_replayed_nor_a_neighbour(landscapes):
    assert replay.warm_configs(landscapes[0], landscapes, "fwd")  # whole, the other problem is a neighbour
    cut = json.loads(landscapes[1].read_text())
    cut["parts"]["fwd"]["complete"] = False  # as `landscape.py --deadline` leaves a walk it stopped
    landscapes[1].write_text(json.dumps(cut))
    assert not replay.replayable(cut, "fwd")
    assert replay.replayable(json.loads(landscapes[0].read_text()), "fwd")
    assert replay.warm_configs(landscapes[0], landscapes, "fwd") == []


def test_a_point_is_valued_by_its_time_over_the_default_of_its_run_not_by_its_drifting_seconds(landscapes):
    """The machine slowed 3-fold while the best point and its default were timed: its raw seconds are the
    worst of the grid, its time over the default of the same run is still the best, and that is its value."""
    recorded = json.loads(landscapes[0].read_text())
    points = recorded["parts"]["fwd"]["points"]
    best = next(p for p in points if (p["config"]["block_q"], p["config"]["block_kv"]) == (64, 32))
    best["seconds"] *= 3
    best["default_seconds"] *= 3
    assert best["seconds"] > max(p["seconds"] for p in points if p is not best)
    landscape = replay.Landscape("fwd", recorded["parts"]["fwd"])
    assert landscape.best == landscape.seconds(best["config"]) == pytest.approx(best["rel"] * 2.0)
    assert sorted(landscape.values.values()) == sorted(p["rel"] * 2.0 for p in points)


def test_a_replay_starts_from_the_default_of_its_device_kind_and_warms_from_the_same_kind(tmp_path):
    """A landscape recorded on a TPU chip with its own default tiles is replayed from them, a CPU one from
    today's default whatever it recorded; a neighbour recorded on another device kind is no neighbour."""
    here, elsewhere, older = (tmp_path / f"landscape-{name}.json" for name in ("here", "elsewhere", "older"))
    write_landscape(here, PROBLEM, best=(64, 32), default=(32, 32), device_kind="TPU v5 lite")
    write_landscape(elsewhere, dataclasses.replace(PROBLEM, seq_len=512), best=(64, 32))
    write_landscape(older, PROBLEM, best=(64, 32), default=(32, 32))
    recorded, _, _, space, default = replay.load(here)
    assert (default.fwd.block_q, default.fwd.block_kv) == (32, 32)
    assert replay.warm_configs(here, [here, elsewhere], "fwd") == []
    land = {"fwd": replay.Landscape("fwd", recorded["parts"]["fwd"])}
    trace = replay.replay(land, space, default, "grid", seed=0, budget=1, grid_order=space.grid(default, ("fwd",)))
    assert trace == [1.1]  # the default, one doubling from the best
    scan = registry.get("scan")
    assert replay.load(older)[4] == scan.default_config(PROBLEM.shapes, PROBLEM.spec) != default


def test_tiles_as_ranks_and_as_categories_walk_the_same_points(landscapes):
    """The search's space offers tiles as ranks; `benchmarks/search/ordered_tiles.py` compares it with categories.
    Both name every grid point by their own parameters, and a grid walk either way ends at the best."""
    ordered_tiles = scripts.load("benchmarks/search/ordered_tiles.py")
    recorded, _, _, space, default = replay.load(landscapes[0])
    categories = ordered_tiles.CategoryTileSpace(space.candidates)
    grid = space.grid(default, ("fwd",))
    for config in grid:
        ranks = space.params(config, ("fwd",))
        assert set(ranks) >= {"fwd.block_q_rank", "fwd.block_kv_rank"}
        assert categories.params(config, ("fwd",))["fwd.block_q"] == config.fwd.block_q
        for walked, params in ((space, ranks), (categories, categories.params(config, ("fwd",)))):
            assert walked.suggest(optuna.trial.FixedTrial(params), default, ("fwd",)) == config
            assert walked.config(params, default) == config
    land = {"fwd": replay.Landscape("fwd", recorded["parts"]["fwd"])}
    for walked in (space, categories):
        trace = replay.replay(land, walked, default, "grid", seed=0, budget=len(grid), grid_order=grid)
        assert trace[-1] == 1.0


def test_retiming_reaches_every_point_that_may_be_the_best():
    """A walk whose best (0.80) was a lucky draw of a point that takes 1.00: re-timing the points within 10%
    of the best value goes on until none is left, so the point that really takes 0.96 (walked 1.02, outside
    10% of the lucky 0.80) is re-timed too and comes out best; a point walked at 1.30 never is."""
    landscape = scripts.load("benchmarks/search/landscape.py")
    truth = {"lucky": 1.00, "near": 0.96, "third": 0.99, "far": 1.25}
    walked = {"lucky": 0.80, "near": 1.02, "third": 0.87, "far": 1.30}
    points = [{"config": {"name": n}, "status": "ok", "rel": r} for n, r in walked.items()]
    points.append({"config": {"name": "pruned"}, "status": "pruned", "reason": "too big"})
    order = []
    while todo := landscape.to_retime(points, 0.10):
        order.append(todo[0]["config"]["name"])
        todo[0]["retimed"] = [truth[order[-1]]] * 5
    assert order == ["lucky", "third", "near"]
    values = {p["config"]["name"]: landscape.value(p) for p in points if p["status"] == "ok"}
    assert min(values, key=values.get) == "near"
    assert values["far"] == 1.30 and "retimed" not in points[3]


def test_a_replay_values_a_retimed_point_at_its_median_only_where_the_retiming_ended(landscapes):
    recorded = json.loads(landscapes[0].read_text())
    part = recorded["parts"]["fwd"]
    best = min(part["points"], key=lambda p: p["rel"])
    best["retimed"] = [0.9] * 5  # the best point re-timed slower than walked (0.5)
    part["retime"] = {"complete": False}
    assert replay.Landscape("fwd", part).seconds(best["config"]) == pytest.approx(best["rel"] * 2.0)
    part["retime"] = {"complete": True}
    assert replay.Landscape("fwd", part).seconds(best["config"]) == pytest.approx(0.9 * 2.0)
