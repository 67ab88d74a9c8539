"""`tuner report`: one self-contained HTML page about the study behind a cache entry.

The page says what `tuner search` printed and more: the problem, the winner against the default as they
were re-timed side by side, every trial with its tiles, times and the reason it failed or was pruned,
and three figures (the trials' times over the default, the tiles they tried in sizes rather than the
ranks the sampler sees, and which tiles mattered). Everything comes from the study's storage: its
trials' attributes and the winner its workers decided (`tuner.tuning.shared`).
"""

from __future__ import annotations

import html
import importlib.util
import json
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from tuner import registry
from tuner.semantics.problem import Problem
from tuner.support.tables import describe_config, described_fields
from tuner.tuning.shared import Shared
from tuner.tuning.study import DUPLICATE, SURPLUS, open_storage
from tuner.tuning.trials import Measured

HIDDEN = (SURPLUS, DUPLICATE)  # trials that measured nothing: over the budget, or a config another trial held
STYLE = """body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 78em; padding: 0 1em; color: #222 }
table { border-collapse: collapse; margin: 0.5em 0 1.5em }
td, th { border-bottom: 1px solid #ddd; padding: 0.25em 0.7em; text-align: left; vertical-align: top }
td.n { text-align: right; font-variant-numeric: tabular-nums } tr.best { background: #eef6ee }
p.note { color: #555 } code { font-size: 1.05em }"""


@dataclass(frozen=True)
class TrialRow:
    """One trial as the page shows it; times in seconds; `value` its time over the default's, `rel` each
    pass's (None where it did not complete or the objective leaves the pass out)."""

    number: int
    source: str
    state: str
    config: str
    fwd_s: float | None
    bwd_s: float | None
    value: float | None
    rel: dict[str, float | None]
    compile_s: float | None
    note: str


def trial_rows(trials: list[optuna.trial.FrozenTrial]) -> list[TrialRow]:
    """The trials (a study's `get_trials()`) that measured something or failed for a reason, in the order they
    ran."""
    rows = []
    for t in trials:
        attrs = t.user_attrs
        if attrs.get("failure") in HIDDEN or t.state in (optuna.trial.TrialState.RUNNING,
                                                         optuna.trial.TrialState.WAITING):
            continue
        if t.state == optuna.trial.TrialState.FAIL:
            note = f"{attrs.get('failure', 'killed')}: {attrs.get('detail', 'no heartbeat')}"
        else:
            note = attrs.get("pruned", "")
        rows.append(TrialRow(t.number, attrs.get("source", "sampler"), t.state.name.lower(), attrs.get("config", "-"),
                             attrs.get("fwd_s"), attrs.get("bwd_s"),
                             t.value if t.state == optuna.trial.TrialState.COMPLETE else None,
                             {part: attrs.get(f"{part}_rel") for part in ("fwd", "bwd")}, attrs.get("compile_s"), note))
    return rows


def problem_line(attrs: dict[str, Any]) -> str:
    """The study's problem in the search's one-line form, or its fields as stored where they no longer make a
    `Problem` (a study of an older version), or that it records none."""
    fields = dict(attrs.get("problem") or {})
    if not fields:
        return "(the study records no problem)"
    if isinstance(fields.get("window"), list):
        fields["window"] = tuple(fields["window"])
    try:
        return Problem(**fields).describe()
    except (TypeError, ValueError):
        return json.dumps(attrs.get("problem"))


def write_report(study: str, storage: str, out: str | Path) -> int:
    """Write the HTML report of `study` to `out`; returns the number of trials it shows.

    `KeyError` when the storage has no such study, `ImportError` (saying what to install) without
    plotly.
    """
    if importlib.util.find_spec("plotly") is None:
        raise ImportError("tuner report needs plotly: pip install plotly (or pip install "
                          "'ring-tuner[report]')")
    opened = open_storage(storage)
    names = [s.study_name for s in optuna.get_all_study_summaries(opened)]
    if study not in names:
        raise KeyError(f"no study {study!r} in {storage} (it has {len(names)}); pass the storage the "
                       f"search used with --storage")
    loaded = optuna.load_study(study_name=study, storage=opened)
    trials = loaded.get_trials(deepcopy=False)
    rows = trial_rows(trials)
    hidden = [t.number for t in trials if t.user_attrs.get("failure") in HIDDEN]
    winner = Shared(opened).winner(study)
    attrs = loaded.user_attrs
    versions = ", ".join(f"{name.removesuffix('_version')} {value}"
                         for name, value in (attrs.get("versions") or {}).items())
    parts = [f"<h1>{html.escape(str(attrs.get('backend')))} backend on {html.escape(str(attrs.get('device_kind')))}"
             "</h1>",
             f"<p><code>{html.escape(problem_line(attrs))}</code></p>",
             f"<p class='note'>study {html.escape(study)} in {html.escape(storage)}; {html.escape(versions)}</p>",
             *_winner_section(winner, rows, attrs.get("backend")), *_trials_section(rows, hidden),
             *_figures(loaded, rows)]
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>tuner report: "
            f"{html.escape(study)}</title><style>{STYLE}</style></head><body>" + "\n".join(parts) + "</body></html>")
    Path(out).write_text(page, encoding="utf-8")
    return len(rows)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _table(headers: list[str], rows: list[list[str]], numeric: set[int], marked: set[int] = frozenset()) -> str:
    """An HTML table of escaped cells; the columns in `numeric` right-aligned, the rows in `marked` shaded."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f"<tr{' class=best' if i in marked else ''}>" + "".join(
            f"<td{' class=n' if j in numeric else ''}>{html.escape(cell)}</td>" for j, cell in enumerate(row))
        + "</tr>" for i, row in enumerate(rows))
    return f"<table><tr>{head}</tr>{body}</table>"


def _winner_section(winner: dict[str, Any] | None, rows: list[TrialRow], backend: str | None) -> list[str]:
    """The default and the winner as re-timed side by side, and every re-timed candidate."""
    parts = ["<h2>Winner</h2>"]
    if winner is None:
        return parts + ["<p>No winner was decided: the search stopped before it re-timed its best trials. Run the "
                        "same <code>tuner search</code> again to go on.</p>"]
    config_type = registry.get(backend).config_type
    measured = {name: Measured.from_dict(winner[name], config_type) for name in ("default", "best")}
    table = [[name, *(_ms(None if t is None else t.median) for t in (m.fwd, m.bwd)), _ms(m.seconds),
              f"{measured['default'].seconds / m.seconds:.2f}x", describe_config(m.config),
              "default" if name == "default" else winner.get("best_from", "-")] for name, m in measured.items()]
    parts += ["<p>The search re-timed its best trials side by side with the default at the end, and the "
              "fastest is the winner the cache keeps.</p>",
              _table(["", "fwd ms", "bwd ms", "total ms", "speedup", "tiles", "from"], table, {1, 2, 3, 4}, {1})]
    retimed = winner.get("retimed") or []
    if retimed:
        parts.append(_table(["re-timed", "speedup in its trial", "speedup re-timed"],
                            [[name, "-" if then is None else f"{then:.2f}x", f"{now:.2f}x"]
                             for name, then, now in retimed], {1, 2}, {0}))
    parts += [f"<p class='note'>re-timing skipped {html.escape(f)}</p>" for f in winner.get("failures", [])]
    parts.append(f"<p class='note'>decided by worker {html.escape(str(winner.get('worker')))} at "
                 f"{html.escape(str(winner.get('decided_at')))} on {winner.get('trials')} trials; the study now "
                 f"has {len(rows)}</p>")
    return parts


def _trials_section(rows: list[TrialRow], hidden: list[int]) -> list[str]:
    """Every trial: where its config came from, how it ended, its times, tiles and why it failed; and the
    numbers of those not shown."""
    states = Counter(r.state for r in rows)
    failed = Counter(r.note.partition(":")[0] for r in rows if r.state == "fail")
    summary = ", ".join(f"{n} {s}" for s, n in states.items())
    if failed:
        summary += " (failed: " + ", ".join(f"{reason} {n}" for reason, n in failed.items()) + ")"
    if hidden:
        summary += (f"; not shown, as they measured nothing: trial{'s' if len(hidden) > 1 else ''} "
                    f"{', '.join(map(str, hidden))} (a config another trial held, or over the budget)")
    fastest = min((r.value for r in rows if r.value is not None), default=None)
    best = {i for i, r in enumerate(rows) if fastest is not None and r.value == fastest}
    table = [[str(r.number), r.source, r.state, _ms(r.fwd_s), _ms(r.bwd_s),
              "-" if r.value is None else f"{r.value:.3f}", "-" if r.compile_s is None else f"{r.compile_s:.1f}",
              r.config, r.note] for r in rows]
    return ["<h2>Trials</h2>",
            f"<p>{html.escape(summary or 'no trials')}. Each trial is timed side by side with the default, so "
            "its time over the default's holds across a machine's slow spells; the default's own trial shows "
            "how far apart two runs of one config land.</p>",
            _table(["trial", "from", "state", "fwd ms", "bwd ms", "time / default", "compile s", "tiles", "note"],
                   table, {0, 3, 4, 5, 6}, best)]


def _figures(study: optuna.Study, rows: list[TrialRow]) -> list[str]:
    """The three figures, plotly's script inlined once (the page works offline)."""
    complete = [r for r in rows if r.value is not None]
    figures = [("Time over the default, trial by trial", _history(complete))]
    notes = []
    if len(complete) >= 2:
        try:
            figures.append(("Tiles tried", _tiles(complete)))
        except ValueError as error:  # a config line another version of the search wrote
            notes.append(f"the tiles tried are not drawn: {error}")
        try:
            figures.append(("Which settings mattered", _importances(study)))
        except (RuntimeError, ValueError) as error:  # optuna's evaluator, on trials it cannot fit
            notes.append(f"which settings mattered is unavailable: {error}")
    else:
        notes.append("the tiles and what mattered need at least two complete trials")
    parts = []
    for i, (title, figure) in enumerate(figures):
        parts += [f"<h2>{html.escape(title)}</h2>", figure.to_html(full_html=False, include_plotlyjs=i == 0)]
    return parts + [f"<p class='note'>{html.escape(n)}</p>" for n in notes]


def _history(complete: list[TrialRow]):
    """Each complete trial's time over the default, and its passes' where it timed both (the search keeps
    the best forward and the best backward apart, and tries them together), with the best so far."""
    from plotly import graph_objects as go

    both = all(r.rel["fwd"] is not None and r.rel["bwd"] is not None for r in complete)
    series = [("fwd+bwd" if both else "time", [r.value for r in complete], 10)]
    if both:
        series += [(part, [r.rel[part] for r in complete], 6) for part in ("fwd", "bwd")]
    figure = go.Figure()
    for name, values, size in series:
        figure.add_scatter(x=[r.number for r in complete], y=values, mode="markers", name=name,
                           text=[r.config for r in complete], marker={"size": size})
    best, lowest = [], float("inf")
    for r in complete:
        lowest = min(lowest, r.value)
        best.append(lowest)
    figure.add_scatter(x=[r.number for r in complete], y=best, mode="lines", name="best so far", line={"shape": "hv"})
    figure.add_hline(y=1.0, line_dash="dot", annotation_text="the default")
    figure.update_layout(xaxis_title="trial", yaxis_title="time / default (lower is faster)", height=420,
                         margin={"t": 30})
    return figure


def _tiles(complete: list[TrialRow]):
    """Parallel coordinates over the tile sizes the complete trials ran (each axis a setting, its values in
    order, "-" where a trial's config leaves it unset; a setting every trial shares has no axis), coloured by
    time over the default."""
    from plotly import graph_objects as go

    fields = [described_fields(r.config) for r in complete]
    names = list(dict.fromkeys(name for f in fields for name in f))  # in the configs' order
    dimensions = []
    for name in names:
        values = [f.get(name, "-") for f in fields]
        if len(set(values)) == 1:
            continue
        ordered = sorted(set(values), key=lambda v: (v == "-", not v.isdigit(), int(v) if v.isdigit() else 0, v))
        dimensions.append({"label": name, "values": [ordered.index(v) for v in values],
                           "tickvals": list(range(len(ordered))), "ticktext": ordered,
                           "range": [0, max(1, len(ordered) - 1)]})
    values = [r.value for r in complete]
    dimensions.append({"label": "time / default", "values": values})
    figure = go.Figure(go.Parcoords(line={"color": values, "colorscale": "Viridis", "showscale": True,
                                          "colorbar": {"title": "time / default"}}, dimensions=dimensions))
    figure.update_layout(height=460, margin={"l": 80, "r": 80, "t": 60})
    return figure


def _importances(study: optuna.Study):
    """optuna's importance of each setting for the time over the default (its ranks read as the settings'
    names); `ValueError` where there is nothing to weigh."""
    from plotly import graph_objects as go

    with warnings.catch_warnings():  # few trials: optuna warns that its fit sees few values of a setting
        warnings.filterwarnings("ignore", message="Some regimes for parameter")
        found = optuna.importance.get_param_importances(study)
    if not found:
        raise ValueError("its trials sampled no settings")
    names = [name.removesuffix("_rank") for name in found][::-1]
    figure = go.Figure(go.Bar(x=list(found.values())[::-1], y=names, orientation="h"))
    figure.update_layout(xaxis_title="importance (optuna's fANOVA, summing to 1)", height=120 + 30 * len(names),
                         margin={"t": 20})
    return figure


__all__ = ["TrialRow", "problem_line", "trial_rows", "write_report"]
