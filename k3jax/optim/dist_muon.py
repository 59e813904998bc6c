"""Owner-compute Muon on a mesh: every orthogonalized block — one head's, one expert's, one layer's
matrix — is orthogonalized whole on one device, and the results return to the parameter's sharding.

    tx = owner_muon(dims_fn, lr, ..., mesh=mesh, specs=specs)   # the Muon group of optim.optimizer.make_optimizer
    r = route(shape, dims, spec, sizes); pool_plan([(r, dtype), ...], sizes)   # where blocks go, what each costs

How (one ``shard_map`` over the whole mesh, explicit collectives): the Muon leaves' momentum is updated where it
lives (elementwise, sharded like the parameter). Each leaf's local shard is cut into [a, b] blocks (a ≤ b) —
transposed to (batch dims, short side, long side): a tall block enters transposed, which is exact (optax's
Newton–Schulz orthogonalizes a tall matrix through its transpose) and lets an MLP's down projection travel with its
up projections; the batch dims (layer stack, experts, heads) flattened — and every mesh axis that splits a block's
matrix dims is undone by a tiled all-to-all that trades it for the block axis (MaxText's move; ``Route``), leaves
of one block shape and sharding travelling together so that their blocks, not each leaf's, are padded to the
all-to-all's ways. Then every device holds whole blocks. Blocks of one shape and dtype are pooled across leaves and
layers; the devices that hold the same blocks (the mesh axes a leaf's sharding leaves unnamed) split the pool among
themselves, padding it with zero blocks (a zero block stays zero). optax's Newton–Schulz runs batched over each
device's share (named scope ``NS_SCOPE``: the planner's ``flops.newton_schulz_compiled``), an all-gather returns
the shares, and the inverse all-to-alls put every block back in its leaf's shard.

Why (measured, experiments/LOG.md 2026-12-05): with the blocks left where the parameter rules put them (FSDP splits
a matrix's rows; the shared experts are whole matrices), XLA computes X·Xᵀ in pieces, all-reduces it and squares A
whole on every device — the v6e-256 frozen plan spent 58% of each chip's FLOPs in Newton–Schulz, ~30× its ideal
split. torchtitan and Megatron give each block one owner; pooling by shape is what lets the 276 shared-expert
blocks of 92 layers spread over 256 chips at all (a stacked leaf holds 23). A zero block costs a whole block, so a
pool of P blocks held by g devices costs each ceil(P / g) blocks: ``pool_plan``, which the planner's
``newton_schulz_split`` counts, padding included. An earlier cut of this module pooled with
``with_sharding_constraint`` and let XLA move the blocks: XLA:CPU's partitioner replicated every pool to slice it
back ("involuntary full rematerialization"); a second all-gathered the matrix dims of leaves with few blocks, which
at full size held whole pools on every chip (v6e-256 frozen plan: 244 GB of temporaries).

Numerics: a block's Newton–Schulz is the same arithmetic in a pool as alone, but a batched dot is not the sliced one
bit for bit: three k3-mini steps on 8 devices differ from the one-device per-layer optimizer by ≤ 2.3e-6 relative in
float32, 4e-15 in float64 (tests/optim/test_dist_muon.py). Off a mesh (``mesh`` None) the pools run on one device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers as MDN  # noqa: N817

# optax 0.2.8 (the newest release) exports muon and scale_by_muon but not the two pieces they chain; these are the
# functions optax.contrib.muon itself calls, so the owner layout runs optax's arithmetic, not a copy of it
from optax.contrib._muon import orthogonalize_via_newton_schulz, scale_by_shape

from k3jax.errors import InputError

NS_SCOPE = "muon_newton_schulz"  # Muon's Newton–Schulz, either layout (k3 plan: flops.newton_schulz_compiled)
OPTIMIZER_SCOPE = "optimizer_update"  # the whole optimizer update (k3 plan: the optimizer's collectives)
LAYOUTS = ("layer", "owner")
# A stacked Muon leaf whose shard on one device is larger than this is updated one layer group at a time
# (``loops``): a whole-stack update holds several leaf-sized transients at once — the momentum estimate, the blocks
# at their owners, Newton–Schulz's X·Xᵀ over every block, the results on their way back — and at full K3 the routed
# experts' stacks are 21.3 GB per v5p-512 chip (experiments/LOG.md, 2026-12-05 session 18).
LOOP_BYTES = 1 << 30


def _axes(a) -> tuple[int, ...]:
    return (a,) if isinstance(a, int) else tuple(a)


@dataclass(frozen=True)
class BlockView:
    """How one Muon leaf (or view) of ``shape`` is cut into ``count`` blocks of [m, n] (reduction × output)."""
    perm: tuple[int, ...]  # transpose to (batch..., reduction..., output...)
    count: int
    m: int
    n: int

    @property
    def key(self) -> tuple[int, int]:  # the pool: blocks enter as [min, max]
        return (min(self.m, self.n), max(self.m, self.n))


def block_view(shape: tuple, dims: MDN) -> BlockView:
    nd = len(shape)
    red = tuple(a % nd for a in _axes(dims.reduction_axis))
    out = tuple(a % nd for a in _axes(dims.output_axis))
    batch = tuple(a for a in range(nd) if a not in red and a not in out)
    return BlockView(batch + red + out, math.prod(shape[a] for a in batch), math.prod(shape[a] for a in red),
                     math.prod(shape[a] for a in out))


def to_blocks(x, view: BlockView):
    """[count, a, b] (a ≤ b) blocks of ``x``."""
    b = x.transpose(view.perm).reshape(view.count, view.m, view.n)
    return b.swapaxes(1, 2) if view.m > view.n else b


def from_blocks(b, view: BlockView, shape: tuple):
    if view.m > view.n:
        b = b.swapaxes(1, 2)
    inv = tuple(sorted(range(len(shape)), key=lambda i: view.perm[i]))
    return b.reshape(tuple(shape[a] for a in view.perm)).transpose(inv)


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclass(frozen=True)
class Route:
    """How one leaf's blocks reach their owners on a mesh (sizes: {axis: size}; axes of size 1 play no part).

    The leaf's local shard is transposed by ``perm`` to (batch..., short side..., long side...) — (reduction, output)
    or, for a tall block, (output, reduction): every block enters as [a, b] with a ≤ b, so a matrix and one shaped
    like its transpose (an MLP's down and up projections) travel and pool together — with its batch dims flattened:
    ``local`` blocks, each of local matrix dims ``mat`` (split by the mesh axes in ``moves``: (matrix dim, axis),
    minor axis first). Leaves alike in (block shape, dtype, ``mat``, ``moves``) travel together (``group``): their
    local blocks are concatenated, padded to a multiple of ``ways`` and moved by one tiled all-to-all per axis of
    ``moves``, which splits the blocks and gathers that dim — so each device then holds ceil(Σ local / ways) whole
    blocks. ``replicated``: the mesh axes (mesh order) the leaf's sharding does not name, along which devices hold
    the same blocks and split them in the pool."""
    view: BlockView
    perm: tuple[int, ...]
    local: int
    mat: tuple[int, ...]
    moves: tuple[tuple[int, str], ...]
    ways: int
    replicated: tuple[str, ...]


def route(shape: tuple, dims: MDN, spec, sizes: dict) -> Route:
    """The leaf's ``Route`` under PartitionSpec ``spec`` on a mesh of ``sizes``."""
    v = block_view(shape, dims)
    nr, no = len(_axes(dims.reduction_axis)), len(_axes(dims.output_axis))
    nb = len(v.perm) - nr - no
    perm = v.perm if v.m <= v.n else v.perm[:nb] + v.perm[nb + nr:] + v.perm[nb:nb + nr]  # short side first
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    used = {a for e in entries for a in _spec_axes(e)}
    axes_of = [tuple(a for a in _spec_axes(entries[d]) if sizes.get(a, 1) > 1) for d in perm]
    split = [shape[d] // math.prod(sizes[a] for a in axes_of[i]) for i, d in enumerate(perm)]
    moves = tuple((1 + j, a) for j, ax in enumerate(axes_of[nb:]) for a in reversed(ax))
    replicated = tuple(a for a, n in sizes.items() if n > 1 and a not in used)
    return Route(v, perm, math.prod(split[:nb]), tuple(split[nb:]), moves, math.prod(sizes[a] for _, a in moves),
                 replicated)


def view_spec(spec, shape: tuple, view: tuple, name: str) -> PartitionSpec:
    """The PartitionSpec of a view of a leaf (``view``: its shape, e.g. kv_b [.., 2·X] seen as [.., 2, X]): the
    leading dims the view keeps keep their axes; a dim the view splits or merges must be unsharded."""
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    same = 0
    while same < min(len(shape), len(view)) and shape[same] == view[same]:
        same += 1
    bad = [(d, e) for d, e in enumerate(entries) if d >= same and e is not None]
    if bad:
        d, e = bad[0]
        raise InputError(f"{name}: the owner-compute Muon splits dim {d} (size {shape[d]}) into its blocks, but the "
                         f"mesh shards it over {e}: no device group holds its blocks whole (use --muon-layout layer "
                         "or a mesh that does not shard that dim)")
    return PartitionSpec(*entries[:same], *(None,) * (len(view) - same))


def loops(shape: tuple, dtype, spec, sizes: dict, stacked: bool) -> bool:
    """Whether a Muon leaf is updated one layer group at a time (a stacked leaf, its layer axis unsharded, more than
    ``LOOP_BYTES`` per device). Its blocks then pool per group: blocks of other leaves' groups alike do not share
    a pool with them, which adds padding where a group's blocks are fewer than their devices — hence only the big
    stacks (at full K3, the routed experts: 10,752 blocks per group over 512 chips, 21 each, no padding)."""
    entries = tuple(spec)
    if not stacked or (entries and entries[0] is not None):
        return False
    shards = math.prod(sizes.get(a, 1) for e in entries for a in _spec_axes(e))
    return math.prod(shape) * jnp.dtype(dtype).itemsize / shards > LOOP_BYTES


def one_group(dims: MDN, spec) -> tuple[MDN, PartitionSpec]:
    """The dimension numbers and PartitionSpec of one layer group of a stacked leaf (its leading axis dropped)."""
    less = lambda a: a - 1 if a > 0 else a  # noqa: E731
    shift = lambda a: less(a) if isinstance(a, int) else tuple(less(x) for x in a)  # noqa: E731
    return MDN(shift(dims.reduction_axis), shift(dims.output_axis)), PartitionSpec(*tuple(spec)[1:])


def group_key(r: Route, dtype) -> tuple:
    """Leaves that travel together: the same block [a, b], dtype, local matrix dims, moves and replicated axes."""
    return (*r.view.key, jnp.dtype(dtype).name, r.mat, r.moves, r.replicated)


def _pool_of(group: tuple) -> tuple:
    a, b, dtype, _, _, replicated = group
    return (a, b, dtype, replicated)


def pool_key(r: Route, dtype) -> tuple:
    return (*r.view.key, jnp.dtype(dtype).name, r.replicated)


def pool_plan(routes: list[tuple[Route, object]], sizes: dict) -> dict:
    """{(a, b, dtype, replicated axes): {"blocks", "per_device"}} of the pools ``routes`` ((Route, dtype) per leaf)
    make: ``blocks`` each block once, ``per_device`` the blocks each device orthogonalizes, padding included (each
    travelling group's to its all-to-alls' ways, the pool's to its replicated devices)."""
    groups: dict = defaultdict(int)
    for r, dtype in routes:
        groups[(group_key(r, dtype), r.ways)] += r.local
    held: dict = defaultdict(int)
    out: dict = defaultdict(lambda: {"blocks": 0, "per_device": 0})
    for r, dtype in routes:
        out[pool_key(r, dtype)]["blocks"] += r.view.count
    for (g, ways), local in groups.items():
        held[_pool_of(g)] += -(-local // ways)
    for k, h in held.items():
        out[k]["per_device"] = -(-h // math.prod(sizes[a] for a in k[3]))
    return dict(out)


def _to_owners(shards: list, rs: list[Route]):
    """The local shards of one travelling group → its owned whole blocks [held, a, b] (inside shard_map)."""
    r = rs[0]
    x = jnp.concatenate([s.transpose(q.perm).reshape((q.local, *q.mat)) for s, q in zip(shards, rs)])
    total = x.shape[0]
    if -total % r.ways:
        x = jnp.concatenate([x, jnp.zeros((-total % r.ways, *r.mat), x.dtype)])
        # a barrier: where a whole chunk is padding, XLA:CPU's simplifier forwards that chunk's broadcast into the
        # all-to-all with a layout its HLO verifier then rejects ("all-to-all has operands with different shapes";
        # k3-mini, zero3_ep_tp on cpu:8)
        x = jax.lax.optimization_barrier(x)
    for dim, axis in r.moves:
        x = jax.lax.all_to_all(x, axis, 0, dim, tiled=True)
    return x.reshape(x.shape[0], *r.view.key)


def _from_owners(b, shards: list, rs: list[Route], sizes: dict) -> list:
    """Inverse of ``_to_owners``: owned blocks back to each leaf's local shard."""
    r = rs[0]
    mat = list(r.mat)
    for dim, axis in r.moves:  # the matrix dims as the all-to-alls gathered them
        mat[dim - 1] *= sizes[axis]
    x = b.reshape(b.shape[0], *mat)
    for dim, axis in reversed(r.moves):
        x = jax.lax.all_to_all(x, axis, dim, 0, tiled=True)
    out, start = [], 0
    for s, q in zip(shards, rs):
        tshape = tuple(s.shape[d] for d in q.perm)
        inv = tuple(sorted(range(len(tshape)), key=lambda i: q.perm[i]))
        out.append(x[start:start + q.local].reshape(tshape).transpose(inv))
        start += q.local
    return out


def orthogonalize_pooled(xs: list, dims: list, ns_coeffs, ns_steps: int, eps: float, mesh=None,
                         specs: list | None = None) -> list:
    """optax's Newton–Schulz of every block of ``xs`` (leaves with their MuonDimensionNumbers), pooled by block shape;
    on ``mesh`` (with the leaves' PartitionSpecs ``specs``) each block is orthogonalized whole on one device
    (``Route``) and returned to its leaf's sharding; ``mesh`` None: everything on one device."""
    if mesh is None or all(n == 1 for n in mesh.shape.values()):
        return _pooled_here(xs, dims, ns_coeffs, ns_steps, eps)
    sizes = dict(mesh.shape)
    routes = [route(x.shape, d, sp, sizes) for x, d, sp in zip(xs, dims, specs)]

    def local(coeffs, *shards):
        groups: dict = defaultdict(list)
        for i, (x, r) in enumerate(zip(shards, routes)):
            groups[group_key(r, x.dtype)].append(i)
        pools: dict = defaultdict(list)  # pool key -> [(group members, its owned blocks)]
        for key, members in groups.items():
            owned = _to_owners([shards[i] for i in members], [routes[i] for i in members])
            pools[_pool_of(key)].append((members, owned))
        out = [None] * len(shards)
        for key, parts in pools.items():
            pool = jnp.concatenate([o for _, o in parts]) if len(parts) > 1 else parts[0][1]
            rep = key[3]
            group = math.prod(sizes[a] for a in rep)
            total = pool.shape[0]
            per = -(-total // group)
            if group > 1:  # the devices holding the same blocks split them
                if per * group > total:
                    pool = jnp.concatenate([pool, jnp.zeros((per * group - total, *pool.shape[1:]), pool.dtype)])
                idx = 0
                for a in rep:
                    idx = idx * sizes[a] + jax.lax.axis_index(a)
                pool = jax.lax.dynamic_slice_in_dim(pool, idx * per, per)
            with jax.named_scope(NS_SCOPE):
                pool = orthogonalize_via_newton_schulz(pool, coeffs, ns_steps, "frobenius", eps, MDN(1, 2))
            if group > 1:
                pool = jax.lax.all_gather(pool, rep, axis=0, tiled=True)[:total]
            start = 0
            for members, owned in parts:
                n = owned.shape[0]
                back = _from_owners(pool[start:start + n], [shards[i] for i in members],
                                    [routes[i] for i in members], sizes)
                for i, y in zip(members, back):
                    out[i] = y
                start += n
        return tuple(out)

    # check_vma off: a leaf's blocks come back to the devices of its replicated axes by an all_gather over them,
    # so they are the same there, as out_specs state; jax types an all_gather's result as varying (jax 0.12 has no
    # invariant all_gather), and the tests compare every leaf with the one-device optimizer
    fn = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), *specs), out_specs=tuple(specs), check_vma=False)
    return list(fn(ns_coeffs, *xs))


def _pooled_here(xs: list, dims: list, ns_coeffs, ns_steps: int, eps: float) -> list:
    """``orthogonalize_pooled`` on one device: the blocks of one shape and dtype in one batched Newton–Schulz."""
    pools: dict = defaultdict(list)
    views = [block_view(x.shape, d) for x, d in zip(xs, dims)]
    for i, x in enumerate(xs):
        pools[(views[i].key, jnp.dtype(x.dtype))].append(i)
    out = [None] * len(xs)
    for members in pools.values():
        parts = [to_blocks(xs[i], views[i]) for i in members]
        pool = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        with jax.named_scope(NS_SCOPE):
            pool = orthogonalize_via_newton_schulz(pool, ns_coeffs, ns_steps, "frobenius", eps, MDN(1, 2))
        start = 0
        for i in members:
            n = views[i].count
            out[i] = from_blocks(pool[start:start + n], views[i], xs[i].shape)
            start += n
    return out


def scale_by_owner_muon(dims_fn, *, ns_steps: int, beta: float, nesterov: bool, mesh=None, specs=None,
                        stacked=None, eps: float = 1e-8) -> optax.GradientTransformation:
    """``optax.contrib.scale_by_muon`` (its state, momentum and Nesterov arithmetic, line for line) with the
    orthogonalization pooled over blocks and split over ``mesh`` (``orthogonalize_pooled``). ``dims_fn``: the
    leaves' MuonDimensionNumbers from the updates tree; ``specs``: their PartitionSpecs on ``mesh`` (a tree);
    ``stacked``: a tree of bools, True for a leaf whose leading axis is the layer stack. Such a leaf past
    ``LOOP_BYTES`` per device (``loops``) is updated one layer group at a time in a ``fori_loop`` that writes each
    group's result back into the incoming gradient and its momentum into the old momentum (in place): its
    transients are one group's, not the stack's."""
    base = optax.contrib.scale_by_muon(ns_steps=ns_steps, beta=beta, eps=eps, nesterov=nesterov,
                                       weight_dimension_numbers=dims_fn)

    def moments(g, m, count_inc):
        mu = optax.tree.update_moment(g, m, beta, 1)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
                                  optax.tree.bias_correction(g, beta, count_inc))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count_inc)
        return mu, mu_hat

    def update_fn(updates, state, params=None):
        del params
        count_inc = optax.safe_increment(state.count)
        gs, treedef = jax.tree.flatten(updates)
        ms = treedef.flatten_up_to(state.mu)
        dims = jax.tree.leaves(dims_fn(updates), is_leaf=lambda x: isinstance(x, MDN))
        sp = (jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)) if specs is not None
              else [PartitionSpec()] * len(gs))
        st = [False] * len(gs) if stacked is None else treedef.flatten_up_to(stacked)
        sizes = {} if mesh is None else dict(mesh.shape)
        looped = [i for i in range(len(gs)) if loops(gs[i].shape, gs[i].dtype, sp[i], sizes, st[i])]
        whole = [i for i in range(len(gs)) if i not in looped]
        out, mu = list(gs), list(ms)
        if whole:
            new, hat = moments([gs[i] for i in whole], [ms[i] for i in whole], count_inc)
            ortho = orthogonalize_pooled(hat, [dims[i] for i in whole], state.ns_coeffs, ns_steps, eps, mesh,
                                         None if specs is None else [sp[i] for i in whole])
            for k, i in enumerate(whole):
                out[i], mu[i] = ortho[k], new[k]
        if looped:
            one = [one_group(dims[i], sp[i]) for i in looped]

            def group(g, carry):
                us, vs = carry
                take = lambda x: jax.lax.dynamic_index_in_dim(x, g, 0, keepdims=False)  # noqa: E731
                new, hat = moments([take(u) for u in us], [take(v) for v in vs], count_inc)
                ortho = orthogonalize_pooled(hat, [d for d, _ in one], state.ns_coeffs, ns_steps, eps, mesh,
                                             None if specs is None else [p for _, p in one])
                put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), g, 0)  # noqa: E731
                return [put(u, o) for u, o in zip(us, ortho)], [put(v, n) for v, n in zip(vs, new)]

            G = gs[looped[0]].shape[0]
            us, vs = jax.lax.fori_loop(0, G, group, ([gs[i] for i in looped], [ms[i] for i in looped]))
            for k, i in enumerate(looped):
                out[i], mu[i] = us[k], vs[k]
        return (jax.tree.unflatten(treedef, out),
                state._replace(count=count_inc, mu=jax.tree.unflatten(treedef, mu)))

    return optax.GradientTransformation(base.init, update_fn)


def owner_muon(dims_fn, lr, *, ns_steps: int, beta: float, nesterov: bool, consistent_rms: float,
               weight_decay: float, mesh=None, specs=None, stacked=None) -> optax.GradientTransformation:
    """The Muon group as ``optax.contrib.muon`` chains it (Newton–Schulz, consistent-RMS scale, decoupled weight
    decay, learning rate), with ``scale_by_owner_muon`` for its first link."""
    return optax.chain(
        scale_by_owner_muon(dims_fn, ns_steps=ns_steps, beta=beta, nesterov=nesterov, mesh=mesh, specs=specs,
                            stacked=stacked),
        scale_by_shape(weight_dimension_numbers=dims_fn, consistent_rms=consistent_rms),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(lr))


__all__ = ["LAYOUTS", "LOOP_BYTES", "NS_SCOPE", "OPTIMIZER_SCOPE", "BlockView", "Route", "block_view", "from_blocks",
           "group_key", "loops", "one_group", "orthogonalize_pooled", "owner_muon", "pool_key", "pool_plan", "route",
           "scale_by_owner_muon", "to_blocks", "view_spec"]
