"""Warm start: a new problem's study begins with what the nearest tuned problems learned.

After the default, a study's first trials are configs the nearest tuned problems found good
(`Cache.neighbours`: same implementation, device kind and dtype; the loader's distance over sizes and
layout, plus head dim and features; packed neighbours first for a packed problem). Each of the `CONSENSUS`
nearest votes for its near-best configs (its winner and the configs its trials timed within 5% of its best,
`tuner.cache.rows`), weighed 1 / (1 + distance); the configs with the most weight come first. A timing
is noisy and tiles near the best are near-ties, so a config near-best on several neighbours is a surer
bet than one neighbour's winner (`docs/search-quality.md`). Where the votes give fewer
than `NEIGHBOURS` configs, the winners of the next nearest problems follow. Each is queued with `source`
"nearest <key> (distance d)", naming every neighbour that voted for it. Where an analytic model times the
implementation on this device (`tuner.models.tpu_model`: the pallas_tpu ring on a TPU), its `MODEL_PICKS`
fastest admitted configs follow, with `source` "model (t ms predicted)". A config is queued once, and not
at all where it is the default (the study's first trial) or a config this problem's space does not hold
(tiles larger than its shards). Then the sampler takes over. `tuner search --no-warm-start` turns it off.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import optuna

from tuner import registry
from tuner.cache import Cache, near_configs, row_config
from tuner.registry import Config
from tuner.models import tpu_model
from tuner.semantics.problem import Problem, ProblemKey
from tuner.tuning.study import enqueue

NEIGHBOURS = 3  # how many configs the nearest tuned problems give a study, after the default
MODEL_PICKS = 2  # how many of the analytic model's fastest follow them, where a model times the implementation
CONSENSUS = 3  # how many of the nearest tuned problems vote with their near-best configs
CONSIDERED = 12  # how many of the nearest tuned problems are read


def in_space(config: Config, space: registry.Space, default: Config, parts: tuple[str, ...]) -> bool:
    """Whether each tuned part of `config` is a point of `space`'s grid for that part."""
    return all(config.to_dict()[part] in [c.to_dict()[part] for c in space.grid(default, (part,))]
               for part in parts)


def point(config: Config, space: registry.Space, parts: tuple[str, ...]) -> str:
    """The name of `config` in `space` by its tuned `parts`: two configs of one name are one trial."""
    return json.dumps(space.params(config, parts), sort_keys=True)


def winners(near: Iterable[tuple[float, dict[str, Any]]], implementation: registry.Implementation,
            space: registry.Space, default: Config, parts: tuple[str, ...]) -> list[tuple[Config, str]]:
    """(config, source) of the first `NEIGHBOURS` distinct configs to queue from the ranked (distance, row)
    `near`: the `CONSENSUS` nearest rows' near-best configs by weight of votes, then the further rows'
    winners; only configs `implementation` accepts, `space` holds, and that differ from `default` in the
    tuned `parts`."""
    def name(config: Config) -> str:
        return point(config, space, parts)

    def usable(config: Config) -> bool:
        try:
            implementation.check(config)
        except ValueError:
            return False
        return in_space(config, space, default, parts) and name(config) != name(default)

    votes: dict[str, tuple[Config, list[tuple[float, str]]]] = {}  # name -> (config, (distance, key) of voters)
    further: list[tuple[Config, list[tuple[float, str]]]] = []  # the further rows' winners, nearest first
    voting = 0
    for distance, row in near:
        try:
            near_best, winner = near_configs(row), row_config(row)
        except ValueError:
            continue
        voter = [(distance, row["key"][:8])]
        if voting < CONSENSUS:
            voting += 1
            for config in filter(usable, near_best):
                votes.setdefault(name(config), (config, []))[1].extend(voter)
        elif usable(winner):
            further.append((winner, voter))
    ranked = sorted(votes.values(), key=lambda vote: -sum(1 / (1 + d) for d, _ in vote[1]))  # ties: nearest first
    chosen: dict[str, tuple[Config, str]] = {}
    for config, voters in [*ranked, *further]:
        if len(chosen) < NEIGHBOURS:
            chosen.setdefault(name(config), (config, "nearest " + ", ".join(f"{key} (distance {d:.1f})"
                                                                            for d, key in voters)))
    return list(chosen.values())


def model_picks(problem: Problem, device_kind: str, implementation: registry.Implementation, space: registry.Space,
                default: Config, parts: tuple[str, ...], taken: list[Config]) -> list[tuple[Config, str]]:
    """(config, source) of the analytic model's `MODEL_PICKS` fastest configs (`tuner.models.tpu_model.ranked`:
    the implementations over the Pallas kernel, its ring and the strategies' over it, on a TPU it has rates for;
    none elsewhere) other than `taken` in the tuned `parts`.
    Configs the model times alike (it does not see every setting) give one pick at most: the first of them,
    none where one of them is taken."""
    seen, predicted = {point(config, space, parts) for config in taken}, set()
    picks = []
    for seconds, config in tpu_model.ranked(problem, device_kind, implementation, space, default, parts):
        if len(picks) == MODEL_PICKS:
            break
        name = point(config, space, parts)
        if name not in seen and seconds not in predicted:
            picks.append((config, f"model ({seconds * 1e3:.3g} ms predicted)"))
        seen.add(name)
        predicted.add(seconds)
    return picks


def warm_start(study: optuna.Study, cache: Cache, problem: Problem, key: ProblemKey, versions: dict[str, str],
               implementation: registry.Implementation, space: registry.Space, default: Config,
               parts: tuple[str, ...]) -> list[str]:
    """Queue in `study` the configs the nearest tuned problems found good (`winners`), then the analytic
    model's fastest (`model_picks`); returns the sources queued."""
    chosen = winners(cache.neighbours(key, versions, CONSIDERED), implementation, space, default, parts)
    chosen += model_picks(problem, key.device_kind, implementation, space, default, parts,
                          [default, *(config for config, _ in chosen)])
    for config, source in chosen:
        enqueue(study, [config], space, parts, source=source)
    return [source for _, source in chosen]


__all__ = ["CONSENSUS", "CONSIDERED", "MODEL_PICKS", "NEIGHBOURS", "in_space", "model_picks", "point", "warm_start",
           "winners"]
