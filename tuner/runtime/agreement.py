"""One decision on every process of a multi-process JAX program.

Every process of a multi-host program traces the loader and decides from its own cache file. If the
files differ (one host tuned more, a file was copied late), the processes would build different
programs, and their collectives would hang or mismatch. So process 0's decision is the decision: it
publishes it in `jax.distributed`'s key-value store, and every other process waits for it there (at
most `TIMEOUT_S`) and runs it, with one WARNING naming both decisions when its own cache said otherwise.

A decision is named by the problem (its cache key as resolved before any cache is read), whether the
call returns the lse, and how many times this process decided that problem before, so the n-th
decision of a problem on one process meets the n-th on process 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import socket
from collections import Counter

import jax

from tuner import registry
from tuner.runtime.plan import Plan

log = logging.getLogger("tuner.runtime.agreement")

TIMEOUT_S = 300  # how long a process waits for process 0's decision before it stops
_rounds: Counter[str] = Counter()


def _client():
    """The `jax.distributed` client of this process, or None (not initialized)."""
    from jax._src import distributed  # the coordination service's key-value store has no public handle

    return distributed.global_state.client


def _published(plan: Plan) -> dict:
    return {"backend": plan.backend, "config": plan.config.to_dict(), "source": plan.source, "reason": plan.reason}


def _name(problem: tuple) -> tuple[str, str]:
    """(the problem's digest, the store's name of the next decision of it this process meets)."""
    digest = hashlib.sha256(repr(problem).encode()).hexdigest()[:24]
    return digest, f"ring_tuner/decision/{digest}/{_rounds[digest]}"


def _adopted(plan: Plan, chosen: dict) -> Plan:
    """`plan` replaced by process 0's decision `chosen` (as published, without its host)."""
    implementation = registry.get(chosen["backend"])
    return dataclasses.replace(
        plan, backend=implementation.name, config=implementation.config_type.from_dict(chosen["config"]),
        source=chosen["source"], key=dataclasses.replace(plan.key, backend=implementation.name),
        reason=f"process 0's decision ({chosen['reason']}); this process's cache said {plan.source}: {plan.reason}")


def agree(plan: Plan, problem: tuple) -> Plan:
    """`plan` on process 0 and in a single-process program; elsewhere process 0's plan for `problem` (what
    every process knows the call by before reading its cache: the loader's memo of the call). `RuntimeError`
    when process 0's does not come in time."""
    if jax.process_count() == 1:
        return plan
    client = _client()
    if client is None:
        log.warning("ring attention %s: %d processes but jax.distributed is not initialized, so the processes "
                    "cannot agree on a decision; each runs its own cache's", plan.key.digest[:12],
                    jax.process_count())
        return plan
    digest, name = _name(problem)
    _rounds[digest] += 1
    mine = _published(plan)
    if jax.process_index() == 0:
        client.key_value_set(name, json.dumps({**mine, "host": socket.gethostname()}, sort_keys=True))
        return plan
    try:
        theirs = client.blocking_key_value_get(name, TIMEOUT_S * 1000)
    except Exception as error:  # noqa: BLE001 - the runtime's timeout error has no public type
        raise RuntimeError(f"ring attention {plan.key.digest[:12]}: process {jax.process_index()} waited "
                           f"{TIMEOUT_S} s for process 0's decision and got none ({error}); every process must "
                           f"trace the same attention calls") from None
    chosen = json.loads(theirs)
    host = chosen.pop("host")
    if chosen == mine:
        return plan
    log.warning("ring attention %s: this process (%d, on %s) decided %s %s from %s, process 0 (on %s) %s %s from "
                "%s; running process 0's so that every process builds the same program (make the cache files "
                "agree: tuner export / import)", plan.key.digest[:12], jax.process_index(), socket.gethostname(),
                plan.backend, plan.config.to_dict(), plan.source, host, chosen["backend"], chosen["config"],
                chosen["source"])
    return _adopted(plan, chosen)


def expected(plan: Plan, problem: tuple) -> Plan:
    """What the next traced call of `problem` will run on this process, said without waiting and without
    taking part in the agreement (what `explain()` reports): `plan` on process 0 and in a single-process
    program; elsewhere process 0's decision where process 0 has published it, else `plan` with a reason
    saying that the traced call runs process 0's decision, which is not known here yet. A loader that has
    traced the call knows what it ran without asking (`TunedRingAttention.traced`)."""
    if jax.process_count() == 1 or jax.process_index() == 0:
        return plan
    here = f"process {jax.process_index()} of {jax.process_count()}"
    client = _client()
    if client is None:
        return dataclasses.replace(plan, reason=f"{here}, without jax.distributed: every process runs its own "
                                                f"cache's decision; {plan.reason}")
    try:
        theirs = client.key_value_try_get(_name(problem)[1])
    except Exception:  # noqa: BLE001 - not published yet: the runtime's not-found error has no public type
        return dataclasses.replace(
            plan, reason=f"{here}: this process's cache's decision, which may not be what runs: a traced call runs "
                         f"process 0's, published when process 0 traces the call (process 0's explain() says it); "
                         f"{plan.reason}")
    chosen = json.loads(theirs)
    host = chosen.pop("host")
    if chosen == _published(plan):
        return dataclasses.replace(plan, reason=f"{here}: process 0 (on {host}) decided the same, and a traced call "
                                                f"runs process 0's; {plan.reason}")
    return _adopted(plan, chosen)


__all__ = ["TIMEOUT_S", "agree", "expected"]
