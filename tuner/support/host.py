"""jax run now, on the host, whatever mesh the caller set.

Some of what a call decides is computed when it is traced, on this host: a declared packing's default tile
runs small jax programs over the packing's rows. Under `jax.set_mesh`, jax places every program on the
mesh's devices. Where those devices cannot run a program (a TPU topology's, when a host without a TPU
compiles for one ahead of time), such a program failed with "'Executable' object has no attribute
'local_devices'", and jax's public API refuses another device inside the mesh's context. `on_host` clears the
mesh for the block, as no mesh had been set; on a jax without the private names it needs, it clears the
abstract mesh only, and the programs stay on the caller's devices.
"""

from __future__ import annotations

import contextlib

import jax

_NO_MESH = jax.sharding.AbstractMesh((), ())


def on_host() -> contextlib.AbstractContextManager:
    """A block in which jax computes on the default device, outside any mesh of `jax.set_mesh` (concrete and
    abstract), also inside a trace."""
    try:
        from jax._src.mesh import empty_concrete_mesh
        from jax._src.sharding_impls import _internal_use_concrete_mesh
    except ImportError:  # private names of jax 0.10 to 0.12: on another jax, the caller's devices
        return jax.sharding.use_abstract_mesh(_NO_MESH)
    stack = contextlib.ExitStack()
    stack.enter_context(_internal_use_concrete_mesh(empty_concrete_mesh))
    stack.enter_context(jax.sharding.use_abstract_mesh(_NO_MESH))
    return stack


__all__ = ["on_host"]
