"""`tuner report`: an HTML report of a study, from optuna's plotly visualizations."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import optuna

from tuner.tuning.study import DUPLICATE, SURPLUS, open_storage


def write_report(study: str, storage: str, out: str | Path) -> int:
    """Write an HTML report of `study` (optimization history, parameter importances, parallel
    coordinates, from optuna's plotly visualizations) to `out`; returns the number of trials.

    `KeyError` when the storage has no such study, `ImportError` (saying what to install) without
    plotly.
    """
    if importlib.util.find_spec("plotly") is None:
        raise ImportError("tuner report needs plotly: pip install plotly (or pip install "
                          "'ring-tuner[report]')")
    import html

    from optuna import visualization

    names = [s.study_name for s in optuna.get_all_study_summaries(open_storage(storage))]
    if study not in names:
        raise KeyError(f"no study {study!r} in {storage} (it has {len(names)}); pass the storage the "
                       f"search used with --storage")
    loaded = optuna.load_study(study_name=study, storage=open_storage(storage))
    trials = [t for t in loaded.get_trials(deepcopy=False) if t.user_attrs.get("failure") not in (SURPLUS, DUPLICATE)]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    figures: list[tuple[str, Any]] = [("Optimization history (time relative to the default)",
                                       visualization.plot_optimization_history(loaded))]
    notes = []
    if len(complete) >= 2:
        figures.append(("Parallel coordinates", visualization.plot_parallel_coordinate(loaded)))
        try:
            figures.append(("Parameter importances", visualization.plot_param_importances(loaded)))
        except (RuntimeError, ValueError) as error:
            notes.append(f"parameter importances unavailable: {error}")
    else:
        notes.append("parallel coordinates and importances need at least two complete trials")
    states = Counter(t.state.name.lower() for t in trials)
    failures = Counter(t.user_attrs.get("failure", "killed") for t in trials
                       if t.state == optuna.trial.TrialState.FAIL)
    summary = ", ".join(f"{n} {s}" for s, n in states.items())
    if failures:
        summary += " (failed: " + ", ".join(f"{r} {n}" for r, n in failures.items()) + ")"
    parts = [f"<h1>Study {html.escape(study)}</h1>",
             f"<p>{html.escape(json.dumps(loaded.user_attrs.get('problem', {})))}</p>",
             f"<p>backend {html.escape(str(loaded.user_attrs.get('backend')))} on "
             f"{html.escape(str(loaded.user_attrs.get('device_kind')))}; trials: {html.escape(summary)}</p>",
             *(f"<p><i>{html.escape(n)}</i></p>" for n in notes)]
    for i, (title, figure) in enumerate(figures):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(figure.to_html(full_html=False, include_plotlyjs=(i == 0)))
    Path(out).write_text("<!doctype html><html><head><meta charset='utf-8'><title>tuner report</title>"
                         "</head><body>" + "\n".join(parts) + "</body></html>", encoding="utf-8")
    return len(trials)


__all__ = ["write_report"]
