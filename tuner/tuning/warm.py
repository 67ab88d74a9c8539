"""Warm start: a new problem's study begins with what the nearest tuned problems learned.

After the default, a study's first trials are the winners the cache holds for the problems nearest
this one (`Cache.neighbours`: same implementation, device kind and dtype; the loader's distance over
sizes and layout, plus head dim and features), each queued with `source` "nearest <key> (distance d)".
A neighbour's config that this problem's space does not hold (tiles larger than its shards) is left out.
Then the sampler takes over. `tuner search --no-warm-start` turns it off.
"""

from __future__ import annotations

import optuna

from tuner import registry
from tuner.cache import Cache, row_config
from tuner.registry import Config
from tuner.semantics.problem import ProblemKey
from tuner.tuning.study import enqueue

NEIGHBOURS = 3  # how many of the nearest tuned problems a study starts from


def in_space(config: Config, space: registry.Space, default: Config, parts: tuple[str, ...]) -> bool:
    """Whether each tuned part of `config` is a point of `space`'s grid for that part."""
    return all(config.to_dict()[part] in [c.to_dict()[part] for c in space.grid(default, (part,))]
               for part in parts)


def warm_start(study: optuna.Study, cache: Cache, key: ProblemKey, versions: dict[str, str],
               implementation: registry.Implementation, space: registry.Space, default: Config,
               parts: tuple[str, ...]) -> list[str]:
    """Queue the nearest tuned problems' winners in `study`; returns the sources queued."""
    queued = []
    for distance, row in cache.neighbours(key, versions, NEIGHBOURS):
        try:
            config = row_config(row)
            implementation.check(config)
        except ValueError:
            continue
        if not in_space(config, space, default, parts):
            continue
        source = f"nearest {row['key'][:8]} (distance {distance:.1f})"
        enqueue(study, [config], space, parts, source=source)
        queued.append(source)
    return queued


__all__ = ["NEIGHBOURS", "in_space", "warm_start"]
