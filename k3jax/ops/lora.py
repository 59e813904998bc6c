"""LoRA's arithmetic (Hu et al. 2021): a frozen weight W plus a low-rank update, run as its own product.

    y = einsum(eq, x, W) + s · (x A) B          A: W's input dims + [r], B: [r] + W's output dims, s = alpha / r

``lora_einsum`` takes the einsum of a projection (``"btd,dnk->btnk"``: W's input dims are those it shares with x)
and adds the low-rank path without forming W + s A B, so the gradients of A and B cost O(r) per token, not a
full-size weight gradient; ``lora_weight`` forms the merged weight where a weight is consumed whole (MLA's absorbed
decode reads kv_b's blocks). Per-expert factors over a routed-expert stack travel as ``LoraWeight`` in the stack's
place (the MoE's expert functions; k3jax/ops/lora_experts.py), their A per expert or one shared by the stack.

LoRA dropout (PEFT's ``lora_dropout``, training only): y = x W + s · (dropout(x) A) B — inverted dropout on the
adapter's input alone (kept with probability 1 − p, scaled by 1 / (1 − p)); the base product sees x undropped.
``LoraDropout`` holds the key and p; ``dropped`` applies a given keep mask, so the arithmetic is testable apart
from the randomness.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.norms import acc_dtype


def dropped(x, keep, rate: float):
    """Inverted dropout with a given keep mask (bool, x's shape): x · 1 / (1 − rate) where ``keep``, else 0, in
    x's dtype (torch's ``nn.Dropout``: the mask times the scale)."""
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


@jax.tree_util.register_pytree_node_class
class LoraDropout:
    """LoRA dropout of one training forward: a PRNG ``key`` (typed or raw) and the drop probability ``rate`` (static,
    0 < rate < 1). ``fold(data)`` derives an independent one (a layer, a projection, a device); calling it on x
    draws one keep bit per element of x (``jax.random.bernoulli(key, 1 − rate, x.shape)``) and applies ``dropped``."""

    def __init__(self, key, rate: float):
        self.key, self.rate = key, float(rate)

    def tree_flatten(self):
        return (self.key,), self.rate

    @classmethod
    def tree_unflatten(cls, rate, children):
        return cls(children[0], rate)

    def fold(self, data) -> LoraDropout:
        return LoraDropout(jax.random.fold_in(self.key, data), self.rate)

    def keep_mask(self, shape) -> jax.Array:
        return jax.random.bernoulli(self.key, 1.0 - self.rate, shape)

    def __call__(self, x):
        return dropped(x, self.keep_mask(x.shape), self.rate)


class LoraWeight(NamedTuple):
    """A routed-expert stack with per-expert adapters: ``base`` [E, in, out] (an array, or the packed MXFP4
    ``PackedWeight``), ``a`` [E, in, r] (or [in, r]: one A shared by every expert), ``b`` [E, r, out] with the LoRA
    scale already folded in; ``dropout``: the stack's ``LoraDropout`` in a training forward, else None (the rows'
    masks: k3jax/ops/lora_experts.py)."""

    base: Any
    a: jax.Array
    b: jax.Array
    dropout: LoraDropout | None = None


def per_device_dropout(stacks, rows: tuple, h_axes: tuple = ()):
    """Inside a ``shard_map``: each ``LoraWeight`` of the (w1, w3, w2) ``stacks`` with its dropout key folded with
    this device's index over the mesh axes ``rows``, and w2's over ``h_axes`` too (its input h is split there, the
    rows' x is not), so that a device draws its own rows' masks: deterministic per key, mesh and routing, but not
    the one-device draws (expert parallelism: k3jax/sharding/expert_parallel.py)."""
    def fold(w, axes):
        drop = w.dropout if axes and isinstance(w, LoraWeight) else None
        return w if drop is None else w._replace(dropout=drop.fold(jax.lax.axis_index(axes)))

    w1, w3, w2 = stacks
    return fold(w1, rows), fold(w3, rows), fold(fold(w2, rows), h_axes)


def _split(eq: str):
    """``"btd,dnk->btnk"`` → (x subscripts, W's input letters, W's output letters, out subscripts, a free letter)."""
    ins, out = eq.replace(" ", "").split("->")
    x, w = ins.split(",")
    w_in = "".join(c for c in w if c in x)
    w_out = "".join(c for c in w if c not in x)
    free = next(c for c in "rzyxwvuqpo" if c not in eq)
    return x, w_in, w_out, out, free


def lora_einsum(eq: str, x, w, a=None, b=None, *, scale: float = 1.0, acc=None, x_lora=None):
    """``einsum(eq, x, w)`` (``preferred_element_type=acc``) plus ``scale · (x_lora a) b`` when ``a`` is given;
    ``x_lora``: the adapter's input, x's shape and dtype (default x; LoRA dropout's output while training). The
    factors are cast to x.dtype, products accumulate in ``acc``. W's input dims must come first in ``w``."""
    y = jnp.einsum(eq, x, w, preferred_element_type=acc)
    if a is None:
        return y
    x = x if x_lora is None else x_lora
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


__all__ = ["LoraDropout", "LoraWeight", "dropped", "lora_einsum", "lora_weight", "per_device_dropout", "shares_a"]
