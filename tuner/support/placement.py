"""Arrays placed as `shard_map` takes them.

Over auto mesh axes `shard_map` reshards its arguments to its `in_specs` itself. Over explicit axes it
takes only arrays already sharded as the specs say, and refuses the rest: a replicated array, or one
sharded over another axis. `for_shard_map` reshards those first, as auto axes would: a replicated array is
cut on each device, one sharded otherwise moves once. Arrays already placed are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def for_shard_map(mesh: Mesh, axis_names: Iterable, args: Any, in_specs: Any) -> Any:
    """`args` (a pytree of the structure of `in_specs`, one `PartitionSpec` a leaf) resharded to their specs
    where any of `axis_names`, the axes `shard_map` runs manual over, is explicit; else `args` as given."""
    names = set(axis_names)
    if not any(t == AxisType.Explicit for n, t in zip(mesh.axis_names, mesh.axis_types) if n in names):
        return args
    return jax.tree.map(lambda spec, x: jax.sharding.reshard(x, NamedSharding(mesh, spec)), in_specs, args,
                        is_leaf=lambda node: isinstance(node, P))


__all__ = ["for_shard_map"]
