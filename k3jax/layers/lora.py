"""LoRA adapters on the blocks, the one home (the arithmetic: k3jax/ops/lora.py).

    add_adapters(block, rank=16, scale=2.0, rngs=rngs)      # every leaf in block.LORA gets W_lora_a / W_lora_b
    y = proj(block, "wq", "btd,dnk->btnk", x, w, acc)      # einsum(x, w) + scale (x A) B if wq is adapted
    w_eff = merged(block, "kv_b")                           # W + scale A B, where a weight is consumed whole

Each block class lists the leaves an adapter may target in ``LORA`` beside its ``HF`` table; the model picks the
blocks by ``LoRAConfig.targets`` (k3jax/model/decoder.py). An adapted leaf ``W`` (input dims first: the HF table's
``in_axes``; a routed-expert stack [E, in, out] per expert) gets two Params beside it:

    W_lora_a  [*in, r]     logical axes: W's input axes + "lora_rank"    PEFT lora_A [r, prod(in)]
    W_lora_b  [r, *out]    "lora_rank" + W's output axes, zeros at init  PEFT lora_B [prod(out), r]

(experts: [E, in, r] and [E, r, out]; with ``shared_a`` one A [in, r] for all the stack's experts, logical axes
without "experts"), in at least fp32 over any base dtype. A follows PEFT's init (kaiming-uniform
with a = sqrt(5): U(±1/sqrt(fan_in))) and B = 0, so a fresh adapter gives the base outputs bit for bit (x A 0 = 0
exactly). They are Params: they stack into the scanned group, take their base's sharding (rules.py: lora_rank is
never split) and train; what stays frozen is the train loop's choice (``split_adapters``: with LoRA the whole base;
k3jax/train/loop.py). Routed-expert adapters run beside the stacks' own products (k3jax/ops/lora_experts.py), also
over the packed MXFP4 bytes (QLoRA); PEFT's layout on disk is k3jax/checkpoint/peft.py. qwix's LoRA provider
(tests/model/test_qwix_lora.py) intercepts dot_general / einsum, so it never sees the routed experts' grouped
matmuls (``ragged_dot`` or the MXFP4 kernel) and cannot reach inside the scanned stack: hence adapters of our own.

LoRA dropout (training only; ``LoRAConfig.dropout``, k3jax/ops/lora.py): the decoder layer opens
``dropout_scope(LoraDropout)`` around its token mixer and its FFN (its key folded with the layer index), and every
adapted projection inside draws its own masks from that key folded with ``projection_id`` (block class and leaf:
``"KDA.wq"``, ``"GLU.w_gate"``, ``"Experts.w1"``): ``proj`` drops the adapter's input x (one mask per element of
x), ``expert_stacks`` hands the key to the routed experts inside their ``LoraWeight``. The scope carries the key
the last step, from the layer into its blocks (KDA, MLA, GLU and MoE take no dropout argument); it is opened inside
the layer call, so every trace of that call (a remat's recompute, the scanned stack's backward) sees the same key,
never one left over from another trace. With no scope
(eval, logits, generate, scoring) the arithmetic is exactly the undropped one. ``merged`` (a weight consumed whole)
cannot drop an input: under a scope it refuses.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.errors import InputError
from k3jax.layers.common import param
from k3jax.ops.lora import LoraDropout, LoraWeight, lora_einsum, lora_weight
from k3jax.ops.norms import acc_dtype

SUFFIXES = ("lora_a", "lora_b")
_DROPOUT: contextvars.ContextVar[LoraDropout | None] = contextvars.ContextVar("lora_dropout", default=None)


def adapter_names(name: str) -> tuple[str, str]:
    """``"wq"`` → ``("wq_lora_a", "wq_lora_b")``."""
    return tuple(f"{name}_{s}" for s in SUFFIXES)


def is_adapter(key) -> bool:
    """Whether a state key names an adapter leaf."""
    return isinstance(key, str) and key.endswith(tuple(f"_{s}" for s in SUFFIXES))


def _lead_and_in(block, name: str, axes: tuple) -> tuple[int, int]:
    """(leading axes W, A and B share — a stacked group's "layers", a routed stack's experts —, W's input dims):
    the HF table's ``in_axes``, 1 for an expert stack [..., E, in, out]."""
    lead = sum(1 for a in axes[:2] if a == "layers")
    if block.HF[name].transform == "expert":
        return lead + 1, 1
    return lead, block.HF[name].in_axes


def add_adapters(block, *, rank: int, scale: float, rngs: nnx.Rngs, names=None, shared_a: bool = False) -> None:
    """Adapters on every leaf of ``block.LORA`` the block has (or on ``names``); the block may sit in a stacked
    group (leaves with a leading "layers" axis: each layer gets its own factors). ``shared_a``: a routed-expert
    stack's A is one [in, r] for all its experts (drawn as one expert's A would be: same bound), B per expert."""
    block.lora_scale = float(scale)
    for name in names or block.LORA:
        if not hasattr(block, name):
            continue
        var = getattr(block, name)
        axes = tuple(var.get_metadata()["axes"])
        shape = var.shape
        lead, n_in = _lead_and_in(block, name, axes)
        ins, outs = slice(lead, lead + n_in), slice(lead + n_in, None)
        fan_in = math.prod(shape[ins])
        bound = 1.0 / math.sqrt(fan_in)
        a_lead = lead - 1 if shared_a and block.HF[name].transform == "expert" else lead  # drop the expert axis
        a_shape = (*shape[:a_lead], *shape[ins], rank)
        b_shape = (*shape[:lead], rank, *shape[outs])
        dtype = acc_dtype(var[...].dtype)          # adapters train: at least fp32, whatever their (frozen) base
        a = jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound).astype(dtype)
        na, nb = adapter_names(name)
        setattr(block, na, param(a, (*axes[:a_lead], *axes[ins], "lora_rank")))
        setattr(block, nb, param(jnp.zeros(b_shape, dtype), (*axes[:lead], "lora_rank", *axes[outs])))


def split_adapters(params) -> tuple[dict, dict]:
    """(only the adapter leaves, everything else) of a params tree; ``layers.experts.merge_trees`` joins them."""
    def walk(node):
        if not isinstance(node, dict):
            return None, node
        ad, rest = {}, {}
        for k, v in node.items():
            if is_adapter(k):
                ad[k] = v
                continue
            a, r = walk(v)
            if a:
                ad[k] = a
            if not (isinstance(r, dict) and not r):
                rest[k] = r
        return ad, rest

    return walk(params)


def has_adapters(tree) -> bool:
    """Whether a params tree (arrays, shapes or shardings) holds any adapter leaf."""
    return any(is_adapter(getattr(k, "key", None)) for path, _ in jax.tree_util.tree_leaves_with_path(tree)
               for k in path[-1:])


def has_adapter(block, name: str) -> bool:
    """Whether leaf ``name`` of ``block`` carries one of these adapters (``lora_scale`` marks the block: qwix's LoRA
    provider names its own factors ``<name>_lora_a`` too, and runs them itself)."""
    return hasattr(block, "lora_scale") and hasattr(block, adapter_names(name)[0])


def _factors(block, name: str):
    na, nb = adapter_names(name)
    return getattr(block, na)[...], getattr(block, nb)[...]


@contextlib.contextmanager
def dropout_scope(dropout: LoraDropout | None):
    """The LoRA dropout the adapted projections traced inside use (module docstring); None: none."""
    token = _DROPOUT.set(dropout)
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def projection_id(block, name: str) -> int:
    """A stable id of leaf ``name`` of ``block``'s class (CRC-32 of ``"KDA.wq"``, 31 bits): what a layer's dropout
    key is folded with, so that every projection of a layer draws its own masks."""
    return zlib.crc32(f"{type(block).__name__}.{name}".encode()) & 0x7FFFFFFF


def _dropout(block, name: str) -> LoraDropout | None:
    drop = _DROPOUT.get()
    return None if drop is None else drop.fold(projection_id(block, name))


def proj(block, name: str, eq: str, x, w, acc):
    """``einsum(eq, x, w)`` for block leaf ``name`` (``w``: the leaf as the caller prepared it, e.g. cast), plus its
    adapter's low-rank path when it has one — on the dropped x inside a ``dropout_scope``."""
    if not has_adapter(block, name):
        return jnp.einsum(eq, x, w, preferred_element_type=acc)
    a, b = _factors(block, name)
    drop = _dropout(block, name)
    return lora_einsum(eq, x, w, a, b, scale=block.lora_scale, acc=acc, x_lora=None if drop is None else drop(x))


def merged(block, name: str):
    """Leaf ``name`` with its adapter merged in (W + scale A B), or the leaf itself. Under a ``dropout_scope`` an
    adapted leaf is refused: the merged weight has no separate adapter input to drop."""
    w = getattr(block, name)[...]
    if not has_adapter(block, name):
        return w
    if _DROPOUT.get() is not None:
        raise InputError(f"LoRA dropout cannot act on {type(block).__name__}.{name}'s adapter: the weight is consumed "
                         "merged (the Pallas MLA kernel: --kernels pallas, or auto on a GPU/TPU); train with "
                         "--kernels xla or LoRA dropout=0")
    a, b = _factors(block, name)
    return lora_weight(w, a, b, block.lora_scale)


def expert_stacks(experts, stacks):
    """The routed-expert stacks as the MoE's expert functions take them: each adapted one as a ``LoraWeight``
    (base, A, scale · B, and inside a ``dropout_scope`` the stack's own ``LoraDropout``)."""
    out = []
    for name, w in zip(("w1", "w3", "w2"), stacks, strict=True):
        if has_adapter(experts, name):
            a, b = _factors(experts, name)
            w = LoraWeight(w, a, b * jnp.asarray(experts.lora_scale, b.dtype), _dropout(experts, name))
        out.append(w)
    return tuple(out)


__all__ = ["SUFFIXES", "add_adapters", "adapter_names", "dropout_scope", "expert_stacks", "has_adapter", "has_adapters",
           "is_adapter", "merged", "projection_id", "proj", "split_adapters"]
