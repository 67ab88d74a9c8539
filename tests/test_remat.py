"""Activation checkpointing with the ring (`docs/remat.md`): `tuner.save_attention_residuals()` keeps the
ring's output and lse, so that the backward pass does not run the ring's forward again.

The benchmark's stack of two layers under `jax.lax.scan`, each under `jax.checkpoint`, with the loader's
ring on global arrays over 4 devices (zigzag, causal): compiled without checkpointing, with nothing saved,
and with the policy. Read from the programs: what the collective-permutes move, the all-gathers, the temporaries.
Every strategy over a block kernel, traced only: what the policy saves of its call."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
from jax.sharding import AxisType, Mesh

import tuner
from tuner.models import hlo

import scripts

RING, LAYERS, T, H, D = 4, 2, 2048, 4, 32
POLICIES = {"none": "none (no jax.checkpoint)", "nothing": "jax.checkpoint, nothing saved",
            "residuals": "save_attention_residuals()"}  # the benchmark's names of the three

remat_step = scripts.load("benchmarks/remat/remat_step.py")


def compiled_step(policy: str):
    """The benchmark's step (`benchmarks/remat/remat_step.py`: the layers under `jax.lax.scan`, the input
    sharded over the sequence), compiled under `policy`, and its arguments."""
    mesh = Mesh(np.asarray(jax.devices()[:RING]), ("sp",), axis_types=(AxisType.Auto,))
    step, arguments = remat_step.step(mesh, tokens=T, heads=H, dim=D, layers=LAYERS, dtype=jnp.float32,
                                      policy=POLICIES[policy])
    return step.lower(*arguments).compile(), arguments


def test_the_policy_spares_the_backward_the_rings_forward_and_keeps_the_sequence_sharded(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    steps = {policy: compiled_step(policy) for policy in ("none", "nothing", "residuals")}
    texts = {policy: program.as_text() for policy, (program, _) in steps.items()}
    sent = {policy: hlo.collective_bytes(text)["collective-permute"] for policy, text in texts.items()}

    # the ring's forward, run again in the backward with nothing saved: every layer's RING - 1 hops of k, v
    # and the keys' positions; with the policy the backward runs none of it
    shard = T // RING
    forward_hops = LAYERS * (RING - 1) * (2 * shard * H * D * 4 + shard * 4)
    assert sent["nothing"] - sent["residuals"] == forward_hops, sent
    assert sent["residuals"] > sent["none"], sent  # the layout's moves are redone: one hop an array

    for policy, text in texts.items():  # nothing gathers the sequence (zigzag moves it with permutes)
        assert not hlo.gathers(text) or hlo.gathers(text)[0][1] <= 8 * T, (policy, hlo.gathers(text)[:2])
    temp = {policy: program.memory_analysis().temp_size_in_bytes for policy, (program, _) in steps.items()}
    assert temp["residuals"] < temp["none"], temp

    grads = {policy: program(*arguments) for policy, (program, arguments) in steps.items()}
    for policy in ("nothing", "residuals"):
        for got, want in zip(grads[policy], grads["none"]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend, mesh_shape", [("scan", (4,)), ("all_to_all", (4,)), ("all_gather", (4,)),
                                                 ("hybrid", (2, 2))])
def test_every_strategy_over_a_kernel_keeps_its_output_and_lse(backend, mesh_shape, capsys, tmp_path, monkeypatch):
    """Traced only (`print_saved_residuals`): with the policy, the loader's call saves two arrays of its
    `shard_map` (a device's output and lse, as that strategy's kernel holds them) and nothing else; with
    nothing saved, none."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    axes = ("sp", "a2a")[:len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=jax.devices()[:4])
    attn = tuner.get_tuned_ring_attention(axis_name=axes if len(axes) > 1 else axes[0], mesh=mesh, causal=True,
                                          backend=backend)
    query = jax.ShapeDtypeStruct((1, 256, 4, 16), jnp.float32)
    saved = {}
    for name, policy in (("residuals", tuner.save_attention_residuals()),
                         ("nothing", jax.checkpoint_policies.nothing_saveable)):
        print_saved_residuals(jax.checkpoint(lambda q: jnp.sin(attn(q, q, q)).sum(), policy=policy), query)
        saved[name] = [line for line in capsys.readouterr().out.splitlines() if "output of" in line]
    assert len(saved["residuals"]) == 2 and not saved["nothing"], saved
    sizes = sorted(int(np.prod([int(n) for n in line.split("[")[1].split("]")[0].split(",")]))
                   for line in saved["residuals"])
    assert sizes == [4 * 256, 256 * 4 * 16], saved  # the 4 devices together: lse [H, T] and output [T, H, D]


def test_the_policy_adds_to_another_and_refuses_what_is_not_one(capsys):
    def f(x):
        lse = checkpoint_name(jnp.sin(x), tuner.RESIDUAL_NAMES[1])
        return jnp.sin(lse @ x).sum()

    def saved(policy) -> str:
        print_saved_residuals(jax.checkpoint(f, policy=policy), jnp.eye(3))
        return capsys.readouterr().out

    alone = saved(tuner.save_attention_residuals())
    with_dots = saved(tuner.save_attention_residuals(jax.checkpoint_policies.dots_with_no_batch_dims_saveable))
    assert "named 'ring_attention_lse'" in alone and "dot_general" not in alone, alone
    assert "named 'ring_attention_lse'" in with_dots and "output of dot_general" in with_dots, with_dots
    with pytest.raises(TypeError, match="policy must be a jax.checkpoint policy"):
        tuner.save_attention_residuals("dots")
