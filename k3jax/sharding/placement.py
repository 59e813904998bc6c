"""Placing a whole train state on a mesh from the rules table (SPEC §14): parameters, optimizer state and batches.

    sizes = parse_mesh("data=2,expert=4")                     # {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    strategy = default_strategy(sizes)                        # "ep"
    sh = state_shardings(cfg, strategy, mesh, jax.eval_shape(init, params))   # NamedSharding per state leaf
    dispatch = expert_dispatch(strategy, mesh)                 # ExpertParallel, or None when experts are not sharded

Optimizer state: optax keeps per-parameter moments (Muon momentum, AdamW mu / nu) in trees that mirror the
parameters, nested under its own containers; k3jax's optimizer keeps the per-layer state of the stacked group
stacked [G, ...] like its parameters (under "stacked", ``k3jax.train.optim``). A state leaf is matched to its
parameter by the longest suffix of its key path that is a parameter path and gets that parameter's logical axes. A
moment Muon keeps in a reshaped view (kv_b [R, N, 2·X] → [R, N, 2, X]) keeps the axes of the dimensions the view
leaves unchanged. Leaves that match no parameter (step counts, Newton–Schulz coefficients; per layer under
"stacked") are tiny and replicated; a larger leaf that matches nothing is an error, so nothing the rules shard is
replicated silently.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.pytree import key_names, path_str
from k3jax.sharding.mesh import MESH_AXES, axis_sizes, mesh_shape
from k3jax.sharding.rules import STRATEGIES, get_rules, logical_to_spec, mesh_axes_of, param_specs


def parse_mesh(s: str) -> dict[str, int]:
    """``"data=2,expert=4"`` → all four axis sizes (missing ones 1). Errors name the offending part."""
    shape: dict[str, int] = {}
    for part in s.split(","):
        k, eq, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not k or not v.isdigit():
            raise ValueError(f"--mesh {s!r}: expected axis=size pairs over {', '.join(MESH_AXES)} "
                             f"(e.g. data=2,expert=4), got {part!r}")
        if k in shape:
            raise ValueError(f"--mesh {s!r}: axis {k!r} given twice")
        shape[k] = int(v)
    try:
        return mesh_shape(shape)
    except ValueError as e:
        raise ValueError(f"--mesh {s!r}: {e}") from None


def format_mesh(sizes) -> str:
    """The axes of size > 1, as ``data=2,expert=4`` (``data=1`` for a one-device mesh)."""
    parts = [f"{a}={n}" for a, n in axis_sizes(sizes).items() if n > 1]
    return ",".join(parts) or "data=1"


def default_strategy(sizes) -> str:
    """The rules column a mesh's axes imply (../shared/CLI.md: data+expert → ``ep``): fsdp together with expert or
    tensor → ``fsdp_ep_tp``; tensor → ``ep_tp``; expert → ``ep``; otherwise ``fsdp`` (on a data-only mesh that is
    plain data parallelism: the fsdp axis has size 1, so parameters replicate and batches split over data)."""
    s = axis_sizes(sizes)
    if s["fsdp"] > 1 and (s["expert"] > 1 or s["tensor"] > 1):
        return "fsdp_ep_tp"
    if s["tensor"] > 1:
        return "ep_tp"
    if s["expert"] > 1:
        return "ep"
    return "fsdp"


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy {strategy!r}: unknown; known: {', '.join(STRATEGIES)}")
    return strategy


def token_axes(strategy: str, mesh) -> tuple[str, ...]:
    """Mesh axes (size > 1) the batch is split over under ``strategy``."""
    return mesh_axes_of("batch", strategy, mesh)


def token_parallel(strategy: str, mesh) -> int:
    """How many ways the batch is split (the product of ``token_axes``)."""
    sizes = axis_sizes(mesh)
    return math.prod(sizes[a] for a in token_axes(strategy, mesh))


def batch_sharding(strategy: str, mesh, ndim: int, batch_dim: int = 0) -> NamedSharding:
    """The sharding of an [..., b, ...] token array whose dimension ``batch_dim`` is the batch."""
    axes = token_axes(strategy, mesh)
    spec = [None] * ndim
    spec[batch_dim] = axes[0] if len(axes) == 1 else (axes or None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def expert_dispatch(strategy: str, mesh):
    """The expert-parallel MoE dispatch when ``strategy`` shards the expert stacks over a mesh axis of size > 1,
    else None (the MoE layer's local dispatch)."""
    if not mesh_axes_of("experts", strategy, mesh):
        return None
    from k3jax.sharding.expert_parallel import ExpertParallel

    return ExpertParallel(mesh, strategy)


def _slice_table(cfg, params) -> dict:
    """{key names: (logical axes, shape)} for every parameter."""
    from k3jax.model import param_axes

    axes = param_axes(cfg)
    table = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = key_names(path)
        logical = axes
        for k in names:
            logical = logical[k]
        logical, shape = tuple(logical), tuple(x.shape)
        table[names] = (logical, shape)
    return table


def _match(table: dict, names: tuple):
    for i in range(len(names)):
        hit = table.get(names[i:])
        if hit is not None:
            return hit
    return None


# Optimizer state that is no parameter's moment (step counts, Muon's Newton–Schulz coefficients [ns_steps?, 3]) is
# tiny and replicated; anything larger that matches no parameter is an error rather than a silent replica.
_HYPER_STATE_MAX = 64


def opt_specs(cfg, strategy: str, mesh, opt_shapes, params):
    """PartitionSpec per leaf of an optimizer state (see the module docstring)."""
    get_rules(strategy)
    table = _slice_table(cfg, params)

    def one(path, x):
        shape = tuple(x.shape)
        hit = _match(table, key_names(path))
        if hit is None:
            # the optimizer's per-layer state of the stacked group ("stacked", k3jax/train/optim.py) is [G, ...]
            per_layer = shape[1:] if key_names(path)[:1] == ("stacked",) else shape
            if math.prod(per_layer) <= _HYPER_STATE_MAX:
                return PartitionSpec()
            raise ValueError(f"optimizer state leaf {path_str(path)} {shape} matches no parameter; its sharding "
                             "is unknown")
        logical, pshape = hit
        if shape != pshape:
            if math.prod(shape) != math.prod(pshape):
                raise ValueError(f"optimizer state leaf {path_str(path)} {shape} does not view parameter shape "
                                 f"{pshape}")
            same = 0
            while same < min(len(shape), len(pshape)) and shape[same] == pshape[same]:
                same += 1
            logical = logical[:same] + (None,) * (len(shape) - same)
        return logical_to_spec(logical, shape, strategy, mesh, name=path_str(path))

    return jax.tree_util.tree_map_with_path(one, opt_shapes)


def state_shardings(cfg, strategy: str, mesh: jax.sharding.Mesh, state_shapes) -> dict:
    """NamedSharding per leaf of a train state {"params", "opt", "step", "rng", "bad_streak"} (shapes or arrays)."""
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
    p_specs = param_specs(cfg, strategy, mesh, state_shapes["params"])
    o_specs = opt_specs(cfg, strategy, mesh, state_shapes["opt"], state_shapes["params"])
    out = {k: jax.tree.map(lambda _: named(PartitionSpec()), v) for k, v in state_shapes.items()
           if k not in ("params", "opt", "frozen")}
    out["params"] = jax.tree.map(named, p_specs, is_leaf=is_spec)
    if "frozen" in state_shapes:  # packed routed experts (frozen-expert fine-tuning): placed like their float form
        out["frozen"] = jax.tree.map(named, param_specs(cfg, strategy, mesh, state_shapes["frozen"]), is_leaf=is_spec)
    out["opt"] = jax.tree.map(named, o_specs, is_leaf=is_spec)
    return out


def packed_form(params):
    """The tree with every routed-expert stack w1 / w3 / w2 [..., in, out] replaced by its packed MXFP4 leaves
    ``w*_packed`` [..., out, in/2] and ``w*_scale`` [..., out, in/32] (uint8 ShapeDtypeStructs; the form
    ``load(..., keep_experts_packed=True)`` returns and ``k3jax.layers.moe.Experts.to_packed`` runs)."""
    def walk(node, name):
        if not isinstance(node, dict):
            return node
        if name == "experts" and "w1" in node:
            out = {}
            for k, x in node.items():
                *lead, n_in, n_out = x.shape
                out[f"{k}_packed"] = jax.ShapeDtypeStruct((*lead, n_out, n_in // 2), np.uint8)
                out[f"{k}_scale"] = jax.ShapeDtypeStruct((*lead, n_out, n_in // 32), np.uint8)
            return out
        return {k: walk(v, k) for k, v in node.items()}

    return walk(params, None)


def split_packed(params) -> tuple[dict, dict]:
    """(everything else, only the packed expert leaves) of a params tree; ``merge_trees`` puts them back."""
    def walk(node):
        if not isinstance(node, dict):
            return node, None
        rest, packed = {}, {}
        for k, v in node.items():
            if isinstance(k, str) and k.endswith(("_packed", "_scale")):
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


def bytes_per_device(tree) -> int:
    """The largest per-device total of addressable bytes over the arrays of ``tree`` (measured from the placed
    shards, not from the specs)."""
    per: collections.Counter = collections.Counter()
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            per[s.device] += int(np.prod(s.data.shape)) * a.dtype.itemsize
    return max(per.values()) if per else 0


__all__ = ["batch_sharding", "bytes_per_device", "check_strategy", "default_strategy", "expert_dispatch",
           "format_mesh", "merge_trees", "opt_specs", "packed_form", "parse_mesh", "split_packed", "state_shardings",
           "token_axes", "token_parallel"]
