"""One registry of attention implementations: the ring over each block kernel, the gathered mechanisms,
and whatever a user registers, as peers behind one contract.

An implementation is one way to compute exact attention of sharded queries over a sharded sequence
(`tuner.strategies.implementations` holds the built-in ones). It publishes its name, a frozen `Config` type of its
own, and the hooks the tools need; the tuner, the cache, the loader and the CLI reach implementations
only through this module, and treat configs as opaque data (`to_dict` / `from_dict`), so a new
implementation is one `register()` call and no change anywhere else.

A config holds the settings of each pass, `{"fwd": {...}, "bwd": {...}}`: the tuner tunes the passes an
objective times, combines the best forward of one trial with the best backward of another, and the
cache stores the two parts (its `fwd_params` and `bwd_params` columns).

The package's modules, bottom to top: `contract` (the protocol, `Config`, `Space`, `Target`), `versions`
(the rule that makes a measurement current, which the cache reads from here), `table` (register, look
up, the optional hooks, the cache key) and `choice` (which implementation runs a call). Callers import
this package (the cache imports `versions` too). The layer imports `support` and `semantics` only.
"""

from tuner.registry.choice import (FALLBACK, PREFERENCE, RIVALS, by_engine, choose, contenders, fallback_for,
                                   for_strategy, over_kernel, problem_why_not, resolve_auto, strategy_choice, taking,
                                   why_not)
from tuner.registry.contract import (GATHERED, OBJECTIVE_PARTS, PARTS, STRATEGIES, TWO_AXES, ChoiceSpace, Config,
                                     Implementation, Space, Target)
from tuner.registry.table import (combine, config_from_parts, default_config, find, forward_tiles, get, key, label,
                                  mesh_axes, names, problem_key, problem_tile_shapes, register, registered,
                                  shape_violation, strategy_of, tile_shapes, unregister, versions)

__all__ = ["FALLBACK", "GATHERED", "OBJECTIVE_PARTS", "PARTS", "PREFERENCE", "RIVALS", "STRATEGIES", "ChoiceSpace",
           "Config", "Implementation", "Space", "TWO_AXES", "Target", "by_engine", "choose", "combine", "contenders",
           "config_from_parts", "default_config", "fallback_for", "find", "for_strategy", "forward_tiles", "get",
           "key", "label", "mesh_axes", "names", "over_kernel", "problem_key", "problem_tile_shapes",
           "problem_why_not", "register", "registered", "resolve_auto", "shape_violation", "strategy_choice",
           "strategy_of", "taking", "tile_shapes", "unregister", "versions", "why_not"]
