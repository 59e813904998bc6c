"""Sharding as data (docs/design.md §3.6): ONE table logical axis → mesh axes (a column per strategy). The logical axes
of each parameter live on the parameter itself (the ``axes`` metadata its block attaches, k3jax/layers/common.py).
Nothing else in k3jax maps names to mesh axes.

    specs = param_specs(cfg, "ep_tp", mesh)          # PartitionSpec per leaf of abstract_params(cfg)
    shard = param_shardings(cfg, "ep_tp", mesh)      # NamedSharding per leaf (needs a real Mesh)

Columns: ``single`` (one device), ``fsdp``, ``ep``, ``ep_tp``, ``fsdp_ep_tp``, ``zero3_ep_tp`` and ``serve``.
``zero3_ep_tp`` is ``fsdp_ep_tp`` except that the embed and latent dimensions, and MLA's low ranks q_lora / kv_lora,
are split over fsdp × expert: ZeRO-3 over both axes the non-expert weights are data-parallel on (MaxText shards
``embed`` over its expert axis too). The routed-expert stacks keep their placement (experts → expert, so their
latent dimension is left fsdp). Full-size K3 training needs it on v5p-512: fp32 master + gradient + optimizer
state of the ~57 B non-expert parameters is ~100 GB per chip over fsdp = 8 alone (``k3 plan --compile``,
experiments/LOG.md).

``serve`` is the serving column (``k3 plan --compile --mode decode | verify`` ranks it, k3jax/plan/layouts.py): a
decode step reads every weight once, so each chip's share of the non-expert weights sets its time. ``ep_tp`` splits
them over ``tensor`` alone (kimi-k3 on v5p-64, tensor 4: 36 GB per chip per token); ``serve`` keeps heads, FFN
hidden and vocab over ``tensor`` and splits the model width ``embed`` over ``expert``, so every projection is split
over tensor × expert — all chips of a tensor × expert mesh. The routed expert stacks keep ep_tp's placement
(experts → expert, their hidden → tensor). Its "batch" row is the token axes, as in ep_tp, but a decode step keeps
its rows whole on every chip (``placement.whole_rows``): only the caches are split by rows, and the attention runs
per row shard (k3jax/sharding/row_split.py).

``seq`` (a sequence's positions) maps to the ``context`` axis in every column but ``single``: a mesh with
context > 1 splits each sequence (k3jax/sharding/context_parallel.py, which also lends a small batch's unused token
axes to the sequence); the latent cache's positions follow it.

Rules of the game:
- every name of ``notation.LOGICAL_AXES`` has a row in every column; a missing or unknown name is a ValueError;
- every parameter carries one logical axis per dimension (stacked leaves lead with ``layers``); a leaf the model
  does not have is a ValueError — nothing is replicated by default;
- a mesh axis shards at most one dimension of an array: when two dimensions of one array map to the same mesh axis,
  the FIRST dimension (left to right) keeps it and the later one is left unsharded (e.g. ``moe.down [embed, latent]``
  under ``fsdp``: embed → fsdp, latent → replicated). ``param_specs`` never emits a spec naming an axis twice;
- a dimension that is not divisible by the product of its mesh-axis sizes is a ValueError naming the parameter, the
  dimension, its logical axis and the mesh axes — except over a row's trailing ``IfDivides`` axes, which a
  dimension takes only where it divides (serve's vocab over expert). Size-1 mesh axes are dropped from specs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.config import K3Config
from k3jax.errors import InputError
from k3jax.layers.experts import packed_axes, parse_packed_name
from k3jax.layers.lora import has_adapters, is_adapter
from k3jax.model import abstract_params, param_axes
from k3jax.notation import LOGICAL_AXES
from k3jax.pytree import get_path, key_names, path_str
from k3jax.sharding.mesh import MESH_AXES, axis_sizes


class IfDivides(str):
    """A mesh axis that a rules row takes only where the dimension divides by it (with the row's axes before it);
    elsewhere the dimension is left unsplit over it, instead of the ValueError an indivisible dimension raises. For
    splits that are a layout choice the model runs either way, on sizes a user's config may not divide (a
    vocabulary of 97 over 8 chips). Only a row's trailing axes may be ``IfDivides``."""


# --------------------------------------------------------------------------------------------------------------
# logical axis → mesh axes, one column per strategy. Value: None (replicated), a mesh axis, or a tuple of axes.
#
# logical      single  fsdp             ep        ep_tp     fsdp_ep_tp  zero3_ep_tp  serve
_TOK = ("data", "fsdp", "expert")  # tokens are sharded over every non-tensor axis (EP: the expert axis doubles as DP)
_Z3 = ("fsdp", "expert")  # zero3_ep_tp: non-expert weights split over fsdp x expert, not fsdp alone
_C, _E, _T = "context", "expert", "tensor"
_SERVE_VOCAB = (_T, IfDivides(_E))  # the serve column's vocab row (comment below the table)
_TABLE = {
    "batch":      (None,  ("data", "fsdp"), _TOK,     _TOK,     _TOK,       _TOK,        _TOK),
    "seq":        (None,  _C,               _C,       _C,       _C,         _C,          _C),
    "embed":      (None,  "fsdp",           None,     None,     "fsdp",     _Z3,         _E),
    "vocab":      (None,  None,             None,     _T,       _T,         _T,          _SERVE_VOCAB),
    "heads":      (None,  None,             None,     _T,       _T,         _T,          _T),
    "head_dim":   (None,  None,             None,     None,     None,       None,        None),
    "q_lora":     (None,  None,             None,     None,     None,       _Z3,         None),
    "kv_lora":    (None,  None,             None,     None,     None,       _Z3,         None),
    "kda_rank":   (None,  None,             None,     None,     None,       None,        None),
    "conv_tap":   (None,  None,             None,     None,     None,       None,        None),
    "mlp":        (None,  None,             None,     _T,       _T,         _T,          _T),
    "experts":    (None,  None,             _E,       _E,       _E,         _E,          _E),
    "expert_mlp": (None,  None,             None,     _T,       _T,         _T,          _T),
    "latent":     (None,  "fsdp",           None,     None,     "fsdp",     _Z3,         None),
    "norm":       (None,  None,             None,     None,     None,       None,        None),
    "layers":     (None,  None,             None,     None,     None,       None,        None),
    "lora_rank":  (None,  None,             None,     None,     None,       None,        None),
}
# The serve column, row by row (kimi-k3: 96 heads, d = 7168 = 2^10 x 7, vocab 163840, 896 experts, q_lora 1536,
# kv_lora 512 + 64):
# - heads over tensor alone, not tensor x expert: 96 = 3 x 32 heads split over no 64-, 128- or 256-chip product,
#   and the KDA state and the cache rows already take the expert axis (batch → _TOK); the heads' projections reach
#   all chips through their width instead: embed → expert (7168 splits 2 .. 1024 ways), so wq [embed, heads, h] is
#   [expert, tensor, -]. At decode the activations are [B, d]: per layer the projections' partial sums are
#   all-reduced over expert and the output projection's over tensor x expert — O(1) collectives per block.
# - latent replicated: the LatentMoE down [embed, latent] and up [latent, embed] both split by their embed over
#   expert, so down's partial sums meet in the all-reduce of the router's and the shared experts' (one per MoE layer
#   at decode) and up maps the routed sum, whole on every chip after the experts' psum, straight onto the stream's
#   width split with no collective. With latent → expert, up took expert by its latent (the first dimension wins)
#   and its output was all-reduced over expert at every layer (experiments/LOG.md, 2026-12-07). The routed stacks'
#   latent lost the contested expert axis to "experts" either way (ExpertParallel's width split of them is empty).
# - q_lora, kv_lora replicated: q_b [q_lora, heads, h] and kv_b [kv_lora, heads, h] are split over tensor by their
#   heads, and q_a / kv_a over expert by their embed; splitting the low ranks as well would add an all-reduce per
#   MLA layer to save ~14 MB of reads per MLA layer and chip. kv_lora also places the latent cache's last dimension
#   (cache.CACHE_AXES), which decode reads whole per head.
# - head_dim, kda_rank, conv_tap, norm, layers, lora_rank: small or contracted inside a head; replicated as in ep_tp.
# - vocab over tensor, then over expert where the vocabulary divides: the embedding [vocab, embed] has its rows split
#   over all chips, lm_head [embed, vocab] its width over expert and vocab over tensor (its embed takes expert first).
#   With the embedding's width split instead, each chip's [163840, 112] slice is stored column-major by the TPU
#   compiler (a minor dimension under 128 lanes) and the token gather relaid the whole slice out every step: 73 MB
#   per chip of the B = 64 decode on v5p-64 expert=64. Split by rows, the gather is a masked local one and one
#   all-reduce of the gathered [tokens, d] (experiments/LOG.md, 2026-12-07 session 36).
STRATEGIES = ("single", "fsdp", "ep", "ep_tp", "fsdp_ep_tp", "zero3_ep_tp", "serve")
RULES: dict[str, dict[str, str | tuple[str, ...] | None]] = {
    s: {name: col[i] for name, col in _TABLE.items()} for i, s in enumerate(STRATEGIES)
}

def get_rules(rules: str | Mapping) -> dict[str, tuple[str, ...]]:
    """Validate a rules column (a strategy name or a {logical axis: mesh axes} dict) and normalise each value to a
    tuple of mesh axes. Missing / unknown logical names and unknown mesh axes raise ValueError."""
    name = rules if isinstance(rules, str) else "<custom rules>"
    if isinstance(rules, str):
        if rules not in RULES:
            raise InputError(f"unknown sharding strategy {rules!r}; known: {', '.join(STRATEGIES)}")
        rules = RULES[rules]
    missing = [a for a in LOGICAL_AXES if a not in rules]
    if missing:
        raise ValueError(f"rule table {name} has no entry for logical axis {missing[0]!r} (missing: {missing})")
    unknown = [a for a in rules if a not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"rule table {name} names unknown logical axes {unknown}; known: {LOGICAL_AXES}")
    out = {}
    for logical, mesh_axes in rules.items():
        t = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        bad = [m for m in t if m not in MESH_AXES]
        if bad:
            raise ValueError(f"rule table {name}: logical axis {logical!r} maps to unknown mesh axes {bad}")
        if len(set(t)) != len(t):
            raise ValueError(f"rule table {name}: logical axis {logical!r} names a mesh axis twice: {t}")
        if any(isinstance(a, IfDivides) and not isinstance(b, IfDivides) for a, b in zip(t, t[1:])):
            raise ValueError(f"rule table {name}: logical axis {logical!r} has an IfDivides axis before a plain one")
        out[logical] = t
    return out


def logical_to_spec(logical: tuple, shape: tuple, rules, mesh, *, name: str = "array",
                    lenient: bool = False) -> PartitionSpec:
    """PartitionSpec for an array with logical axes ``logical`` (None = replicated dim) of ``shape``.

    First dimension wins a contested mesh axis; size-1 mesh axes are dropped; indivisible dimensions raise — or,
    ``lenient``, stay whole (LoRA adapters: a factor's [r, 576] kv_a side is small, and 576 does not split 128 ways
    where its base's does not need to)."""
    table = get_rules(rules)
    sizes = axis_sizes(mesh)
    used: set[str] = set()
    out = []
    for dim, (lax_name, n) in enumerate(zip(logical, shape, strict=True)):
        if lax_name is None:
            out.append(None)
            continue
        if lax_name not in table:
            raise ValueError(f"{name}: unknown logical axis {lax_name!r}; known: {LOGICAL_AXES}")
        for a in table[lax_name]:
            if a not in sizes:
                raise ValueError(f"{name}: rules map {lax_name!r} to mesh axis {a!r}, absent from the mesh {sizes}")
        axes = _dividing(tuple(a for a in table[lax_name] if a not in used and sizes.get(a, 1) > 1), n, sizes)
        k = math.prod(sizes[a] for a in axes)
        if n % k and lenient:
            out.append(None)
            continue
        if n % k:
            raise InputError(f"{name}: dimension {dim} (logical axis {lax_name!r}, size {n}) is not divisible by "
                             f"mesh axes {axes} (sizes {[sizes[a] for a in axes]}, product {k})")
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _dividing(axes: tuple, n: int, sizes: dict) -> tuple[str, ...]:
    """``axes`` less its trailing ``IfDivides`` axes until their product divides ``n``, as plain names."""
    while axes and isinstance(axes[-1], IfDivides) and n % math.prod(sizes[a] for a in axes):
        axes = axes[:-1]
    return tuple(str(a) for a in axes)


def param_specs(cfg: K3Config, rules, mesh, params=None):
    """PartitionSpec per parameter leaf, from the logical axes each block attached to its Params
    (``k3jax.model.param_axes``). ``mesh``: a Mesh, AbstractMesh or {axis: size} dict. ``params`` (optional) is
    a tree with the model's structure whose leaf shapes are used instead of the abstract ones."""
    get_rules(rules)  # validate the table once, before any leaf
    params = abstract_params(cfg) if params is None else params
    axes = param_axes(cfg, adapters=has_adapters(params))

    def one(path, x):
        logical = leaf_axes(axes, key_names(path), len(x.shape))
        if len(logical) != len(x.shape):
            raise ValueError(f"{path_str(path)}: logical axes {logical} do not match shape {tuple(x.shape)}")
        return logical_to_spec(logical, x.shape, rules, mesh, name=path_str(path),
                               lenient=is_adapter(key_names(path)[-1]))

    return jax.tree_util.tree_map_with_path(one, params)


def leaf_axes(axes, names: tuple, ndim: int | None = None) -> tuple:
    """Logical axes of the leaf at ``names`` in ``axes`` (``param_axes(cfg)``). A routed-expert stack held packed
    (``w1_packed`` / ``w1_scale`` [..., out, in/2 or in/32], k3jax.layers.moe.Experts.to_packed) has its float
    stack's axes with the last two swapped: the packed bytes run along ``in``. A routed stack's shared LoRA A
    (``LoRAConfig.experts_shared_a``: [..., in, r], one dimension short of the per-expert A ``param_axes`` lists;
    ``ndim``: the leaf's) has those axes less "experts": it is never split over the expert axis."""
    routed = len(names) >= 2 and names[-2] == "experts"
    packed = parse_packed_name(names[-1]) if routed else None
    if packed:
        return packed_axes(tuple(_axes_at(axes, (*names[:-1], packed[0]))))
    logical = tuple(_axes_at(axes, names))
    if routed and ndim == len(logical) - 1 and isinstance(names[-1], str) and names[-1].endswith("_lora_a"):
        return tuple(a for i, a in enumerate(logical) if i != logical.index("experts"))
    return logical


def _axes_at(axes, names: tuple):
    try:
        return get_path(axes, names)
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"no parameter {'.'.join(map(str, names))} in the model; its axes are unknown") from None


def param_shardings(cfg: K3Config, rules, mesh: jax.sharding.Mesh, params=None):
    """NamedSharding per parameter leaf on ``mesh``."""
    specs = param_specs(cfg, rules, mesh, params)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


def mesh_axes_of(logical: str, rules, mesh, size: int | None = None) -> tuple[str, ...]:
    """Mesh axes (size > 1 ones only) that ``logical`` maps to under ``rules`` on ``mesh``; with ``size``, those a
    dimension of that size takes (its ``IfDivides`` axes where they divide it)."""
    sizes = axis_sizes(mesh)
    axes = tuple(a for a in get_rules(rules)[logical] if sizes.get(a, 1) > 1)
    return tuple(map(str, axes)) if size is None else _dividing(axes, size, sizes)
