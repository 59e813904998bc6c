"""What every block shares: parameter creation with logical axes, the init draws, and the HF leaf record.

A block is a ``flax.nnx.Module`` that creates its own ``nnx.Param`` leaves. Each leaf carries its logical axes
(``notation.LOGICAL_AXES``) as the metadata key ``axes`` — our own key, not flax's ``sharding_names``, which would
shard eagerly and needs a mesh: init and a full-size ``nnx.eval_shape`` run with no mesh at all. The sharding rules
read ``axes`` (k3jax/sharding/rules.py).

Beside its leaves, a block class keeps ``HF``: its table ``attribute → HFLeaf`` (a parameter: its HF suffix inside
the block and the transform between the two layouts) or ``attribute → str`` (a sub-block: its HF infix). The name
map (k3jax/checkpoint/name_map.py) walks these tables; adding a leaf to a block is one edit in that block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.notation import LOGICAL_AXES

INIT_STD = 0.02  # HF initializer_range


class HFLeaf(NamedTuple):
    """How one parameter is stored in an HF checkpoint.

    suffix: the tensor name inside the block (e.g. "q_proj.weight").
    transform (leaf ← HF): copy, linear (leaf [*in, *out] ← torch [prod(out), prod(in)], ``in_axes`` leading leaf
      axes are the input), row ([d] ← [1, d]), conv ([C, W] ← [C, 1, W]), flat ([N, K] ← [N*K]), A_log (the
      layout's A_log form), expert (routed-expert stack, one tensor per expert).
    dtype: "BF16", "F32", "F32k3" (F32 in the K3 layout, BF16 in Kimi-Linear's).
    """

    suffix: str
    transform: str = "linear"
    dtype: str = "BF16"
    in_axes: int = 1


def vec(suffix: str, dtype: str = "BF16") -> HFLeaf:
    return HFLeaf(suffix, "copy", dtype)


def param(value, axes: tuple[str, ...]) -> nnx.Param:
    """An ``nnx.Param`` carrying its logical axes; a wrong count or an unknown name is an error here."""
    axes = tuple(axes)
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match a parameter of shape {tuple(value.shape)}")
    unknown = [a for a in axes if a not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"unknown logical axes {unknown}; known: {LOGICAL_AXES}")
    return nnx.Param(value, axes=axes)


def normal(rngs: nnx.Rngs, shape, dtype, std: float = INIT_STD):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


__all__ = ["HFLeaf", "INIT_STD", "normal", "param", "vec"]
