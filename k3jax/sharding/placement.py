"""Placing a whole train state on a mesh from the rules table (docs/numerics.md §14): parameters, optimizer state and
batches.

    sizes = parse_mesh("data=2,expert=4")                     # {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    strategy = default_strategy(sizes)                        # "ep"
    sh = state_shardings(cfg, strategy, mesh, jax.eval_shape(init, params))   # NamedSharding per state leaf
    dispatch = expert_dispatch(strategy, mesh)                 # ExpertParallel, or None when experts are not sharded

Optimizer state: optax keeps per-parameter moments (Muon momentum, AdamW mu / nu) in trees that mirror the
parameters, nested under its own containers; k3jax's optimizer keeps the per-layer state of the stacked group
stacked [G, ...] like its parameters (under "stacked", ``k3jax.optim.optimizer``). A state leaf is matched to its
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

from k3jax.errors import InputError
from k3jax.layers.lora import has_adapters, is_adapter
from k3jax.model import param_axes
from k3jax.model.cache import cache_leaf_axes
from k3jax.pytree import key_names, path_str
from k3jax.sharding.context_parallel import ContextParallel
from k3jax.sharding.expert_parallel import ExpertParallel
from k3jax.sharding.mesh import MESH_AXES, axis_sizes, mesh_shape
from k3jax.sharding.row_split import latent_cache_rows
from k3jax.sharding.rules import STRATEGIES, get_rules, leaf_axes, logical_to_spec, mesh_axes_of, param_specs


def parse_mesh(s: str) -> dict[str, int]:
    """``"data=2,expert=4"`` → all four axis sizes (missing ones 1). Errors name the offending part."""
    shape: dict[str, int] = {}
    for part in s.split(","):
        k, eq, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not k or not v.isdigit():
            raise InputError(f"--mesh {s!r}: expected axis=size pairs over {', '.join(MESH_AXES)} "
                             f"(e.g. data=2,expert=4), got {part!r}")
        if k in shape:
            raise InputError(f"--mesh {s!r}: axis {k!r} given twice")
        shape[k] = int(v)
    try:
        return mesh_shape(shape)
    except InputError as e:
        raise InputError(f"--mesh {s!r}: {e}") from None


def resolve_mesh(spec: str, *, devices: int, exact: bool = False, where: str = "", strategy: str | None = None,
                 cfg=None, params=None, axes: tuple[str, ...] | None = None) -> tuple[dict[str, int], str]:
    """(axis sizes, strategy) of a ``--mesh`` string after every check a command makes before it compiles: the
    syntax (``parse_mesh``), the axes the command allows (``axes``, e.g. ``("data",)``), the device count (exactly
    ``devices`` with ``exact`` — ``where`` names what has them, e.g. ``"--target cpu:8"`` —, else at most
    ``devices``), the strategy (default from the axes, ``default_strategy``) and, given ``cfg``, that every parameter
    dimension the rules shard divides by its mesh axes (``params``: the tree to check, default the config's own).
    The one place a mesh string is read: ``k3 train``, ``k3 plan --compile`` and ``k3 route`` call it."""
    sizes = parse_mesh(spec)
    if axes is not None:
        other = sorted(a for a, n in sizes.items() if a not in axes and n > 1)
        if other:
            raise InputError(f"--mesh {spec}: this command splits over {', '.join(axes)} only, got axes {other}")
    n = math.prod(sizes.values())
    if exact and n != devices:
        raise InputError(f"--mesh {spec}: {n} devices, but {where or 'the target'} has {devices}")
    if not exact and n > devices:
        raise InputError(f"--mesh {spec}: needs {n} devices, {devices} available{_devices_note()}")
    strategy = check_strategy(strategy or default_strategy(sizes))
    if sizes["context"] > 1 and not uses_context(strategy, sizes):
        raise InputError(f"--mesh {spec}: strategy {strategy} does not split sequences, so the context axis (size "
                         f"{sizes['context']}) would only repeat the work; use a strategy whose rules map seq to "
                         f"context ({', '.join(s for s in STRATEGIES if s != 'single')})")
    if cfg is not None:
        try:
            param_specs(cfg, strategy, sizes, params)  # names the parameter, dimension and axes that do not divide
        except InputError as e:
            raise InputError(f"--mesh {spec} (strategy {strategy}): {e}") from None
    return sizes, strategy


def _devices_note() -> str:
    """What the devices of a too-small mesh are: the platform, and on the CPU who fixed their count (`k3` starts as
    many simulated CPU devices as a --mesh needs unless XLA_FLAGS or JAX_NUM_CPU_DEVICES chose the count)."""
    import os

    platform = jax.default_backend()
    if platform != "cpu":
        return f" ({platform})"
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return " (simulated CPU devices: XLA_FLAGS' --xla_force_host_platform_device_count sets their number)"
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return " (simulated CPU devices: JAX_NUM_CPU_DEVICES sets their number)"
    return " (cpu)"


def format_mesh(sizes) -> str:
    """The axes of size > 1, as ``data=2,expert=4`` (``data=1`` for a one-device mesh)."""
    parts = [f"{a}={n}" for a, n in axis_sizes(sizes).items() if n > 1]
    return ",".join(parts) or "data=1"


def default_strategy(sizes) -> str:
    """The rules column a mesh's axes imply (docs/cli.md: data+expert → ``ep``): fsdp together with expert or
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
        raise InputError(f"--strategy {strategy!r}: unknown; known: {', '.join(STRATEGIES)}")
    return strategy


def token_axes(strategy: str, mesh) -> tuple[str, ...]:
    """Mesh axes (size > 1) the batch is split over under ``strategy``."""
    return mesh_axes_of("batch", strategy, mesh)


def token_parallel(strategy: str, mesh) -> int:
    """How many ways the batch is split (the product of ``token_axes``)."""
    sizes = axis_sizes(mesh)
    return math.prod(sizes[a] for a in token_axes(strategy, mesh))


def small_batch(strategy: str, mesh, batch: int, flag: str = "--batch") -> bool:
    """The small-batch rule: a batch smaller than the ways the token axes split it (one sequence decoded on 64
    chips) is replicated over them instead of split — every device holds every row and its cache, and the MoE runs
    each device's local experts on all rows, then sums over the expert axis (``ExpertParallel(replicate_tokens=
    True)``). True when the rule applies, False when the batch divides; InputError naming ``flag`` when it neither
    divides nor is smaller."""
    ways = token_parallel(strategy, mesh)
    if batch % ways == 0:
        return False
    if batch < ways:
        return True
    raise InputError(f"{flag} {batch}: not divisible by the {ways} ways the batch is split (mesh axes "
                     f"{', '.join(token_axes(strategy, mesh))}), and not smaller than them (the small-batch rule "
                     "replicates a batch of fewer rows than that)")


def whole_rows(strategy: str, mesh, batch: int, flag: str = "--batch") -> bool:
    """Whether a decode / verify step holds every row on every device: the small-batch rule (``small_batch``), or
    the ``serve`` column at any batch. serve splits the model width over the token axis, so rows split over it as
    well would move activations and weights around every projection (kimi-k3 at B = 64 on v5p-64: 221.6 ms per step
    compiled; experiments/LOG.md, 2026-12-06); with the rows whole its projections reduce partial sums of [B, ·]
    activations instead. Where the batch divides, the caches keep their rows split over the token axes and the
    attention runs per row shard (``ExpertParallel(cache_rows=True)``, ``RowSplit.enter`` / ``leave``).
    InputError as ``small_batch``."""
    return small_batch(strategy, mesh, batch, flag) or strategy == "serve"


def batch_sharding(strategy: str, mesh, ndim: int, batch_dim: int = 0, replicated: bool = False) -> NamedSharding:
    """The sharding of an [..., b, ...] token array whose dimension ``batch_dim`` is the batch (``replicated``: the
    small-batch rule's, every row on every device)."""
    axes = () if replicated else token_axes(strategy, mesh)
    spec = [None] * ndim
    spec[batch_dim] = axes[0] if len(axes) == 1 else (axes or None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def uses_context(strategy: str, mesh) -> bool:
    """True when the mesh splits sequences (a ``context`` axis of size > 1 that ``strategy`` maps ``seq`` to)."""
    return bool(mesh_axes_of("seq", strategy, mesh))


def expert_dispatch(strategy: str, mesh, *, batch: int | None = None, **kw):
    """What a model call on ``mesh`` takes as ``dispatch``: the expert-parallel MoE dispatch when ``strategy``
    shards the expert stacks over a mesh axis of size > 1 — built around the context-parallel split of ``batch``
    rows when the mesh has a context axis (k3jax/sharding/context_parallel.py) —, that split alone when the experts
    are not sharded, else None (the MoE layer's local dispatch). ``kw``: ``ExpertParallel``'s settings (the
    context split's own MoE takes them too)."""
    context = None
    if uses_context(strategy, mesh):
        if batch is None:
            raise ValueError("a mesh with a context axis needs the batch size to place the sequence")

        context = ContextParallel(mesh, strategy, batch=batch, **kw)
    if not mesh_axes_of("experts", strategy, mesh):
        return context

    return ExpertParallel(mesh, strategy, context=context, **kw)


def kernel_rows(strategy: str, mesh, batch: int) -> bool:
    """Whether a model call on ``mesh`` over ``batch`` rows holds whole sequences on each device under a row split
    its ``expert_dispatch`` carries (``ExpertParallel.rows``: no context axis, the batch divides the token axes, the
    experts sharded), so the MLA kernels can run per device (k3jax/sharding/row_split.py) — a cached call's caches
    are split by the same rows (``cache_shardings``)."""
    return (not uses_context(strategy, mesh) and bool(mesh_axes_of("experts", strategy, mesh))
            and bool(token_axes(strategy, mesh)) and batch % token_parallel(strategy, mesh) == 0)


def cache_rules(strategy: str, context=None):
    """The rules a cache is placed by: ``strategy``'s, with a ``ContextParallel``'s split of its rows ("batch")
    and positions ("seq") when given."""
    if context is None:
        return strategy
    return {**get_rules(strategy), "batch": context.batch_axes, "seq": context.seq_axes}


LATENT_CACHE = ("c_kv", "k_rope")  # the MLA latent cache's leaves: read by every head


def cache_leaf_rules(strategy: str, mesh, rules, names: tuple, logical: tuple, shape: tuple, fixed: bool):
    """The rules one cache leaf is placed by: ``rules`` (``cache_rules``), except that the MLA latent's rows take
    ``row_split.latent_cache_rows`` (the heads' axis too, where the batch divides) unless the rows are ``fixed`` (the
    small-batch rule, a context split). The one home of that choice for ``cache_shardings`` and the plans' cache
    bytes (``plan.estimate.cache_bytes``)."""
    if names[-1] not in LATENT_CACHE or fixed:
        return rules
    heads = latent_cache_rows(mesh, token_axes(strategy, mesh), mesh_axes_of("heads", strategy, mesh),
                              shape[logical.index("batch")])
    return {**get_rules(rules), "batch": heads}


def cache_shardings(strategy: str, mesh, shapes, replicated: bool = False, context=None):
    """NamedSharding per leaf of an inference cache (``k3jax.model.cache.cache_shapes``, either layout) from the
    cache's logical axes (``cache.CACHE_AXES``) under the rules: rows over the token axes (``replicated``: the
    small-batch rule, on every device), the latent cache's positions over ``context``, the KDA state and conv tails
    over the heads' axes; a mesh axis the rows already took is not reused. The latent cache's rows take the heads'
    axis too where the batch divides (``row_split.latent_cache_rows``: the latent is read once, not once per head
    shard). ``context``: a ``ContextParallel`` whose
    split places the rows (its batch axes) and the positions (its sequence axes: a context-parallel prefill)."""
    rules = cache_rules(strategy, context)

    def one(path, x):
        names = key_names(path)
        logical = cache_leaf_axes(names, x.ndim)
        if replicated:
            logical = tuple(None if a == "batch" else a for a in logical)
        leaf_rules = cache_leaf_rules(strategy, mesh, rules, names, logical, x.shape, replicated or context is not None)
        return NamedSharding(mesh, logical_to_spec(logical, x.shape, leaf_rules, mesh, name=path_str(path)))

    return jax.tree_util.tree_map_with_path(one, shapes)


def _slice_table(cfg, params) -> dict:
    """{key names: (logical axes, shape)} for every parameter."""
    axes = param_axes(cfg, adapters=has_adapters(params))
    table = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = key_names(path)
        logical, shape = leaf_axes(axes, names, x.ndim), tuple(x.shape)
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
            # the optimizer's per-layer state of the stacked group ("stacked", k3jax/optim/optimizer.py) is [G, ...]
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
        return logical_to_spec(logical, shape, strategy, mesh, name=path_str(path),
                               lenient=any(is_adapter(k) for k in key_names(path)))   # as its adapter is placed

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


def bytes_per_device(tree) -> int:
    """The largest per-device total of addressable bytes over the arrays of ``tree`` (measured from the placed
    shards, not from the specs)."""
    per: collections.Counter = collections.Counter()
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            per[s.device] += int(np.prod(s.data.shape)) * a.dtype.itemsize
    return max(per.values()) if per else 0


__all__ = ["batch_sharding", "bytes_per_device", "cache_rules", "cache_shardings", "check_strategy",
           "default_strategy", "expert_dispatch", "format_mesh", "kernel_rows", "opt_specs", "parse_mesh",
           "resolve_mesh", "small_batch", "state_shardings", "token_axes", "token_parallel", "uses_context",
           "whole_rows"]
