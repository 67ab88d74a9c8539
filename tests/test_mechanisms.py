"""Mechanism selection by measurement: the gathered mechanisms equal the scan ring (forward and
gradients) on every feature they take; `tuner bench --mechanisms` records the fastest correct one;
`get_tuned_ring_attention(backend="auto")` follows a current record -- a gathered winner ("dense is
faster at this length") or a ring backend -- and says so in `explain`, and ignores stale ones; `tuner search`
with backend auto searches each engine auto may run (`registry.contenders`) and records their winners' race."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from cli_run import in_process
from tests.test_dispatch import PROBLEM, RING, arrays
from tuner import get_tuned_ring_attention
from tuner import registry
from tuner.cache import Cache, make_row
from tuner.strategies.configs import NoConfig
from tuner.strategies.mechanisms import gathered_attention
from tuner.semantics.problem import Problem
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import AttentionSpec
from tuner.tuning.verify import ReferenceCheck
from tuner.tuning.workload import Workload

SMALL = dict(batch=1, seq_len=64, heads=4, kv_heads=2, head_dim=8, ring_size=RING)


@pytest.mark.parametrize("mechanism, problem", [
    ("dense", Problem(**SMALL, causal=True, layout="zigzag", segments=3, softcap=5.0, sinks=2)),
    ("dense", Problem(**SMALL, causal=False, window=(5, 3), chunk_size=24, layout="striped")),
    ("jax_nn", Problem(**SMALL, causal=True, layout="zigzag", segments=2)),
    ("jax_nn", Problem(**SMALL, causal=True, window=(7, 0), layout="contiguous")),
], ids=["dense-segments-softcap-sinks", "dense-window-chunk", "jax_nn-segments", "jax_nn-window"])
def test_gathered_mechanisms_equal_the_scan_ring(mechanism, problem):
    workload = Workload(problem)
    reference = ReferenceCheck(workload, seed=3, backward=True)
    compiled = reference.compile(workload.attend(mechanism, NoConfig()))
    assert reference.mismatch(compiled) is None
    assert set(reference.outputs) >= {"out", "dq", "dk", "dv"}


def test_jax_nn_rows_with_no_readable_key_are_zero():
    q = jnp.asarray(np.ones((1, 4, 2, 8), np.float32))
    late = jnp.asarray(np.arange(10, 14, dtype=np.int32)[None])
    out = jax.jit(lambda q, q_positions, kv_positions: gathered_attention(  # one program, not op by op
        q, q, q, mechanism="jax_nn", axis_name=None, layout="contiguous", spec=AttentionSpec(scale=0.3, causal=True),
        q_positions=q_positions, kv_positions=kv_positions))(q, jnp.asarray(np.arange(4, dtype=np.int32)[None]), late)
    assert np.all(np.asarray(out) == 0.0)
    with pytest.raises(ValueError, match="jax.nn.dot_product_attention has no a logits soft cap"):
        gathered_attention(q, q, q, mechanism="jax_nn", axis_name=None, layout="contiguous",
                           spec=AttentionSpec(scale=0.3, causal=True, softcap=3.0))


def record(db, problem: Problem, winner: str, seconds: dict, jax_version: str | None = None) -> None:
    """A `tuner bench --mechanisms` run of `problem` that timed `seconds` (by bench label)."""
    assert min(seconds, key=seconds.get) == winner
    device_kind = jax.devices()[0].device_kind
    rows = []
    for label, time in seconds.items():
        implementation = registry.get(label.removeprefix("ring/"))
        versions = {**registry.versions(implementation), **({"jax_version": jax_version} if jax_version else {})}
        rows.append(make_row(registry.problem_key(problem, implementation.name, device_kind),
                             implementation.default_config(problem.shapes, problem.spec), versions=versions,
                             tool_version="test", source="bench", objective="fwd+bwd", best_s=time, default_s=None,
                             speedup=None, trials_run=2, trials_pruned=0, study="bench test"))
    Cache(db).put_run(rows)


def test_the_loader_follows_a_measured_dense_winner(tmp_path):
    db = tmp_path / "tuning.sqlite"
    record(db, PROBLEM, "dense", {"dense": 0.001, "ring/scan": 0.004})
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db), mesh=mesh)
    q, k, v = arrays(PROBLEM)
    decision = attn.explain(q, k, v)
    assert (decision.backend, decision.source, decision.fwd_params) == ("dense", "measured", None)
    assert decision.reason.startswith("tuner bench --mechanisms measured dense fastest for this problem (1.0 ms; "
                                      "ring/scan 4.0 ms)")

    out, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(attn(*a))), argnums=(0, 1, 2)))(q, k, v)
    want, want_grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(dense_attention(*a, causal=True)[0])),
                                                  argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-4

    # jax_nn has no lse: a call that wants it runs the ring; a named backend never reads measurements.
    record(db, PROBLEM, "jax_nn", {"jax_nn": 0.001, "ring/scan": 0.004})
    fresh = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db), mesh=mesh)
    assert fresh.explain(q, k, v).backend == "jax_nn"
    assert fresh.explain(q, k, v, return_lse=True).backend == "scan"
    named = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db), mesh=mesh,
                                     backend="scan")
    assert named.explain(q, k, v).source == "default"


def test_a_stale_measurement_is_ignored(tmp_path):
    db = tmp_path / "tuning.sqlite"
    record(db, PROBLEM, "dense", {"dense": 0.001}, jax_version="0.0.1")
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db),
                                    mesh=Mesh(np.array(jax.devices()[:RING]), ("sp",)))
    decision = attn.explain(*arrays(PROBLEM))
    assert (decision.backend, decision.source) == ("scan", "default")


def test_bench_mechanisms_records_the_winner_and_the_loader_uses_it(tmp_path, capsys):
    args = ["--seq-len", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--ring-size", "2"]
    proc = in_process(capsys, "bench", "--device", "cpu", "--mechanisms", "--runs", "2", *args, home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    names = ("ring/scan", "dense", "jax_nn", "all_to_all", "all_gather")  # every implementation that runs on the CPU
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.split() and line.split()[0] in names}
    assert set(rows) == set(names), proc.stdout
    winner = re.search(r"recorded (\S+) for key ([0-9a-f]{16})", proc.stdout)
    assert winner and "winner" in rows[winner.group(1)], proc.stdout
    assert "ring/triton cannot run here" in proc.stdout and "ring/pallas_tpu cannot run here" in proc.stdout

    problem = Problem(seq_len=128, heads=4, kv_heads=2, head_dim=16, ring_size=2)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(tmp_path / "tuning.sqlite"))
    local = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    decision = attn.explain(local, kv, kv, ring_size=2)
    assert decision.backend == winner.group(1).removeprefix("ring/")
    assert decision.key.digest == registry.problem_key(problem, decision.backend, jax.devices()[0].device_kind).digest
    assert decision.reason.startswith(f"tuner bench --mechanisms measured {winner.group(1)} fastest")


def test_bench_mechanisms_names_the_implementations_it_times(tmp_path, capsys):
    args = ["--device", "cpu", "--seq-len", "64", "--heads", "2", "--kv-heads", "2", "--head-dim", "8",
            "--ring-size", "2"]
    wrong = in_process(capsys, "bench", "--mechanisms", "scan,tritn", *args, home=tmp_path)
    assert wrong.returncode == 2, wrong.stderr
    assert "--mechanisms: unknown tritn (registered: scan, triton" in wrong.stderr, wrong.stderr
    none = in_process(capsys, "bench", "--mechanisms", "triton,cudnn", *args, home=tmp_path)
    assert none.returncode == 1, none.stderr
    assert "no mechanism can run here: ring/triton cannot run here: no CUDA GPU" in none.stderr, none.stderr

    proc = in_process(capsys, "bench", "--mechanisms", "jax_nn,scan", "--objective", "fwd", "--runs", "1", *args,
                      home=tmp_path)  # forward only: half the programs to compile, the same names
    assert proc.returncode == 0, proc.stderr
    timed = {line.split()[0] for line in proc.stdout.splitlines()
             if line.split() and line.split()[0] in ("ring/scan", "dense", "jax_nn", "all_to_all", "all_gather")}
    assert timed == {"ring/scan", "jax_nn"}, proc.stdout
    assert "skipped" not in proc.stdout, proc.stdout


def test_contenders_are_the_preferred_engine_then_the_rivals_that_can_run_the_problem():
    gpu = registry.Target("gpu", interpret=True)  # in their interpreters, both engines are available here
    bf16 = dict(dtype="bfloat16", head_dim=128)
    names = lambda problem: ([i.name for i in registry.contenders(problem, gpu)[0]],  # noqa: E731
                             registry.contenders(problem, gpu)[1])
    assert names(Problem(**bf16)) == (["triton", "cudnn"], [])
    assert names(Problem(**bf16, window=(64, 0))) == (["triton", "cudnn"], [])
    engines, why = names(Problem(**bf16, segments=3))
    assert engines == ["triton"] and why[0].startswith("cudnn does not support segment ids"), why
    engines, why = names(Problem(dtype="float32"))
    assert engines == ["triton"] and why == ["cudnn does not support dtype float32 (cuDNN's flash attention "
                                             "takes bfloat16 and float16)"]
    assert names(Problem(**bf16, ring_size=4, a2a_size=2)) == (["hybrid_triton"], [])  # rivals are rings
    assert [i.name for i in registry.contenders(Problem(), registry.Target("cpu"))[0]] == ["scan"]
    assert [i.name for i in registry.contenders(Problem(), registry.Target("gpu"))[0]] == ["scan"]  # no GPU here


def test_search_with_auto_searches_each_engine_then_times_their_winners_side_by_side(tmp_path, capsys, monkeypatch):
    """On a GPU, `tuner search` with backend auto searches triton and cudnn; here the same flow over two engines
    the CPU runs (dense as the scan ring's rival), down to the loader running the one timed faster."""
    monkeypatch.setitem(registry.RIVALS, "cpu", ("dense",))
    args = ["--device", "cpu", "--seq-len", "64", "--heads", "2", "--kv-heads", "2", "--head-dim", "8",
            "--ring-size", "2", "--objective", "fwd", "--trials", "2", "--runs", "1"]
    proc = in_process(capsys, "search", *args, home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "auto searches each engine it may run here in turn (scan, dense)" in proc.stderr, proc.stderr
    assert re.search(r"^scan backend on ", proc.stdout, re.M) and re.search(r"^dense backend on ", proc.stdout, re.M)
    assert len(re.findall(r"^stored\s+key", proc.stdout, re.M)) == 2, proc.stdout  # a search row per engine
    timed = {line.split()[0] for line in proc.stdout.splitlines() if line.split()[:1] in (["ring/scan"], ["dense"])}
    assert timed == {"ring/scan", "dense"}, proc.stdout
    winner = re.search(r"recorded (\S+) for key", proc.stdout)
    assert winner, proc.stdout

    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(tmp_path / "tuning.sqlite"))
    local = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.float32)
    decision = attn.explain(local, local, local, ring_size=2)
    assert decision.backend == winner.group(1).removeprefix("ring/")
    assert decision.reason.startswith(f"tuner bench --mechanisms measured {winner.group(1)} fastest"), decision.reason

    monkeypatch.setitem(registry.RIVALS, "cpu", ("triton",))  # a rival that cannot run here is named, not searched
    proc = in_process(capsys, "search", *args, home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "not searched: triton cannot run here: no CUDA GPU" in proc.stderr, proc.stderr
    assert "timing the winners" not in proc.stderr and "recorded" not in proc.stdout, proc.stdout
