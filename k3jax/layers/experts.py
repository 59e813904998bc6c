"""The routed-expert stacks of an MoE block, and their packed MXFP4 form: the one home of the packed schema.

Float form (trained): ``w1`` / ``w3`` [..., P, F] and ``w2`` [..., F, P] Params, [in, out] per expert, with any
leading axes ([E], or [G, E] in a stacked group). Packed form (the checkpoint's bytes, kept frozen): each stack
``w`` [..., in, out] is two uint8 leaves in the torch orientation of the checkpoint (docs/numerics.md §10.2):

    w_packed  [..., out, in/2]    two E2M1 codes per byte, blocks of 32 along ``in``
    w_scale   [..., out, in/32]   one E8M0 scale byte per block

Every module that names, shapes, places or splits packed leaves asks this one: ``packed_name`` /
``parse_packed_name`` (the names), ``packed_shapes`` / ``packed_axes`` (their shapes and logical axes),
``holds_packed`` (is an experts dict packed), ``packed_form`` (a params tree's packed twin, shapes only),
``split_packed`` / ``merge_trees`` (the frozen leaves out of a params tree and back). The checkpoint's own tensor
names (``.weight_packed`` / ``.weight_scale``) are the name map's (``k3jax/checkpoint/name_map.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import HFLeaf, normal, param
from k3jax.ops.mx import mxfp4_packed_shapes
from k3jax.ops.packed_experts import PackedWeight

STACKS = ("w1", "w3", "w2")
PACKED_PARTS = ("packed", "scale")

# MoE dispatch name → packed-experts implementation (k3jax/ops/packed_experts.py)
PACKED_DISPATCH = {"sorted": "auto", "tiled": "tiles", "ragged": "gmm", "dense": "dense"}


# ------------------------------------------------------------------------------------------------ the schema

def packed_name(stack: str, part: str) -> str:
    """``packed_name("w1", "scale")`` → ``"w1_scale"``."""
    if stack not in STACKS or part not in PACKED_PARTS:
        raise ValueError(f"no packed leaf for stack {stack!r}, part {part!r}")
    return f"{stack}_{part}"


def parse_packed_name(name) -> tuple[str, str] | None:
    """``"w1_packed"`` → ``("w1", "packed")``; None for any other key (a float stack, a non-expert leaf)."""
    if not isinstance(name, str):
        return None
    stack, _, part = name.rpartition("_")
    return (stack, part) if stack in STACKS and part in PACKED_PARTS else None


def packed_shapes(shape) -> dict[str, tuple[int, ...]]:
    """{part: shape} of the packed leaves of a float stack of shape [..., in, out]."""
    *lead, n_in, n_out = shape
    packed, scale = mxfp4_packed_shapes((*lead, n_out, n_in))  # the torch orientation: blocks along ``in``
    return {"packed": packed, "scale": scale}


def packed_axes(axes: tuple) -> tuple:
    """Logical axes of a packed leaf from its float stack's (..., in, out): the bytes run along ``in``."""
    return (*axes[:-2], axes[-1], axes[-2])


def holds_packed(experts: Mapping) -> bool:
    """Whether an ``experts`` dict (of a params tree or state) holds its stacks packed."""
    return packed_name("w1", "packed") in experts


def packed_form(params):
    """``params`` (a tree of arrays or ShapeDtypeStructs) with every routed-expert stack replaced by its packed
    leaves, as uint8 ShapeDtypeStructs: the form ``load(..., keep_experts_packed=True)`` returns."""
    def walk(node, name):
        if not isinstance(node, dict):
            return node
        if name == "experts" and "w1" in node:   # the stacks packed; anything beside them (adapters) as it is
            return {**{k: x for k, x in node.items() if k not in STACKS},
                    **{packed_name(k, part): jax.ShapeDtypeStruct(shape, jnp.uint8)
                       for k, x in node.items() if k in STACKS for part, shape in packed_shapes(x.shape).items()}}
        return {k: walk(v, k) for k, v in node.items()}

    return walk(params, None)


def split_packed(params) -> tuple[dict, dict]:
    """(everything else, only the packed expert leaves) of a params tree; ``merge_trees`` puts them back."""
    def walk(node):
        if not isinstance(node, dict):
            return node, None
        rest, packed = {}, {}
        for k, v in node.items():
            if parse_packed_name(k):
                packed[k] = v
                continue
            r, pk = walk(v)
            if not (isinstance(r, dict) and not r):
                rest[k] = r
            if pk:
                packed[k] = pk
        return rest, packed

    return walk(params)


def merge_trees(a: dict, b: dict | None) -> dict:
    """The union of two nested dicts with disjoint leaves (``split_packed``'s inverse)."""
    if not b:
        return a
    out = dict(a)
    for k, v in b.items():
        out[k] = merge_trees(out[k], v) if k in out and isinstance(v, dict) else v
    return out


# ------------------------------------------------------------------------------------------------ the block

class PackedExperts(nnx.Variable):
    """Frozen routed-expert storage in the checkpoint's MXFP4 form (uint8 bytes or E8M0 scale bytes). Not an
    ``nnx.Param``: parameter filters, gradients and optimizers skip it."""


class Experts(nnx.Module):
    """The routed-expert stacks [E, in, out]; HF ``experts.{e}.w{1,2,3}`` (one tensor, or an MXFP4 pair, per
    expert: the name map expands the ``expert`` transform)."""

    LORA = STACKS  # per-expert adapters over each stack (k3jax/layers/lora.py)
    HF = {"w1": HFLeaf("w1", "expert"), "w3": HFLeaf("w3", "expert"), "w2": HFLeaf("w2", "expert")}

    def __init__(self, *, num_experts: int, width: int, hidden: int, width_axis: str, dtype, rngs: nnx.Rngs):
        E, P, F = num_experts, width, hidden
        self.w1 = param(normal(rngs, (E, P, F), dtype), ("experts", width_axis, "expert_mlp"))
        self.w3 = param(normal(rngs, (E, P, F), dtype), ("experts", width_axis, "expert_mlp"))
        self.w2 = param(normal(rngs, (E, F, P), dtype), ("experts", "expert_mlp", width_axis))

    @property
    def is_packed(self) -> bool:
        return hasattr(self, packed_name("w1", "packed"))

    def to_packed(self) -> None:
        """Replace the Params w1/w3/w2 [..., in, out] (any leading axes, e.g. a stacked group's) by ShapeDtypeStruct
        placeholders of their packed form (``packed_shapes``): uint8 ``PackedExperts`` with the transposed logical
        axes (``packed_axes``). The structure a packed params tree merges into."""
        for name in STACKS:
            var = getattr(self, name)
            axes = packed_axes(tuple(var.get_metadata()["axes"]))
            delattr(self, name)
            for part, shape in packed_shapes(var.shape).items():
                setattr(self, packed_name(name, part), PackedExperts(jax.ShapeDtypeStruct(shape, jnp.uint8), axes=axes))

    def weights(self) -> tuple:
        """(w1, w3, w2): the stacks [E, P, F], [E, P, F], [E, F, P], or their ``PackedWeight`` pairs — with the
        layer's index when the packed leaves hold a scanned group's every layer (``read_in_place``)."""
        if self.is_packed:
            layer = getattr(self, "stack_layer", None)
            return tuple(PackedWeight(*(getattr(self, packed_name(n, part))[...] for part in PACKED_PARTS), layer)
                         for n in STACKS)
        return tuple(getattr(self, n)[...] for n in STACKS)


def read_in_place(module, layer) -> None:
    """Mark every packed ``Experts`` under ``module`` — a scan body's group, merged with its packed leaves whole,
    [L, E, ...] over the scanned layers — as layer ``layer`` (traced int32) of them: ``weights`` then hands out
    ``PackedWeight`` stacks with that index, which the grouped kernels read in place, instead of a slice that XLA
    would copy per layer (k3jax/ops/packed_experts.py). A plain attribute of the transient merged module, which is
    never split again."""
    for _, m in nnx.iter_graph(module):
        if isinstance(m, Experts) and m.is_packed:
            m.stack_layer = layer


__all__ = ["PACKED_DISPATCH", "PACKED_PARTS", "STACKS", "Experts", "PackedExperts", "holds_packed",
           "merge_trees", "packed_axes", "packed_form", "packed_name", "packed_shapes", "parse_packed_name",
           "read_in_place", "split_packed"]
