"""LoRA's arithmetic (Hu et al. 2021): a frozen weight W plus a low-rank update, run as its own product.

    y = einsum(eq, x, W) + s · (x A) B          A: W's input dims + [r], B: [r] + W's output dims, s = alpha / r

``lora_einsum`` takes the einsum of a projection (``"btd,dnk->btnk"``: W's input dims are those it shares with x)
and adds the low-rank path without forming W + s A B, so the gradients of A and B cost O(r) per token, not a
full-size weight gradient; ``lora_weight`` forms the merged weight where a weight is consumed whole (MLA's absorbed
decode reads kv_b's blocks). Per-expert factors over a routed-expert stack travel as ``LoraWeight`` in the stack's
place (the MoE's expert functions; k3jax/ops/lora_experts.py), their A per expert or one shared by the stack.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.norms import acc_dtype


class LoraWeight(NamedTuple):
    """A routed-expert stack with per-expert adapters: ``base`` [E, in, out] (an array, or the packed MXFP4
    ``PackedWeight``), ``a`` [E, in, r] (or [in, r]: one A shared by every expert), ``b`` [E, r, out] with the LoRA
    scale already folded in."""

    base: Any
    a: jax.Array
    b: jax.Array


def _split(eq: str):
    """``"btd,dnk->btnk"`` → (x subscripts, W's input letters, W's output letters, out subscripts, a free letter)."""
    ins, out = eq.replace(" ", "").split("->")
    x, w = ins.split(",")
    w_in = "".join(c for c in w if c in x)
    w_out = "".join(c for c in w if c not in x)
    free = next(c for c in "rzyxwvuqpo" if c not in eq)
    return x, w_in, w_out, out, free


def lora_einsum(eq: str, x, w, a=None, b=None, *, scale: float = 1.0, acc=None):
    """``einsum(eq, x, w)`` (``preferred_element_type=acc``) plus ``scale · (x a) b`` when ``a`` is given; the
    factors are cast to x.dtype, products accumulate in ``acc``. W's input dims must come first in ``w``."""
    y = jnp.einsum(eq, x, w, preferred_element_type=acc)
    if a is None:
        return y
    xs, w_in, w_out, out, r = _split(eq)
    batch = "".join(c for c in xs if c not in w_in)
    xa = jnp.einsum(f"{xs},{w_in}{r}->{batch}{r}", x, a.astype(x.dtype), preferred_element_type=acc)
    d = jnp.einsum(f"{batch}{r},{r}{w_out}->{out}", xa.astype(x.dtype), b.astype(x.dtype), preferred_element_type=acc)
    return y + (scale * d).astype(y.dtype)


def _fits(w_shape, a_shape, b_shape, lead: int) -> bool:
    """Whether A [*lead, *in, r], B [*lead, r, *out] factor a W [*lead, *in, *out]."""
    return (lead >= 0 and a_shape[:lead] == b_shape[:lead] and a_shape[-1] == b_shape[lead]
            and w_shape == (*a_shape[:-1], *b_shape[lead + 1:]))


def shares_a(w_shape, a_shape, b_shape) -> bool:
    """Whether (A, B) are a routed-expert stack's shared-A factors: W [..., E, in, out], A [..., in, r] (no expert
    axis), B [..., E, r, out] — and not a per-leaf factorisation (that reading is tried first)."""
    w_shape, a_shape, b_shape = tuple(w_shape), tuple(a_shape), tuple(b_shape)
    if _fits(w_shape, a_shape, b_shape, len(a_shape) + len(b_shape) - 2 - len(w_shape)):
        return False
    return (len(a_shape) == len(w_shape) - 1 == len(b_shape) - 1 and b_shape[:-2] == w_shape[:-2]
            and a_shape[:-2] == w_shape[:-3] and a_shape[-2] == w_shape[-2] and b_shape[-1] == w_shape[-1]
            and a_shape[-1] == b_shape[-2])


def lora_weight(w, a, b, scale: float):
    """The merged weight W + scale · A B (A [..., *in, r], B [..., r, *out] with the same leading axes as W),
    in W's dtype (computed in at-least-fp32). A routed-expert stack's shared A (W [..., E, in, out], A [..., in, r],
    ``shares_a``) is every expert's A."""
    acc = acc_dtype(w.dtype)
    A, B = a.astype(acc), b.astype(acc)
    if shares_a(w.shape, A.shape, B.shape):
        A = jnp.broadcast_to(A[..., None, :, :], (*B.shape[:-2], *A.shape[-2:]))
    lead = (A.ndim - 1) + (B.ndim - 1) - w.ndim               # axes W, A and B share (experts, stacked layers)
    Af = A.reshape(*A.shape[:lead], -1, A.shape[-1])           # [..., prod(in), r]
    Bf = B.reshape(*B.shape[:lead + 1], -1)                    # [..., r, prod(out)]
    d = jnp.einsum("...ir,...ro->...io", Af, Bf).reshape(w.shape)
    return (w.astype(acc) + scale * d).astype(w.dtype)


__all__ = ["LoraWeight", "lora_einsum", "lora_weight", "shares_a"]
