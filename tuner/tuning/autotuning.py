"""Tune what the model runs: the attention calls of a program, found by tracing it, each searched once.

    report = tuner.autotune(train_step, params, opt_state, batch, device="cpu", trials=8)
    print(report.render())        # per problem: config source before and after, speed-up over the default

`autotune` traces the program, reads its attention calls (`tuner.runtime.record.calls_in`: the
loader's and `ring_attention`'s, with whether gradients flow through them), merges the calls that are
one problem, and runs `tuner.tuning.search` for each problem its loader does not already have tuned for this
device and these versions (objective `fwd+bwd` where the program takes gradients, else `fwd`), into
the cache file that loader reads; for a call that leaves the engine to auto, each rival engine of the
platform too, and then the winners timed side by side (`registry.contenders`). When it stored anything
it clears jax's caches, so the next call of the program traces again and runs the tuned kernels, and it
traces once more to report what the loader decides now. It runs the program once only where a
loader's packed calls declare no packing and the example arguments are arrays: to see the rows those
calls get (`record.observe`), whose packing their search then draws. `tune` does the same for calls read
from a record file (`tuner search --from`), and `doctor` says, per recorded call, what the loader will use
and why, without tuning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from tuner import registry
from tuner.runtime import record
from tuner.semantics.packing import Packing
from tuner.semantics.problem import Problem
from tuner.runtime.record import Call
from tuner.support.tables import error_line, table

if TYPE_CHECKING:  # the search (optuna) is imported when a search runs, not with `import tuner`
    from tuner.tuning.search import SearchOptions

COVERED = ("exact", "measured")  # sources that mean the problem's own decision is in the cache
REPLAY_AXES = ("ring", "a2a")  # the axis names a replayed call is explained with (both over two axes)


@dataclass(frozen=True)
class Outcome:
    """One problem of a program: a call standing for every call of it (gradients merged), the problem
    a search tunes (None when it cannot be tuned), the loader's config source before and after, the
    search's speed-up over the default, and a note: tuned, already tuned, or why not (`weighed`: a problem
    tuned before had only its rival engines searched and raced now)."""

    call: Call
    problem: Problem | None
    before: str
    after: str | None
    speedup: float | None
    note: str
    weighed: bool = False  # only rival engines were searched and raced (the call's own was tuned before)

    @property
    def described(self) -> str:
        if self.problem is not None:
            return self.problem.describe()
        (b, t, h, d), dtype = self.call.query
        return f"{self.call.caller}: q [{b}, {t}, {h}, {d}] {dtype}, ring {self.call.ring_size}, {self.call.layout}"


@dataclass(frozen=True)
class Report:
    """What `autotune` / `tune` did, problem by problem."""

    outcomes: list[Outcome]

    @property
    def covered(self) -> bool:
        """Whether every tunable problem now runs its own tuned decision."""
        return all(o.after in COVERED for o in self.outcomes if o.problem is not None)

    def render(self) -> str:
        rows = [[o.described, "yes" if o.call.gradients else "no", o.call.decision["implementation"], o.before,
                 o.after or "-", f"{o.speedup:.2f}x" if o.speedup is not None else "-", o.note]
                for o in self.outcomes]
        return table(["problem", "grads", "implementation", "before", "after", "speed-up", "note"], rows)


def problems(calls: Sequence[Call], drawn: dict[str, str] | None = None
             ) -> list[tuple[Call, Problem | None, str | None]]:
    """The calls merged into problems, in first-seen order: (call, problem or None, why not tunable).
    `drawn` gives, by call id, the packing a call's rows were seen to hold (`Problem.drawn`)."""
    merged: dict[tuple, tuple[Call, Problem | None, str | None]] = {}
    for call in calls:
        try:
            problem, why = call.problem(), None
            if drawn and call.id in drawn:
                problem = dataclasses.replace(problem, drawn=drawn[call.id])
            group = (problem.describe(), call.decision["implementation"], call.db, call.device_kind)
        except ValueError as error:
            problem, why, group = None, str(error), (call.id,)
        if group in merged:
            known = merged[group][0]
            call = dataclasses.replace(known, gradients=known.gradients or call.gradients)
        merged[group] = (call, problem, why)
    return list(merged.values())


def tune(calls: Sequence[Call], *, device: str | None = None, trials: int = 12,
         options: SearchOptions | None = None, progress: bool = True,
         drawn: dict[str, str] | None = None) -> list[Outcome]:
    """Search every problem of `calls` that its loader does not already have tuned (`COVERED`), on
    `device` (default: the platform the calls were traced for), into the cache file each call's loader
    reads; `options` (`tuner.tuning.search.SearchOptions`) sets the rest of the search, its objective and
    trials are chosen here. A problem that cannot be tuned, or whose search fails, is reported in its
    note; the others are not held back by it. `after` is left for the caller to fill. `drawn` gives, by
    call id, the packing an undeclared packed call's rows were seen to hold: its search draws them.

    Several workers given the same calls divide them through the study storage: each first tunes the
    problems no other worker took, then joins the others' studies, so that every worker's cache ends
    with every winner while each problem is tuned once."""
    from tuner.tuning.search import SearchOptions, search

    options = options or SearchOptions()
    outcomes: dict[int, Outcome] = {}
    todo = problems(calls, drawn)
    searches = []
    for number, (call, problem, why) in enumerate(todo, 1):
        before = call.source
        if problem is None:
            outcomes[number] = Outcome(call, None, before, None, None, f"not tuned: {why}")
            continue
        target = device or call.platform
        kind = _device_kind(target)
        here = target == call.platform and kind == call.device_kind
        if before in COVERED and not (here and _unweighed(call, problem, target)):
            outcomes[number] = Outcome(call, problem, before, None, None, "already tuned")
            continue
        if not here:
            outcomes[number] = Outcome(call, problem, before, None, None,
                                       f"not tuned: traced for {call.device_kind} ({call.platform}), this search "
                                       f"would tune {kind or 'no device'} ({target}); tune where it runs")
            continue
        objective = "fwd+bwd" if call.gradients else "fwd"
        searches.append((number, call, problem, target, dataclasses.replace(options, objective=objective,
                                                                            trials=trials)))
    for number, call, problem, target, chosen in _claimed_first(searches):
        rivals = _rivals(call, problem, target)
        label = f"problem {number}/{len(todo)}"
        if call.source in COVERED:  # tuned before its rivals were weighed: weigh them now
            note = "already tuned" + _weigh(rivals, call, problem, target, chosen, label, progress)
            outcomes[number] = Outcome(call, problem, call.source, None, None, note, weighed=True)
            continue
        chosen = chosen.shared_by(1 + len(rivals))
        try:
            with _bar(f"{label} {call.decision['implementation']}" if rivals else label, trials, progress) as update:
                result = search(problem, device=target, backend=call.decision["implementation"], options=chosen,
                                db=call.db, progress=update)
        except (RuntimeError, ValueError) as error:
            outcomes[number] = Outcome(call, problem, call.source, None, None, f"search failed: {error_line(error)}")
            continue
        ran = f"{result.trials_run} trial{'' if result.trials_run == 1 else 's'}"
        if result.decided_by:
            note = f"tuned by worker {result.decided_by} ({chosen.objective}, {ran})"
        elif result.stored:
            note = f"tuned ({chosen.objective}, {ran})"
        else:
            note = "tuned; the cache kept a better row from another search"
        note += _weigh(rivals, call, problem, target, chosen, label, progress)
        outcomes[number] = Outcome(call, problem, call.source, None, result.speedup, note)
    return [outcomes[number] for number in sorted(outcomes)]


def _rivals(call: Call, problem: Problem, target: str) -> list[str]:
    """The platform's rival engines that can run `problem` (`registry.contenders`: cudnn beside triton on a
    GPU), for a loader call that left the choice to auto and runs the preferred engine; else none."""
    if call.caller != "loader" or (call.backend, call.strategy) != ("auto", "auto"):
        return []
    preferred, *rivals = registry.contenders(problem, registry.Target(target, call.interpret))[0]
    return [r.name for r in rivals] if preferred.name == call.decision["implementation"] else []


def _unweighed(call: Call, problem: Problem, target: str) -> list[str]:
    """`_rivals` of a call, unless one of them has a current row for `problem` in the call's cache already (a
    search or a race: they were weighed)."""
    from tuner.cache import Cache
    from tuner.runtime.measured import decisions

    rivals = _rivals(call, problem, target)
    if not rivals:
        return []
    key = registry.problem_key(problem, call.decision["implementation"], call.device_kind)
    return [] if any(row["backend"] in rivals for row in decisions(Cache(call.db), key, problem.spec)) else rivals


def _weigh(rivals: list[str], call: Call, problem: Problem, target: str, options: SearchOptions, label: str,
           progress: bool) -> str:
    """Search each of `rivals` on `problem` after the call's own engine, then time the winners side by side
    (`time_winners`), so that auto runs the faster. What it did, for the outcome's note."""
    from tuner.tuning.bench import time_winners
    from tuner.tuning.search import search

    searched, notes = [call.decision["implementation"]], []
    for rival in rivals:
        try:
            with _bar(f"{label} {rival}", options.trials, progress) as update:
                search(problem, device=target, backend=rival, options=options, db=call.db, progress=update)
            searched.append(rival)
        except (RuntimeError, ValueError) as error:
            notes.append(f"{rival}'s search failed: {error_line(error)}")
    if len(searched) > 1:
        tuned = f"{', '.join(searched[1:])} tuned too"
        try:
            winner = time_winners(problem, searched, device=target, options=options, db=call.db)[1]["backend"]
            notes.append(f"{tuned}; {winner} timed fastest side by side")
        except (RuntimeError, ValueError) as error:
            notes.append(f"{tuned}; not timed side by side: {error_line(error)}")
    return "".join(f"; {note}" for note in notes)


def _claimed_first(searches: list[tuple]) -> Iterator[tuple]:
    """The searches in the order this worker runs them: first those whose problem it claims in the
    study storage (`tuner.tuning.shared`: no other worker took it; each claimed just before it is
    tuned), then the others, whose studies it joins (running what trials are left, then reading
    their winner)."""
    from tuner.cache import Cache
    from tuner.tuning.search import study_of
    from tuner.tuning.shared import Shared
    from tuner.tuning.study import default_storage, open_storage

    others, shared = [], {}
    for item in searches:
        _, call, problem, target, options = item
        try:
            name = study_of(problem, target, call.decision["implementation"], options)[-1]
            url = options.storage or default_storage(Cache(call.db).path)
            if url not in shared:  # one storage per URL: each holds a pool of connections
                shared[url] = Shared(open_storage(url, options.heartbeat))
            claimed = shared[url].claim_problem(name)
        except ValueError:  # the search itself reports it
            claimed = True
        if claimed:
            yield item
        else:
            others.append(item)
    yield from others


def autotune(step_fn: Callable, *example_args: Any, device: str | None = None, trials: int = 12,
             db: str | None = None, options: SearchOptions | None = None, progress: bool = True,
             static_argnums: int | Sequence[int] = ()) -> Report:
    """Trace `step_fn(*example_args)` (arrays or `jax.ShapeDtypeStruct`s, shardings included; never
    run), tune every attention problem it holds that is not tuned yet, and report per problem (module
    docstring). `device` defaults to the platform the program is traced for; `db`, when given, must be
    the cache file the program's loaders read (`ValueError` otherwise: rows elsewhere would not be
    used); `options` is a `tuner.tuning.search.SearchOptions` for the rest of the search; `static_argnums`
    names the arguments that are not arrays, as for `jax.jit`.

    Where a loader's calls pass segment ids without declaring their packing and the example arguments are
    arrays, the step runs once (`record.observe`) to see the rows those calls get, and their search draws
    rows of the packing fitted to them (`Packing.fit`; the problem's `drawn=`), under the key the calls
    look up: the tiles are tuned for the documents the program really packs."""
    calls = record.calls_in(step_fn, *example_args, static_argnums=static_argnums)
    if db is not None:
        from tuner.cache import Cache

        wanted = str(Cache(db).path)
        elsewhere = sorted({c.db for c in calls if c.db is not None and c.db != wanted})
        if elsewhere:
            raise ValueError(f"db={db!r}, but the program's loaders read {', '.join(elsewhere)}: pass the same db "
                             f"to get_tuned_ring_attention, or leave db unset")
    outcomes = tune(calls, device=device, trials=trials, options=options, progress=progress,
                    drawn=_observed_packings(step_fn, example_args, static_argnums, calls))
    if any(o.speedup is not None or o.weighed for o in outcomes):
        jax.clear_caches()  # the program traces again, and its loaders read what the searches stored
        after = {c.id: c.source for c in record.calls_in(step_fn, *example_args, static_argnums=static_argnums)}
    else:
        after = {c.id: c.source for c in calls}
    return Report([dataclasses.replace(o, after=after.get(o.call.id, o.before)) for o in outcomes])


def _observed_packings(step_fn: Callable, example_args: Sequence[Any], static_argnums: int | Sequence[int],
                       calls: Sequence[Call]) -> dict[str, str]:
    """By call id, the packing fitted to the rows each undeclared packed loader call of the program gets
    (`record.observe`, one run of the step), for the calls still to tune; none where the example arguments
    are only shapes."""
    packed = [c for c in calls if c.caller == "loader" and c.packing is None and "q_segment_ids" in c.arrays
              and c.source not in COVERED]
    if not packed or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(example_args)):
        return {}
    rows = record.observe(step_fn, *example_args, calls=packed, static_argnums=static_argnums)
    return {call_id: Packing.fit(ids).describe() for call_id, ids in rows.items()}


def replay(call: Call, db: str | None = None) -> Call:
    """`call` with the decision its loader takes now on this host (`explain()` of the same call), from
    `db` (default: the call's own cache file). A `ring_attention` call is returned as recorded."""
    if call.caller != "loader":
        return call
    from tuner.runtime.dispatch import get_tuned_ring_attention

    ring, pair = call.ring_size > 1, call.strategy in registry.TWO_AXES
    axis_name = REPLAY_AXES if pair else REPLAY_AXES[0] if ring else None
    attn = get_tuned_ring_attention(axis_name=axis_name, layout=call.layout, backend=call.backend,
                                    strategy=call.strategy, db=db or call.db, packing=call.packing, **call.mask)
    structs = {n: jax.ShapeDtypeStruct(shape, dtype) for n, (shape, dtype) in call.arrays.items()}
    q, k, v = (jax.ShapeDtypeStruct(*s) for s in (call.query, call.key, call.value))
    sizes = (call.ring_size // call.a2a_size, call.a2a_size) if pair else call.ring_size if ring else None
    plan = attn.explain(q, k, v, ring_size=sizes, return_lse=call.return_lse, interpret=call.interpret, **structs)
    decision = dict(implementation=plan.backend, source=plan.source, reason=plan.reason, key=plan.key.as_dict())
    return dataclasses.replace(call, decision=decision)


def doctor(calls: Sequence[Call], db: str | None = None) -> list[Outcome]:
    """Per problem of `calls`: its call with what its loader decides now on this host (`before`), and a
    note -- covered, not tuned yet, or why it cannot be tuned."""
    here = _device_kind(None)
    checked = []
    for call, problem, why in problems(calls):
        now = replay(call, db)
        if problem is None:
            note = f"not tunable: {why}"
        elif now.source in COVERED:
            unweighed = _unweighed(dataclasses.replace(now, db=db or now.db), problem, now.platform)
            note = "covered" + (f"; not raced against {', '.join(unweighed)} yet (autotune or `tuner search --from` "
                                f"does it)" if unweighed else "")
        else:
            note = "not tuned yet"
        if call.caller == "loader" and call.device_kind != here:
            note += f" (recorded on {call.device_kind}; decided here for {here})"
        checked.append(Outcome(now, problem, now.source, None, None, note))
    return checked


def render_doctor(checked: list[Outcome]) -> str:
    rows = [[o.described, "yes" if o.call.gradients else "no", o.call.decision["implementation"], o.before, o.note]
            for o in checked]
    return table(["problem", "grads", "implementation", "source", "note"], rows)


def _device_kind(platform: str | None) -> str | None:
    """The device kind of `platform` here (default: jax's default devices), None when it has none."""
    try:
        return jax.devices(platform)[0].device_kind
    except RuntimeError:
        return None


@contextlib.contextmanager
def _bar(label: str, total: int, show: bool) -> Iterator[Callable[[int, int, str], None] | None]:
    """A search's progress callback drawing one bar on stderr (None when not `show`)."""
    if not show:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=label, unit="trial", file=sys.stderr, dynamic_ncols=True) as bar:
        def update(done: int, _total: int, status: str) -> None:
            bar.set_postfix_str(status, refresh=False)
            bar.update(done - bar.n)
        yield update


__all__ = ["COVERED", "Outcome", "Report", "autotune", "doctor", "problems", "render_doctor", "replay", "tune"]
