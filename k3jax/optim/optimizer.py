"""K3's optimizer split (docs/model.md §9): per-head Muon for attention Q/K/V, per-expert Muon for expert stacks,
full-matrix Muon for other matrices, AdamW for embeddings / head / norms / gates / convs / AttnRes vectors, nothing
for the Quantile-Balancing bias buffers.

Built on ``optax.contrib.muon`` (its ``MuonDimensionNumbers`` treat every other axis as a batch axis, so one
Newton–Schulz runs per head or per expert) — no Newton–Schulz of our own. The traps docs/model.md §9.5 lists are set
explicitly: the AdamW branch gets its own learning rate, β2 = 0.95 and no Nesterov (we use ``optax.adamw`` for the
AdamW groups, so Muon's ``nesterov`` never reaches them), and weight decay follows the group table.

    tx, labels = make_optimizer(params, OptimConfig(lr=2e-3, total_steps=300))

Modes: "per_head" (K3, default), "full" (full-matrix Muon for the head-split tensors; experts stay per expert —
a flattened [E·in, out] stack is never orthogonalized), "adamw" (AdamW everywhere; ablation baseline).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers as MDN  # noqa: N817

from k3jax.errors import InputError
from k3jax.optim.dist_muon import LAYOUTS, NS_SCOPE, OPTIMIZER_SCOPE, owner_muon, view_spec
from k3jax.pytree import key_names, path_str

MODES = ("per_head", "full", "adamw")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 2e-3  # peak LR, shared by both groups thanks to the 0.2·sqrt(max) Muon scaling (docs/model.md §9.4)
    adam_lr: float | None = None  # None → same as lr
    total_steps: int = 1000
    warmup_frac: float = 0.01  # cosine schedule with 1% linear warmup
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    muon_beta: float = 0.95
    muon_nesterov: bool = True
    ns_steps: int = 5
    consistent_rms: float = 0.2  # Moonlight: 0.2 · sqrt(max(fan_in, fan_out)) per block
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    mode: str = "per_head"
    kvb_split: str = "separate"  # "separate" K and V blocks per head (default) | "joint" (torchtitan)
    # dtype the moments (Muon momentum, AdamW mu / nu) are stored in between steps; the update itself is computed in
    # the parameters' dtype (fp32 masters) from the stored moments (``_stored``)
    state_dtype: str = "float32"
    # where Newton–Schulz runs: "layer" (one layer at a time, each block where the parameter rules put it) or
    # "owner" (blocks pooled by shape over layers, heads and experts, each orthogonalized whole on one device of the
    # mesh: k3jax/optim/dist_muon.py); the two give the same update (batched vs sliced rounding)
    muon_layout: str = "layer"

    def __post_init__(self):
        if self.mode not in MODES:
            raise InputError(f"optimizer mode {self.mode!r}: must be one of {MODES}")
        try:
            floating = jnp.issubdtype(jnp.dtype(self.state_dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise InputError(f"--opt-state-dtype {self.state_dtype!r}: the optimizer state's dtype must be a float "
                             "dtype (float32, bfloat16, float16)")
        if self.muon_layout not in LAYOUTS:
            raise InputError(f"--muon-layout {self.muon_layout!r}: must be one of {LAYOUTS}")
        if self.kvb_split not in ("separate", "joint"):
            raise InputError(f"kvb_split {self.kvb_split!r}: must be 'separate' or 'joint'")
        if self.total_steps < 1 or self.lr <= 0:
            raise InputError(f"total_steps must be >= 1 and lr > 0 (got {self.total_steps}, {self.lr})")

    def replace(self, **kw) -> OptimConfig:
        return dataclasses.replace(self, **kw)


def schedule(peak: float, cfg: OptimConfig):
    warm = max(1, int(round(cfg.warmup_frac * cfg.total_steps)))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(cfg.total_steps, warm + 1),
                                              end_value=peak * cfg.min_lr_ratio)


_PER_HEAD = {("kda", "wq"), ("kda", "wk"), ("kda", "wv"), ("mla", "q_b"), ("mla", "wq")}
_ADAM_DECAY = {"embed", "lm_head", "conv_q", "conv_k", "conv_v", "query"}
# Without weight decay: every vector (norm scales, gains, A_log — the 1-D rule in _layer_rule, so a new 1-D leaf needs
# no entry here) and KDA's dt_bias [N, K].
_ADAM_NODECAY = {"dt_bias"}


def leaf_rule(path, leaf, mode: str = "per_head", kvb_split: str = "separate"):
    """(label, MuonDimensionNumbers or None, reshape or None) for one parameter. Unknown leaves are an error.

    Leaves of the stacked layer groups (path under ``groups``, k3jax/model/layout.py) are optimized one layer at a
    time: ``make_optimizer`` hands the transforms the G slices of the leading ``layers`` axis, so each layer gets
    the update (and the Newton–Schulz) it gets as an unstacked leaf. For such a leaf — whole, or a slice
    whose path ends in its stack index — this is one layer's rule."""
    names = key_names(path)
    shape = tuple(leaf.shape)
    if names and names[0] == "groups":
        if isinstance(names[-1], int):  # one layer's slice (make_optimizer's per-layer view)
            names = names[:-1]
        else:  # the whole stacked leaf [G, ...]
            shape = shape[1:]
    return _layer_rule(names, shape, mode, kvb_split)


def _layer_rule(names: tuple, shape: tuple, mode: str, kvb_split: str):
    last = names[-1]
    parent = names[-2] if len(names) >= 2 else None
    ndim = len(shape)
    if last == "bias" and parent == "moe":
        return "frozen", None, None
    if last in _ADAM_DECAY:
        return "adam_decay", None, None
    if last in _ADAM_NODECAY or ndim <= 1:
        return "adam_nodecay", None, None
    if mode == "adamw":
        return "adam_decay", None, None
    if parent == "experts" and ndim == 3:  # [E, in, out]: per expert
        return "muon", MDN(reduction_axis=1, output_axis=2), None
    if ndim == 2:
        return "muon", MDN(0, 1), None
    if ndim == 3:
        key = (parent, last)
        if mode == "per_head" and key in _PER_HEAD:  # [in, N, X]
            return "muon", MDN(reduction_axis=0, output_axis=2), None
        if mode == "per_head" and key == ("mla", "kv_b"):
            r, n, hx = shape
            if kvb_split == "joint":
                return "muon", MDN(reduction_axis=0, output_axis=2), None
            if hx % 2:
                raise ValueError(f"{'/'.join(map(str, names))}: cannot split K and V blocks of width {hx}")
            return "muon", MDN(reduction_axis=0, output_axis=3), (r, n, 2, hx // 2)
        if last == "wo":  # [N, V, D]: the head axis is on the input side, not split
            return "muon", MDN(reduction_axis=(0, 1), output_axis=2), None
        return "muon", MDN(reduction_axis=0, output_axis=(1, 2)), None
    raise ValueError(f"no optimizer rule for parameter {'/'.join(map(str, names))} with shape {tuple(shape)}")


def _rules(params, cfg: OptimConfig):
    return jax.tree_util.tree_map_with_path(lambda p, x: leaf_rule(p, x, cfg.mode, cfg.kvb_split), params)


def _is_rule(x):
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str)


def _reshaping(inner: optax.GradientTransformation, shapes) -> optax.GradientTransformation:
    """Run ``inner`` on views of some leaves (e.g. kv_b [R, N, 2·X] → [R, N, 2, X]) and reshape updates back."""

    def view(tree):
        return jax.tree.map(lambda x, s: x if s is None or isinstance(x, optax.MaskedNode) else x.reshape(s),
                            tree, shapes, is_leaf=lambda x: x is None or isinstance(x, optax.MaskedNode))

    def init(params):
        return inner.init(view(params))

    def update(updates, state, params=None):
        orig = jax.tree.map(lambda u: u.shape, updates)
        new, state = inner.update(view(updates), state, None if params is None else view(params))
        new = jax.tree.map(lambda u, s: u.reshape(s), new, orig, is_leaf=lambda x: isinstance(x, jax.Array))
        return new, state

    return optax.GradientTransformation(init, update)


_MOMENTS = ("mu", "nu")  # the optax state fields (ScaleByAdamState, MuonState) that hold a moment per parameter


def _is_moment(path) -> bool:
    return any(getattr(k, "name", None) in _MOMENTS for k in path)


def _stored(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``inner`` with its moments kept in ``dtype`` between steps: each update widens them to float32 (the master
    weights' dtype), runs ``inner`` there and rounds the new moments to ``dtype`` (round to nearest). Counts and
    Muon's Newton–Schulz coefficients are left as they are. Hand-written: optax's ``mu_dtype`` covers the first
    moment of AdamW and Muon only, not AdamW's second moment."""
    dtype = jnp.dtype(dtype)

    def cast(state, to):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: x.astype(to) if _is_moment(p) and jnp.issubdtype(x.dtype, jnp.floating) else x, state)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        new, state = inner.update(updates, cast(state, jnp.float32), params)
        return new, cast(state, dtype)

    return optax.GradientTransformation(init, update)


def _scoped(inner: optax.GradientTransformation, name: str) -> optax.GradientTransformation:
    """``inner`` with its update traced under ``jax.named_scope(name)`` (the planner finds its ops by it)."""

    def update(updates, state, params=None):
        with jax.named_scope(name):
            return inner.update(updates, state, params)

    return optax.GradientTransformation(inner.init, update)


def _stacked_mask(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: key_names(p)[0] == "groups", params)


def _part(tree, stacked, want: bool):
    """The leaves whose stacked flag is ``want``, None (an empty subtree) at the others."""
    return jax.tree.map(lambda s, x: x if s == want else None, stacked, tree)


def _merge(stacked, flat, stack):
    """Inverse of ``_part``: one tree from its unstacked and stacked halves."""
    return jax.tree.map(lambda s, a, b: b if s else a, stacked, flat, stack, is_leaf=lambda x: x is None)


def _inner(params, cfg: OptimConfig, lr, adam_lr):
    """The partitioned transform (Muon / AdamW groups / frozen) for ``params`` (leaves or None) and its labels.
    For the stacked half, ``params`` holds the whole stacked leaves: their rules are one layer's (``leaf_rule``), and
    the transform runs on one layer's slices."""
    rules = _rules(params, cfg)
    labels = jax.tree.map(lambda r: r[0], rules, is_leaf=_is_rule)
    shapes = jax.tree.map(lambda r: r[2], rules, is_leaf=_is_rule)

    def dim_nums(masked_params):
        # muon's partition hands us the params with non-Muon leaves masked out; mirror that mask.
        return jax.tree.map(lambda r, p: optax.MaskedNode() if isinstance(p, optax.MaskedNode) else r[1],
                            rules, masked_params, is_leaf=lambda x: _is_rule(x) or isinstance(x, optax.MaskedNode))

    muon = optax.contrib.muon(
        lr, ns_steps=cfg.ns_steps, beta=cfg.muon_beta, nesterov=cfg.muon_nesterov, weight_decay=cfg.weight_decay,
        consistent_rms=cfg.consistent_rms, muon_weight_dimension_numbers=dim_nums,
        adam_learning_rate=adam_lr, adam_b2=cfg.adam_b2)  # no leaf reaches muon's internal AdamW branch
    adamw = lambda wd: optax.adamw(adam_lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,  # noqa: E731
                                   weight_decay=wd, nesterov=False)
    tx = optax.partition(
        {"muon": _scoped(_reshaping(muon, shapes), NS_SCOPE), "adam_decay": adamw(cfg.weight_decay),
         "adam_nodecay": adamw(0.0),
         "frozen": optax.set_to_zero()},
        labels)
    if jnp.dtype(cfg.state_dtype) != jnp.float32:
        tx = _stored(tx, cfg.state_dtype)
    return tx, labels


def make_optimizer(params, cfg: OptimConfig = OptimConfig(), mesh=None, specs=None):
    """The K3 optimizer for ``params``. Returns (GradientTransformation, labels tree). ``mesh`` and ``specs`` (the
    parameters' PartitionSpecs on it): where the ``owner`` layout (``cfg.muon_layout``) sends each block to be
    orthogonalized (None: one device).

    Stacked leaves [G, ...] (the repeating layer group, k3jax/model/layout.py) are updated one layer at a time by
    ``lax.map`` over the G axis: the per-layer transform (each layer's own Newton–Schulz, as unstacked — see
    ``leaf_rule``) is traced and compiled once, whatever G is, and its state is stacked [G, ...] like the
    parameters (so the optimizer state shards like its parameter, leaf by leaf). The unstacked leaves get the same
    transform directly. State: ``{"flat": <unstacked leaves' state>, "stacked": <per-layer state, stacked>}``.

    Numerics (tests/optim/test_optimizer.py): the stacked update equals the update of the per-layer view within float64
    rounding; a batched Newton–Schulz over [G, ...] (vmap instead of map) left about half the float32 Muon leaves
    different by up to ~1e-5, which is why this is a map. Before the map (session 8) the G slices were unrolled in
    Python: the train step's optimizer HLO then grew with G (31,603 StableHLO lines at 12 layers, 247,619 at 92).

    The ``owner`` layout takes the Muon leaves out of the per-layer map: their whole stacks go to ``owner_muon``
    (``k3jax.optim.dist_muon``), the other leaves keep the map. State: ``{"flat", "stacked", "muon"}``."""
    if cfg.muon_layout == "owner" and cfg.mode != "adamw":
        tx, labels = _owner_optimizer(params, cfg, mesh, specs)
    else:
        tx, labels = _layered(params, cfg)
    return _scoped(tx, OPTIMIZER_SCOPE), labels


def _layered(params, cfg: OptimConfig):
    """``make_optimizer``'s per-layer optimizer of ``params`` (leaves, or None where another transform owns them)."""
    stacked = _stacked_mask(params)
    lr = schedule(cfg.lr, cfg)
    adam_lr = schedule(cfg.adam_lr or cfg.lr, cfg)
    flat_tx, flat_labels = _inner(_part(params, stacked, False), cfg, lr, adam_lr)
    any_stacked = any(jax.tree.leaves(stacked))
    if any_stacked:
        layer_tx, layer_labels = _inner(_part(params, stacked, True), cfg, lr, adam_lr)
    else:
        layer_labels = _part(params, stacked, True)

    def init(p):
        state = {"flat": flat_tx.init(_part(p, stacked, False))}
        if any_stacked:  # vmap of init only builds zeros / counts (no arithmetic); counts come out [G]
            state["stacked"] = jax.vmap(layer_tx.init)(_part(p, stacked, True))
        return state

    def update(updates, state, p=None):
        u_flat, s_flat = flat_tx.update(_part(updates, stacked, False), state["flat"],
                                        None if p is None else _part(p, stacked, False))
        new_state = {"flat": s_flat}
        u_stack = _part(updates, stacked, True)
        if any_stacked:
            def one(args):
                u, s, q = args
                return layer_tx.update(u, s, q)

            u_stack, new_state["stacked"] = jax.lax.map(
                one, (u_stack, state["stacked"], None if p is None else _part(p, stacked, True)))
        return _merge(stacked, u_flat, u_stack), new_state

    labels = _merge(stacked, flat_labels, layer_labels)
    return optax.GradientTransformation(init, update), labels


def whole_leaf_rule(path, leaf, cfg: OptimConfig):
    """(label, dims, view) of a whole leaf: a stacked leaf's per-layer rule with its layer axis as a batch axis."""
    label, dims, view = leaf_rule(path, leaf, cfg.mode, cfg.kvb_split)
    if label != "muon" or key_names(path)[0] != "groups":
        return label, dims, view
    shift = lambda a: a + 1 if isinstance(a, int) else tuple(x + 1 for x in a)  # noqa: E731
    return label, MDN(shift(dims.reduction_axis), shift(dims.output_axis)), (
        None if view is None else (leaf.shape[0], *view))


def _owner_optimizer(params, cfg: OptimConfig, mesh, specs):
    """The ``owner`` layout: Muon leaves whole through ``owner_muon``, the rest through ``_layered``."""
    on_mesh = mesh is not None and any(n > 1 for n in mesh.shape.values())
    if on_mesh and specs is None:
        raise ValueError("the owner Muon layout on a mesh needs the parameters' PartitionSpecs (specs=)")
    rules = jax.tree_util.tree_map_with_path(lambda p, x: whole_leaf_rule(p, x, cfg), params)
    is_muon = jax.tree.map(lambda r: r[0] == "muon", rules, is_leaf=_is_rule)
    rest_tx, rest_labels = _layered(_part(params, is_muon, False), cfg)
    dims = _part(jax.tree.map(lambda r: r[1], rules, is_leaf=_is_rule), is_muon, True)
    views = _part(jax.tree.map(lambda r: r[2], rules, is_leaf=_is_rule), is_muon, True)
    view_specs = None
    if on_mesh:
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        view_specs = jax.tree_util.tree_map_with_path(
            lambda path, sp, x, v: sp if v is None else view_spec(sp, x.shape, v, path_str(path)),
            _part(specs, is_muon, True), _part(params, is_muon, True), views, is_leaf=is_spec)
    stacked = _part(_stacked_mask(params), is_muon, True)
    muon = owner_muon(lambda _: dims, schedule(cfg.lr, cfg), ns_steps=cfg.ns_steps, beta=cfg.muon_beta,
                      nesterov=cfg.muon_nesterov, consistent_rms=cfg.consistent_rms, weight_decay=cfg.weight_decay,
                      mesh=mesh if on_mesh else None, specs=view_specs, stacked=stacked)
    muon = _reshaping(muon, views)
    # bf16 momentum widened whole around the transform, not group by group inside its loop: widened inside, the
    # full QAT step on v5p-512 copied twelve float32 gradient stacks every loop iteration (+2.66 TB of HBM traffic
    # per chip, +7.4 GB peak), though the optimizer alone compiled cheaper that way (experiments/LOG.md, session 29)
    if jnp.dtype(cfg.state_dtype) != jnp.float32:
        muon = _stored(muon, cfg.state_dtype)

    def init(p):
        return {**rest_tx.init(_part(p, is_muon, False)), "muon": muon.init(_part(p, is_muon, True))}

    def update(updates, state, p=None):
        rest_state = {k: v for k, v in state.items() if k != "muon"}
        u_rest, s_rest = rest_tx.update(_part(updates, is_muon, False), rest_state,
                                        None if p is None else _part(p, is_muon, False))
        u_muon, s_muon = muon.update(_part(updates, is_muon, True), state["muon"],
                                     None if p is None else _part(p, is_muon, True))
        return _merge(is_muon, u_rest, u_muon), {**s_rest, "muon": s_muon}

    labels = _merge(is_muon, rest_labels, jax.tree.map(lambda r: r[0], _part(rules, is_muon, True), is_leaf=_is_rule))
    return optax.GradientTransformation(init, update), labels


def group_sizes(labels, params) -> dict:
    out: dict[str, int] = {}
    for lab, p in zip(jax.tree.leaves(labels), jax.tree.leaves(params)):
        out[lab] = out.get(lab, 0) + int(p.size)
    return out


__all__ = ["OptimConfig", "make_optimizer", "leaf_rule", "whole_leaf_rule", "schedule", "group_sizes", "jnp"]
