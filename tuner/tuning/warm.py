"""Warm start: a new problem's study begins with what the nearest tuned problems learned.

After the default, a study's first trials are the winners the cache holds for the problems nearest
this one (`Cache.neighbours`: same implementation, device kind and dtype; the loader's distance over
sizes and layout, plus head dim and features; packed neighbours first for a packed problem), each
queued with `source` "nearest <key> (distance d)".
A winner is queued once, and not at all where it is the default (the study's first trial) or a config
this problem's space does not hold (tiles larger than its shards): the next nearest problem's winner
takes its place, up to `NEIGHBOURS` winners. Then the sampler takes over. `tuner search --no-warm-start`
turns it off.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import optuna

from tuner import registry
from tuner.cache import Cache, row_config
from tuner.registry import Config
from tuner.semantics.problem import ProblemKey
from tuner.tuning.study import enqueue

NEIGHBOURS = 3  # how many distinct winners of the nearest tuned problems a study starts from
CONSIDERED = 12  # how many of the nearest tuned problems are read to find them


def in_space(config: Config, space: registry.Space, default: Config, parts: tuple[str, ...]) -> bool:
    """Whether each tuned part of `config` is a point of `space`'s grid for that part."""
    return all(config.to_dict()[part] in [c.to_dict()[part] for c in space.grid(default, (part,))]
               for part in parts)


def winners(near: Iterable[tuple[float, dict[str, Any]]], implementation: registry.Implementation,
            space: registry.Space, default: Config, parts: tuple[str, ...]) -> list[tuple[Config, str]]:
    """(config, source) of the first `NEIGHBOURS` distinct winners among the ranked (distance, row) `near`
    that `implementation` accepts, `space` holds, and that differ from `default` in the tuned `parts`."""
    seen = {json.dumps(space.params(default, parts), sort_keys=True)}
    chosen = []
    for distance, row in near:
        try:
            config = row_config(row)
            implementation.check(config)
        except ValueError:
            continue
        if not in_space(config, space, default, parts):
            continue
        name = json.dumps(space.params(config, parts), sort_keys=True)
        if name in seen:
            continue
        seen.add(name)
        chosen.append((config, f"nearest {row['key'][:8]} (distance {distance:.1f})"))
        if len(chosen) == NEIGHBOURS:
            break
    return chosen


def warm_start(study: optuna.Study, cache: Cache, key: ProblemKey, versions: dict[str, str],
               implementation: registry.Implementation, space: registry.Space, default: Config,
               parts: tuple[str, ...]) -> list[str]:
    """Queue the nearest tuned problems' winners in `study`; returns the sources queued."""
    queued = []
    for config, source in winners(cache.neighbours(key, versions, CONSIDERED), implementation, space, default, parts):
        enqueue(study, [config], space, parts, source=source)
        queued.append(source)
    return queued


__all__ = ["CONSIDERED", "NEIGHBOURS", "in_space", "warm_start", "winners"]
