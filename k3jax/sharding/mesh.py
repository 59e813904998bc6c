"""Device meshes with the five k3jax axis names (docs/design.md §2, docs/numerics.md §14.6).

    mesh = make_mesh({"data": 2, "expert": 4})      # fsdp, context and tensor default to size 1
    mesh = make_mesh({"data": 2, "context": 4})     # the sequence split 4 ways (k3jax/sharding/context_parallel.py)

Every mesh has all of ``MESH_AXES`` in that order (outer → inner; ``tensor`` innermost because it talks most), so
rule tables may name any of them on any mesh. Sizes not given are 1.

Axis types: **Auto** (``jax.sharding.AxisType.Auto``) by default. The model is written as plain jnp over unannotated
arrays; under Explicit axis types every einsum over a sharded contraction dimension and every shard_map whose inputs
are not already laid out as its ``in_specs`` is a type error (docs/numerics.md §14.6), which would push sharding
decisions into model code. With Auto, parameters are placed by ``param_specs`` and XLA propagates; the expert-parallel
dispatch is a ``shard_map`` that chooses its own communication. ``axis_types="explicit"`` is accepted for callers that
want sharding-in-types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from k3jax.errors import InputError

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

_AXIS_TYPES = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}


def mesh_shape(shape: Mapping[str, int]) -> dict[str, int]:
    """Complete a {axis: size} dict to all of ``MESH_AXES`` (missing → 1); unknown names raise."""
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise InputError(f"unknown mesh axes {sorted(unknown)}; k3jax meshes have axes {MESH_AXES}")
    out = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    bad = {a: s for a, s in out.items() if s < 1}
    if bad:
        raise InputError(f"mesh axis sizes must be >= 1, got {bad}")
    return out


def make_mesh(shape: Mapping[str, int], *, axis_types: str = "auto",
              devices: Sequence | None = None) -> jax.sharding.Mesh:
    """A mesh over ``devices`` (default: all devices, or the first prod(shape) of them) with axes ``MESH_AXES``."""
    full = mesh_shape(shape)
    n = math.prod(full.values())
    if axis_types not in _AXIS_TYPES:
        raise ValueError(f"axis_types must be one of {sorted(_AXIS_TYPES)}, got {axis_types!r}")
    types = (_AXIS_TYPES[axis_types],) * len(MESH_AXES)
    sizes = tuple(full[a] for a in MESH_AXES)
    if devices is None:
        avail = jax.devices()
        if len(avail) < n:
            raise InputError(f"mesh {full} needs {n} devices, only {len(avail)} available")
        if len(avail) == n:
            return jax.make_mesh(sizes, MESH_AXES, axis_types=types)
        devices = avail[:n]
    devs = np.asarray(devices, dtype=object)
    if devs.size != n:
        raise InputError(f"mesh {full} needs {n} devices, got {devs.size}")
    return jax.sharding.Mesh(devs.reshape(sizes), MESH_AXES, axis_types=types)


def axis_sizes(mesh) -> dict[str, int]:
    """{axis: size} of a Mesh / AbstractMesh, or a plain dict completed with ``mesh_shape``."""
    if isinstance(mesh, Mapping):
        return mesh_shape(mesh)
    return dict(mesh.shape)
