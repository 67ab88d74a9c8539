"""Tune what the model runs (`tuner.runtime.record`, `tuner.autotune`, `tuner record|doctor|search --from`): the
example language model's training step is traced, its attention problems recorded exactly, tuned, and the
same step then runs the tuned decisions with unchanged results; record files are read line by line, bad
lines reported and skipped; the verbs round-trip a real recorded program."""

import dataclasses
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.cases import rel_err
from tuner.tuning import autotuning
from tuner import get_tuned_ring_attention, ring_attention
from tuner.runtime import record
from tuner.semantics.problem import Problem
from tuner.cli import main
from tuner.tuning.search import SearchOptions

QUICK = SearchOptions(runs=1, final_runs=1, top=1)  # a search in seconds: these tests check wiring, not speed


def quiet_mesh(size: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:size]), ("sp",))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax (pip install -e '.[flax]')")
def test_autotune_records_tunes_and_then_runs_the_example_models_step(tmp_path, monkeypatch):
    """The Flax example's training step (forward and backward, 8 devices): exactly its one problem is
    recorded, for both layers; after autotune the step's loader reports `exact` for every call, and the
    step computes what it computed before tuning."""
    monkeypatch.setenv("TUNER_DB", str(tmp_path / "tuning.sqlite"))
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    import long_context_lm

    config = long_context_lm.Config(seq_len=128, batch=2, num_layers=2, steps=1)
    params, opt_state, train_step, batch = long_context_lm.build(config)
    args = (params, opt_state, *batch(np.random.default_rng(0)), jax.random.key(0))

    calls = record.calls_in(train_step, *args)
    assert len(calls) == 1, [c.problem().describe() for c in calls]  # two layers, one problem
    call = calls[0]
    head_dim = config.embed_dim // config.num_heads
    assert call.problem().describe() == (f"B={config.batch} T={config.seq_len} H={config.num_heads} "
                                         f"Hkv={config.num_kv_heads} D={head_dim} float32 causal | ring "
                                         f"{config.devices} x {config.seq_len // config.devices} tokens, zigzag")
    assert call.gradients and call.caller == "loader" and call.source == "default"
    assert set(call.arrays) == {"q_positions", "kv_positions"}  # the layer passes its rotary positions

    untuned = jax.tree.leaves(train_step(*args))
    report = autotuning.autotune(train_step, *args, trials=1, options=QUICK, progress=False)
    [outcome] = report.outcomes
    assert (outcome.before, outcome.after) == ("default", "exact") and outcome.speedup > 0, report.render()
    assert outcome.note.startswith("tuned (fwd+bwd") and report.covered
    assert [c.source for c in record.calls_in(train_step, *args)] == ["exact"]
    assert autotuning.replay(call).source == "exact"  # explain() of the same call agrees

    tuned = jax.tree.leaves(train_step(*args))
    for got, want in zip(tuned, untuned, strict=True):
        if jnp.issubdtype(want.dtype, jnp.floating):
            assert rel_err(np.asarray(got), np.asarray(want)) <= 1e-5

    again = autotuning.autotune(train_step, *args, trials=1, options=QUICK, progress=False)
    assert [(o.before, o.note) for o in again.outcomes] == [("exact", "already tuned")]
    with pytest.raises(ValueError, match="db="):
        autotuning.autotune(train_step, *args, db=str(tmp_path / "other.sqlite"))


def test_calls_are_read_from_the_program_even_when_it_was_traced_before(tmp_path):
    """Gradients are seen where the program differentiates through the call and only there; a
    `ring_attention` call is recorded as untunable, and saying so; a jitted function traced before is
    read from jax's cached trace."""
    mesh = quiet_mesh(4)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=tmp_path / "db.sqlite")
    direct = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", sliding_window=16), mesh=mesh,
                           in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    q, k = jnp.ones((1, 64, 4, 16)), jnp.ones((1, 64, 2, 16))

    @jax.jit
    def step(q, k):
        return jax.grad(lambda q: attn(q, k, k).sum())(q) + direct(q, k, k)

    step.trace(q, k)  # traced before it is read, into the cache of traces a call fills too (compiling adds nothing)
    calls = {c.caller: c for c in record.calls_in(step, q, k)}
    assert calls["loader"].gradients and not calls["ring_attention"].gradients
    assert calls["ring_attention"].source == "caller"
    with pytest.raises(ValueError, match="never reads the cache"):
        calls["ring_attention"].problem()
    assert not record.calls_in(lambda q, k: attn(q, k, k), q, k)[0].gradients
    scaled = record.calls_in(lambda q, k, twice: attn(q * (2 if twice else 1), k, k), q, k, True, static_argnums=2)
    assert [c.id for c in scaled] == [calls["loader"].id]


def packed_step(tmp_path, layout: str, two_axes: bool = False):
    """A jitted gradient step through a loader whose packed calls declare no packing (4 devices: a ring, or
    a 2 x 2 mesh; 128 tokens of one long document and three short ones), and its arguments."""
    if two_axes:
        mesh, axes = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("ring", "group")), ("ring", "group")
    else:
        mesh, axes = quiet_mesh(4), "sp"
    attn = get_tuned_ring_attention(axis_name=axes, causal=True, mesh=mesh, layout=layout, db=tmp_path / "db.sqlite")
    segments = jnp.asarray(np.repeat(np.arange(1, 5), [80, 16, 16, 16])[None], jnp.int32)
    q, k = (jnp.asarray(np.random.default_rng(i).standard_normal((1, 128, h, 8)), jnp.float32)
            for i, h in ((0, 2), (1, 1)))

    @jax.jit
    def step(q, k, segments):
        return jax.grad(lambda q: attn(q, k, k, q_segment_ids=segments, kv_segment_ids=segments).sum())(q)

    return step, (q, k, segments)


@pytest.mark.parametrize("layout, two_axes", [("zigzag", False), ("documents", False), ("zigzag", True)])
def test_a_run_observed_gives_back_the_rows_each_packed_call_gets(tmp_path, layout, two_axes):
    """`record.observe`: each device's shard of the segment ids, put back in token order by the layout's
    positions (zigzag, over one axis or two) or by those the call passes (the documents layout), is the rows
    the step got; the step traced again carries no callback."""
    step, args = packed_step(tmp_path, layout, two_axes)
    [call] = record.calls_in(step, *args)
    seen = record.observe(step, *args, calls=[call])
    assert list(seen) == [call.id] and np.array_equal(seen[call.id], args[2])
    assert "debug_callback" not in str(jax.make_jaxpr(step)(*args))


def test_autotune_tunes_an_undeclared_packing_on_the_rows_the_step_gets(tmp_path):
    """Packed calls that declare no packing: autotune runs the step once, fits the packing of the rows it
    saw, and tunes the calls' own key on rows drawn from it; the step then runs the tuned row, and a
    second autotune has nothing to observe. With only the arguments' shapes nothing runs."""
    step, args = packed_step(tmp_path, "zigzag")
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    assert autotuning._observed_packings(step, shapes, (), record.calls_in(step, *shapes)) == {}
    report = autotuning.autotune(step, *args, trials=1, options=QUICK, progress=False)
    [outcome] = report.outcomes
    assert outcome.problem.drawn == "80,16x3" and "drawn=80,16x3" in outcome.problem.describe()
    assert Problem.parse(outcome.problem.describe()) == outcome.problem
    assert (outcome.before, outcome.after) == ("default", "exact"), report.render()
    again = autotuning.autotune(step, *args, trials=1, options=QUICK, progress=False)
    assert [(o.before, o.note) for o in again.outcomes] == [("exact", "already tuned")]


def test_autotune_weighs_the_rival_engines_of_a_call_that_left_the_choice_to_auto(tmp_path, monkeypatch):
    """On a GPU a call of backend auto runs triton until cudnn is measured faster; autotune searches both and
    times them side by side. Here the same flow with dense as the scan ring's rival on the CPU: the call then
    runs the engine timed faster, from that measurement; a call that names its backend is tuned alone."""
    from tuner import registry

    monkeypatch.setitem(registry.RIVALS, "cpu", ("dense",))
    mesh = quiet_mesh(2)
    q = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.float32)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=tmp_path / "db.sqlite")
    report = autotuning.autotune(lambda q: attn(q, q, q), q, trials=1, options=QUICK, progress=False)
    [outcome] = report.outcomes
    assert outcome.note.startswith("tuned (fwd, 1 trial); dense tuned too; ") and "timed fastest side by side" \
        in outcome.note, outcome.note
    winner = outcome.note.split("; ")[-1].split()[0]
    [after] = record.calls_in(lambda q: attn(q, q, q), q)
    assert (outcome.after, after.decision["implementation"]) == ("exact", winner), after.decision
    assert after.decision["reason"].startswith(f"tuner bench --mechanisms measured {registry.label(winner)} fastest")

    named = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, backend="scan",
                                     db=tmp_path / "named.sqlite")
    [alone] = autotuning.autotune(lambda q: named(q, q, q), q, trials=1, options=QUICK, progress=False).outcomes
    assert alone.note == "tuned (fwd, 1 trial)" and alone.after == "exact", alone.note


def test_a_problem_tuned_before_its_rivals_were_weighed_has_them_weighed_once(tmp_path, monkeypatch):
    """A cache tuned when the platform had no rival (the scan ring's exact row) gets the rival's search and
    the race on the next autotune, without the tuned engine's search again; the one after has nothing to do."""
    from tuner import registry

    q = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.float32)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=quiet_mesh(2), db=tmp_path / "db.sqlite")
    step = lambda q: attn(q, q, q)  # noqa: E731
    [first] = autotuning.autotune(step, q, trials=1, options=QUICK, progress=False).outcomes
    assert (first.note, first.after) == ("tuned (fwd, 1 trial)", "exact")

    monkeypatch.setitem(registry.RIVALS, "cpu", ("dense",))
    [told] = autotuning.doctor(record.calls_in(step, q))
    assert told.note.startswith("covered; not raced against dense yet (autotune"), told.note
    [weighed] = autotuning.autotune(step, q, trials=1, options=QUICK, progress=False).outcomes
    assert weighed.note.startswith("already tuned; dense tuned too; ") and weighed.weighed, weighed.note
    winner = weighed.note.split("; ")[-1].split()[0]
    assert record.calls_in(step, q)[0].decision["implementation"] == winner
    assert autotuning.doctor(record.calls_in(step, q))[0].note == "covered"
    [again] = autotuning.autotune(step, q, trials=1, options=QUICK, progress=False).outcomes
    assert (again.note, again.weighed) == ("already tuned", False)


def recorded_call(tmp_path) -> record.Call:
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=quiet_mesh(2), db=tmp_path / "db.sqlite")
    q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float32)
    return record.calls_in(lambda q: attn(q, q, q), q)[0]


def test_record_files_report_bad_lines_and_merge_the_lines_of_one_call(tmp_path):
    call = recorded_call(tmp_path)
    good = call.to_json()
    lines = [json.dumps(good), json.dumps({**good, "gradients": True}), json.dumps({**good, "colour": "red"}),
             json.dumps({**good, "version": 99}), json.dumps(good)[:70], "[1, 2]",
             json.dumps({k: v for k, v in good.items() if k != "layout"}), json.dumps({**good, "ring_size": 0}), ""]
    path = tmp_path / "calls.jsonl"
    path.write_text("\n".join(lines))
    recording = record.read(path)
    assert [c.id for c in recording.calls] == [call.id] and recording.calls[0].gradients
    assert recording.calls[0] == dataclasses.replace(call, gradients=True)
    reasons = dict(p.split(": ", 1) for p in recording.problems)
    assert set(reasons) == {f"line {n}" for n in (3, 4, 5, 6, 7, 8)}
    assert "unknown field(s) colour" in reasons["line 3"]
    assert "record version 99" in reasons["line 4"]
    assert "truncated?" in reasons["line 5"]
    assert "expected a JSON object" in reasons["line 6"]
    assert "missing field(s) layout" in reasons["line 7"]
    assert "ring_size must be a positive integer" in reasons["line 8"]

    record.write(path, recording.calls)
    assert record.read(path).calls == recording.calls and len(path.read_text().splitlines()) == 1


PROGRAM = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from tuner import get_tuned_ring_attention
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh)
    window = get_tuned_ring_attention(axis_name="sp", causal=True, sliding_window=8, mesh=mesh)
    q = jnp.ones((1, 64, 2, 16))
    jax.jit(jax.grad(lambda q: (attn(q, q, q) ** 2).sum()))(q).block_until_ready()
    jax.jit(window)(q, q, q).block_until_ready()
""")


def test_record_doctor_and_search_from_cover_a_recorded_program(tmp_path, monkeypatch, capsys):
    """`tuner record` keeps the program's two problems (one with gradients), `doctor` says neither is
    covered (exit 1), `search --from` tunes both with the objective their gradients call for, and `doctor`
    is then satisfied."""
    monkeypatch.setenv("TUNER_DB", str(tmp_path / "tuning.sqlite"))
    program, out = tmp_path / "train.py", tmp_path / "problems.jsonl"
    program.write_text(PROGRAM)
    assert main(["record", "--out", str(out), "--", sys.executable, str(program)]) == 0  # the program: a process
    assert "recorded 2 attention call(s)" in capsys.readouterr().out
    calls = record.read(out).calls
    assert sorted(c.gradients for c in calls) == [False, True]

    assert main(["doctor", str(out)]) == 1
    assert "0 of 2 tunable problem(s) covered" in capsys.readouterr().out
    assert main(["search", "--from", str(out), "--device", "cpu", "--trials", "1", "--runs", "1"]) == 0
    table = capsys.readouterr().out
    assert "tuned (fwd+bwd, 1 trial)" in table and "tuned (fwd, 1 trial)" in table
    assert "2 of 2 tunable problem(s) covered" in table
    assert main(["doctor", str(out)]) == 0


def test_verbs_of_recorded_problems_refuse_bad_input(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert main(["doctor", str(missing)]) == 2
    assert "cannot read the record file" in capsys.readouterr().err
    assert main(["record", "--out", str(tmp_path / "p.jsonl")]) == 2
    assert "give the command to record after --" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\n")
    assert main(["search", "--from", str(bad), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "line 1: not JSON" in err and "holds no valid recorded call" in err
    assert main(["search", "--from", str(bad), "--device", "cpu", "--seq-len", "512", "--objective", "fwd"]) == 2
    assert "drop --objective, --seq-len" in capsys.readouterr().err
