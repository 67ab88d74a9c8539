"""Warm start: a new problem's study begins with what the nearest tuned problems learned.

After the default, a study's first trials are configs the nearest tuned problems found good
(`Cache.neighbours`: same implementation, device kind and dtype; the loader's distance over sizes and
layout, plus head dim and features; packed neighbours first for a packed problem). Each of the `CONSENSUS`
nearest votes for its near-best configs (its winner and the configs its trials timed within 5% of its best,
`tuner.cache.rows`), weighed 1 / (1 + distance); the configs with the most weight come first. A timing
is noisy and tiles near the best are near-ties, so a config near-best on several neighbours is a surer
bet than one neighbour's winner (`docs/tuning.md`, "How good the search is"). Where the votes give fewer
than `NEIGHBOURS` configs, the winners of the next nearest problems follow. Each is queued with `source`
"nearest <key> (distance d)", naming every neighbour that voted for it. A config is queued once, and not at
all where it is the default (the study's first trial) or a config this problem's space does not hold
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
from tuner.semantics.problem import ProblemKey
from tuner.tuning.study import enqueue

NEIGHBOURS = 3  # how many configs a study starts from, after the default
CONSENSUS = 3  # how many of the nearest tuned problems vote with their near-best configs
CONSIDERED = 12  # how many of the nearest tuned problems are read


def in_space(config: Config, space: registry.Space, default: Config, parts: tuple[str, ...]) -> bool:
    """Whether each tuned part of `config` is a point of `space`'s grid for that part."""
    return all(config.to_dict()[part] in [c.to_dict()[part] for c in space.grid(default, (part,))]
               for part in parts)


def winners(near: Iterable[tuple[float, dict[str, Any]]], implementation: registry.Implementation,
            space: registry.Space, default: Config, parts: tuple[str, ...]) -> list[tuple[Config, str]]:
    """(config, source) of the first `NEIGHBOURS` distinct configs to queue from the ranked (distance, row)
    `near`: the `CONSENSUS` nearest rows' near-best configs by weight of votes, then the further rows'
    winners; only configs `implementation` accepts, `space` holds, and that differ from `default` in the
    tuned `parts`."""
    def name(config: Config) -> str:
        return json.dumps(space.params(config, parts), sort_keys=True)

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


def warm_start(study: optuna.Study, cache: Cache, key: ProblemKey, versions: dict[str, str],
               implementation: registry.Implementation, space: registry.Space, default: Config,
               parts: tuple[str, ...]) -> list[str]:
    """Queue in `study` the configs the nearest tuned problems found good (`winners`); returns the sources
    queued."""
    queued = []
    for config, source in winners(cache.neighbours(key, versions, CONSIDERED), implementation, space, default, parts):
        enqueue(study, [config], space, parts, source=source)
        queued.append(source)
    return queued


__all__ = ["CONSENSUS", "CONSIDERED", "NEIGHBOURS", "in_space", "warm_start", "winners"]
