"""Expert-parallel MoE dispatch / combine with ``jax.shard_map`` (docs/model.md §7.2, docs/numerics.md §14.2).

    ep = ExpertParallel(mesh, "ep")                          # an experts_fn for the MoE layer
    logits = forward(params, tokens, cfg, dispatch=ep)       # tokens sharded over (data, fsdp, expert)
    y, dropped = ep.dispatch(z, ids, w, w1, w3, w2, act)     # the same, returning the dropped-assignment count

Per device (X = expert-axis size, El = E / X local experts, m local tokens, A = top-k, rows = m·A):
    1. route locally: the (token, slot) rows and their expert ids come in already routed
    2. sort rows by global expert id (⇒ by destination shard d = id // El); per-destination counts
    3. exchange: CPU — fixed buckets [X, C, P] + int bucket of local ids (pad = El), ``lax.all_to_all(tiled)``;
                 GPU/TPU — ``lax.ragged_all_to_all`` of the sorted rows (sizes exchanged with a tiny all_to_all)
    4. local experts: ``experts_sorted`` (sort by local id, ``lax.ragged_dot`` w1/w3 → GLU → w2); pad rows (id El)
       fall outside every group and come out zero; with tensor-sharded expert_mlp, psum over ``tensor``. Frozen
       MXFP4 experts (``PackedWeight`` stacks) run ``experts_packed`` instead (k3jax/ops/packed_experts.py): the
       Pallas grouped MXFP4 kernel when compiling for GPU/TPU (forward and the activation gradient; its outputs
       declare their varying mesh axes), the XLA loop for CPU (``packed_kernel``). Stacks with per-expert LoRA
       adapters (``LoraWeight``, over a float or packed base) run ``experts_lora`` (k3jax/ops/lora_experts.py)
       with the same kernel choice for a packed base; their LoRA dropout draws per device (``per_device_dropout``)
    5. send results back with the reverse exchange, un-sort, weighted sum over the A slots (acc dtype)

Small batches (``replicate_tokens=True``, the small-batch rule of ``placement.small_batch``: fewer rows than the
token axes' ways, e.g. one sequence decoded on 64 chips): every device holds every row, runs the slots routed to its
own experts (the others take the pad id) and one psum over the expert and tensor axes combines them (``_replicated``:
no exchange, no capacity, nothing dropped). ``cache_rows=True`` too (``placement.whole_rows``: serve's decode at a
batch that divides): the caches keep their rows split, ``rows`` a ``RowSplit`` with the stream whole.

Context parallelism (``context=``, k3jax/sharding/context_parallel.py): the [B·T] rows are split over the batch
axes and the sequence axes of the ``ContextParallel`` (a batch of one 1M-token sequence: T / devices rows per chip);
with an expert axis of size 1 (a ``ContextParallel``'s own MoE) each device runs every expert on its own rows.

The path is chosen with ``lax.platform_dependent(cpu=bucketed, default=ragged)`` (``impl="auto"``), or forced with
``impl="bucketed" | "ragged"``. XLA:CPU cannot run ragged_all_to_all: on CPU the bucketed path is tested for real and
the ragged path's offset bookkeeping against an all_to_all emulation of the primitive's documented semantics.

Bucket size C (rows one source shard may send one destination shard):
    worst case  C_max = m · min(A, El)     a token's A experts are distinct, so at most min(A, El) of its rows
                                           go to one shard; the receive buffer is X·C_max = min(X, E/A) × the
                                           balanced size m·A (docs/model.md §7.2: up to 56× for K3)
    capacity_factor = cf > 0: C = min(C_max, ceil(cf · m·A / X)); rows beyond C in a bucket are DROPPED (their
                                           expert output is 0) and counted.
    capacity_factor = -1 (default): C = C_max, dropless.
``dispatch`` returns the dropped-assignment count (summed over all devices); ``__call__`` (the experts_fn the MoE
layer calls) records it host-side in ``self.dropped`` (one int per executed call) through ``jax.debug.callback``
whenever drops are possible; ``check()`` raises if anything was dropped (the callback never raises: that aborts
the XLA:CPU process). Both paths keep the first C rows of each (source, destination) pair in sorted order. At full
K3 size the worst case does not fit: m = 4096, A = 16, El = 14 on expert = 64 gives X·C_max = 3.7 M rows per MoE
layer, 56x the balanced 65,536 (experiments/LOG.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from k3jax.config import PACKED_KERNELS
from k3jax.errors import InputError
from k3jax.layers import backends
from k3jax.ops.grouped_matmul import experts_sorted
from k3jax.ops.lora import LoraWeight, per_device_dropout
from k3jax.ops.lora_experts import experts_lora
from k3jax.ops.norms import acc_dtype
from k3jax.ops.packed_experts import PackedWeight, experts_packed, num_experts
from k3jax.sharding.mesh import axis_sizes
from k3jax.sharding.row_split import RowSplit
from k3jax.sharding.rules import mesh_axes_of

# The GPU/TPU exchange primitive. Module-level so a CPU test can substitute an all_to_all emulation of its
# documented semantics and check the offset bookkeeping of ``_ragged`` (XLA:CPU cannot run the real one).
_ragged_all_to_all = lax.ragged_all_to_all


def bucket_capacity(m_local: int, top_k: int, local_experts: int, n_shards: int, capacity_factor: float) -> int:
    """Rows per (source, destination) bucket; see the module docstring. ``capacity_factor=-1`` = worst case."""
    worst = m_local * min(top_k, local_experts)
    if capacity_factor == -1 or capacity_factor is None:
        return max(worst, 1)
    if capacity_factor <= 0:
        raise InputError(f"capacity_factor must be > 0 or -1 (worst case), got {capacity_factor}")
    return max(1, min(worst, math.ceil(capacity_factor * m_local * top_k / n_shards)))


def _excl_cumsum(x):
    return jnp.cumsum(x) - x


def _sort_rows(ids_ma, local_experts: int, n_shards: int):
    """Flattened rows sorted by global expert id: (flat ids, order, inverse, dest per row, per-dest counts)."""
    flat = ids_ma.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    dest = flat // local_experts
    counts = jnp.bincount(dest, length=n_shards).astype(jnp.int32)
    return flat, order, inverse, dest, counts


def _base(w):
    """The frozen stack of an expert stack: a ``LoraWeight``'s base, else the stack itself."""
    return w.base if isinstance(w, LoraWeight) else w


def _local_experts(x, local_ids, w1, w3, w2, act, act_quant, tensor_axes, kernels, weights=None, expected_load=None):
    """Run the local experts on rows x [R, P] with local ids [R] (or [R, A] slots combined by ``weights`` [R, A];
    pad id = El → zero output). The stacks are arrays, or ``PackedWeight`` pairs (frozen MXFP4 experts:
    k3jax/ops/packed_experts.py), run by the grouped MXFP4 kernels ``kernels`` = (grouped matmul, grouped GLU FFN)
    (``_packed_kernels``: forward and the activation gradient; the FFN kernel for plain packed stacks) or, when it
    is None, the XLA loop; any of them may be a ``LoraWeight`` (per-expert adapters over either base), and then all
    three run ``experts_lora`` (the grouped matmul for a packed base). x comes fake-quantized (``dispatch``
    quantizes the tokens before the exchange): ``act_quant`` runs on h only. ``expected_load`` ({"rows", "groups"}
    per call, ``backends.expected_load``) goes to the kernels' cost estimates (what XLA and ``k3 plan`` charge).

    The output is in the accumulation dtype, except on the kernel path over one slot per row without a tensor
    split: the kernel's outputs are already in the rows' dtype and neither the combine over one slot (× 1) nor the
    un-sort rounds them, so they are returned in that dtype — the same values, and the exchange that sends them back
    (and its transpose in the backward, whose cotangent the kernel rounds to the rows' dtype anyway) moves half the
    bytes of fp32 in bf16 runs (experiments/LOG.md, 2026-12-05 session 21)."""
    ids = local_ids[:, None] if local_ids.ndim == 1 else local_ids
    one_slot = weights is None and ids.shape[1] == 1
    if weights is None:
        weights = jnp.ones(ids.shape, acc_dtype(x.dtype))
    if kernels is not None and expected_load is not None:
        kernels = tuple(partial(k, expected_load=expected_load) for k in kernels)
    gmm, glu_ffn = kernels[:2] if kernels else (None, None)
    q = {"act_quant": act_quant, "quantized_input": True}  # x was fake-quantized before the exchange (dispatch)
    if any(isinstance(w, LoraWeight) for w in (w1, w3, w2)):
        out = experts_lora(x, ids, weights, w1, w3, w2, act, **q, gmm=gmm, impl="auto" if gmm is None else "grouped")
    elif isinstance(w1, PackedWeight):
        out = experts_packed(x, ids, weights, w1, w3, w2, act, **q, gmm=glu_ffn,
                             impl="tiles" if glu_ffn is None else "gmm")
        if glu_ffn is not None and one_slot and not tensor_axes:
            return out.astype(x.dtype)
    else:
        out = experts_sorted(x, ids, weights, w1, w3, w2, act, **q)
    return lax.psum(out, tensor_axes) if tensor_axes else out


def _varying(x, axes):
    """``x`` (invariant over ``axes`` inside shard_map) cast varying over them; its transpose is a psum."""
    if hasattr(lax, "pcast"):                                            # jax 0.12
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)                                            # jax 0.11


def _replicated(z, ids, wts, w1, w3, w2, *, act, act_quant, axis, n_shards, tensor_axes, kernels):
    """The small-batch rule (``placement.small_batch``): every device holds every token row; it runs the slots
    routed to its own experts (the others take the pad id: zero) and the shards' partial sums meet in one psum over
    the expert (and tensor) axes. No exchange and no capacity: nothing is dropped. Frozen MXFP4 experts run the
    small-batch routed FFN kernel where it applies (the token table on chip, no tile padding). Returns (y [m, P]
    acc, 0)."""
    El = num_experts(w1)  # a LoraWeight's first leaf is its base's: [E, ...]
    mine = ids // El == lax.axis_index(axis)
    local = jnp.where(mine, ids % El, El).astype(jnp.int32)
    # z and the gates come in replicated, but what each device computes from them varies with its experts (its own
    # sort order, its own weights): cast them varying over those axes, so that autodiff sums their cotangents over
    # the devices (the cast's transpose, a psum). Left invariant, the custom VJPs of the sorted path
    # (grouped_matmul.permute_rows) hand back one device's partial cotangent as the whole: dz was off (rel-RMS 1.4)
    z, wts = _varying(z, (axis, *tensor_axes)), _varying(wts, (axis, *tensor_axes))
    load = kernels and backends.expected_load(z.shape[0], ids.shape[1], El * n_shards, El)  # all m tokens here
    packed = kernels and all(isinstance(w, PackedWeight) for w in (w1, w3, w2))  # the table on chip: one kernel
    y = kernels[2](z, local, wts, w1, w3, w2, act, act_quant=act_quant, expected_load=load) if packed else None
    if y is None:
        y = _local_experts(z, local, w1, w3, w2, act, act_quant, (), kernels, weights=wts, expected_load=load)
    return lax.psum(y, (axis, *tensor_axes)), jnp.int32(0)


def _bucketed(z, ids, wts, w1, w3, w2, *, act, act_quant, axis, n_shards, capacity, tensor_axes, kernels):
    """CPU path: fixed-size buckets + all_to_all. Returns (y [m, P] acc, dropped int32 local count)."""
    m, A = ids.shape
    El = num_experts(w1)
    X, C = n_shards, capacity
    flat, order, inverse, dest, counts = _sort_rows(ids, El, X)
    starts = _excl_cumsum(counts)
    # slot (x, c) of the send buffer holds sorted row starts[x] + c when c < counts[x]
    c = jnp.arange(C, dtype=jnp.int32)
    valid = c[None, :] < counts[:, None]  # [X, C]
    row = order[jnp.where(valid, starts[:, None] + c[None, :], 0)]  # flat (token, slot) row per bucket slot
    send_x = jnp.where(valid[..., None], z[row // A], jnp.zeros((), z.dtype))  # [X, C, P]
    send_id = jnp.where(valid, flat[row] % El, El).astype(jnp.int32)
    recv_x = lax.all_to_all(send_x, axis, 0, 0, tiled=True)
    recv_id = lax.all_to_all(send_id, axis, 0, 0, tiled=True)
    load = kernels and backends.expected_load(m * X, A, El * X, El, X * C)  # m·X tokens sent, X·C rows received
    out = _local_experts(recv_x.reshape(X * C, -1), recv_id.reshape(-1), w1, w3, w2, act, act_quant, tensor_axes,
                         kernels, expected_load=load)
    back = lax.all_to_all(out.reshape(X, C, -1), axis, 0, 0, tiled=True)  # [X, C, P], slots as sent
    rank = jnp.arange(m * A, dtype=jnp.int32)[inverse] - starts[dest]  # position of each row in its bucket
    kept = rank < C
    acc = acc_dtype(z.dtype)
    y_rows = jnp.where(kept[:, None], back[dest, jnp.minimum(rank, C - 1)], jnp.zeros((), back.dtype)).astype(acc)
    y = jnp.einsum("map,ma->mp", y_rows.reshape(m, A, -1), wts.astype(acc))
    return y, jnp.sum(~kept).astype(jnp.int32)


def _ragged(z, ids, wts, w1, w3, w2, *, act, act_quant, axis, n_shards, capacity, tensor_axes, kernels):
    """GPU/TPU path: ragged_all_to_all of the sorted rows. Each source sends a destination at most ``capacity``
    rows (the first ones in sorted order, as the bucketed path keeps), so the receive buffer is X · capacity rows;
    at the worst-case capacity nothing is dropped. Returns (y [m, P] acc, dropped int32 local count)."""
    m, A = ids.shape
    El = num_experts(w1)
    X = n_shards
    flat, order, inverse, dest, counts = _sort_rows(ids, El, X)
    rows = z[order // A]  # [m·A, P] sorted by global expert (⇒ by destination)
    local_ids = (flat[order] % El).astype(jnp.int32)
    in_off = _excl_cumsum(counts)  # destination x's rows start here in the sorted array
    send_sizes = jnp.minimum(counts, capacity)  # rows past the capacity stay home (their output is 0)
    recv_sizes = lax.all_to_all(send_sizes, axis, 0, 0, tiled=True)  # recv_sizes[s] = rows source s sends me
    recv_off = _excl_cumsum(recv_sizes)
    out_off = lax.all_to_all(recv_off, axis, 0, 0, tiled=True)  # where my chunk lands in each peer's buffer
    R = X * capacity
    recv = _ragged_all_to_all(rows, jnp.zeros((R, rows.shape[1]), rows.dtype), in_off, send_sizes, out_off,
                                 recv_sizes, axis_name=axis)
    recv_id = _ragged_all_to_all(local_ids, jnp.full((R,), El, jnp.int32), in_off, send_sizes, out_off,
                                    recv_sizes, axis_name=axis)
    load = kernels and backends.expected_load(m * X, A, El * X, El, R)  # m·X tokens sent, R = X·capacity received
    out = _local_experts(recv, recv_id, w1, w3, w2, act, act_quant, tensor_axes, kernels, expected_load=load)
    back_off = lax.all_to_all(in_off, axis, 0, 0, tiled=True)  # where each source wants its rows back
    back = _ragged_all_to_all(out, jnp.zeros((m * A, out.shape[1]), out.dtype), recv_off, recv_sizes, back_off,
                                 send_sizes, axis_name=axis)
    acc = acc_dtype(z.dtype)
    y = jnp.einsum("map,ma->mp", back[inverse].reshape(m, A, -1).astype(acc), wts.astype(acc))
    return y, jnp.sum(counts - send_sizes).astype(jnp.int32)


def _packed_kernels(packed_kernel: str):
    """The grouped MXFP4 kernels the local packed experts run — (grouped matmul, grouped GLU FFN, the small-batch
    routed FFN: ``_replicated``'s, None where it does not apply) — or None for the XLA loop: "tiles" never;
    "pallas" always (for a CPU target the TPU schedule in the TPU interpreter: the code TPUs run, as tests run it);
    "auto" when compiling for a GPU or TPU."""
    target = backends.kernel_target()
    if packed_kernel == "tiles" or (packed_kernel == "auto" and target == "cpu"):
        return None
    platform = "tpu" if target == "cpu" else None
    return tuple(partial(k, platform=platform) for k in (backends.mxfp4_gmm, backends.mxfp4_glu_ffn,
                                                          backends.mxfp4_glu_ffn_rows))


class ExpertParallel:
    """An ``experts_fn`` for the MoE block (``MoE(...)(x, dispatch=...)``) that runs the routed experts
    expert-parallel on ``mesh``.

    Token rows are sharded over the mesh axes that ``rules`` maps "batch" to (minus ``tensor``); expert stacks over
    the axes of "experts" (one axis) and, when mapped, their hidden F over the axes of "expert_mlp". Frozen MXFP4
    stacks run on each device by ``packed_kernel`` (``_packed_kernels``): "auto" (the Pallas kernel when compiling for
    GPU/TPU, the XLA loop for CPU), "pallas" or "tiles".
    """

    def __init__(self, mesh: jax.sharding.Mesh, rules="ep", *, capacity_factor: float = -1.0, impl: str = "auto",
                 packed_kernel: str = "auto", replicate_tokens: bool = False, cache_rows: bool = False, context=None):
        if impl not in ("auto", "bucketed", "ragged"):
            raise ValueError(f"impl must be 'auto', 'bucketed' or 'ragged', got {impl!r}")
        if packed_kernel not in PACKED_KERNELS:
            raise ValueError(f"packed_kernel must be one of {PACKED_KERNELS}, got {packed_kernel!r}")
        self.mesh, self.impl, self.packed_kernel = mesh, impl, packed_kernel
        self.replicate_tokens = replicate_tokens
        self.capacity_factor = capacity_factor
        ex = mesh_axes_of("experts", rules, mesh)
        if len(ex) > 1:
            raise ValueError(f"expert parallelism needs 'experts' on one mesh axis, rules give {ex}")
        self.expert_axis = ex[0] if ex else "expert"
        self.tensor_axes = mesh_axes_of("expert_mlp", rules, mesh)
        self.token_axes = tuple(a for a in mesh_axes_of("batch", rules, mesh) if a not in self.tensor_axes)
        # context parallelism (k3jax/sharding/context_parallel.py): the [B·T] rows split as its batch x sequence
        self.context = context
        if context is not None:
            if replicate_tokens:
                raise ValueError("replicate_tokens (the small-batch rule) and context parallelism exclude each "
                                 "other: under context parallelism the sequence takes the token axes")
            self.token_axes = context.row_axes
        # the axes the rules split a float expert stack's width P over ("latent" — "embed" for the standard MoE: alike
        # less the expert and tensor axes): the stacks enter the shard_map split, all-gathered inside (_gather_width)
        self.width_axes = tuple(a for a in mesh_axes_of("latent", rules, mesh)
                                if a != self.expert_axis and a not in self.tensor_axes)
        if self.expert_axis in axis_sizes(mesh) and axis_sizes(mesh)[self.expert_axis] > 1 \
                and self.expert_axis not in self.token_axes:
            raise ValueError(f"rules must shard 'batch' over the expert axis {self.expert_axis!r} for EP "
                             f"(batch → {self.token_axes})")
        self.n_shards = axis_sizes(mesh).get(self.expert_axis, 1)
        self.n_token_shards = math.prod(axis_sizes(mesh)[a] for a in self.token_axes)
        # whole sequences per device (no context axis, the rows or the caches split): MLA's kernels run per device
        self.rows = None if context is not None or (replicate_tokens and not cache_rows) or not self.token_axes \
            else RowSplit(mesh, self.token_axes, mesh_axes_of("heads", rules, mesh), stream_whole=replicate_tokens)
        self.dropped: list[int] = []

    def constrain_tokens(self, x, batch_dim: int = 0):
        """``x`` with its batch dimension pinned to the token axes (the rest replicated), when it divides, or whole
        (``cache_rows``); the model calls this on its residual stream (``K3Model._walk``). Under context parallelism:
        its split."""
        if self.context is not None:
            return self.context.constrain_tokens(x, batch_dim)
        if self.rows is not None and self.rows.stream_whole:
            return jnp.moveaxis(self.rows.whole(jnp.moveaxis(x, batch_dim, 0)), 0, batch_dim)
        if self.replicate_tokens or not self.token_axes or x.shape[batch_dim] % self.n_token_shards:
            return x
        spec = P(*([None] * batch_dim), self.token_axes if len(self.token_axes) > 1 else self.token_axes[0])
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.mesh, spec))

    def replicate(self, w):
        """``w`` (a small weight: the router [D, E]) pinned whole on every device, so the MoE layer contracts its
        own token rows locally. With D split over fsdp × expert (``zero3_ep_tp``) XLA's partitioner may instead move
        the tokens onto the weight's D split: every device's partial scores for all tokens of the mesh, 7.5 GB per
        MoE layer and chip on v5p-512 (LOG, 2026-12-02). With all rows on every device ``w`` stays as stored: with D
        split (``serve``) its partial scores' all-reduce joins LatentMoE down's (LOG, 2026-12-07)."""
        return w if self.replicate_tokens else \
            jax.lax.with_sharding_constraint(w, jax.sharding.NamedSharding(self.mesh, P()))

    def _record(self, n):
        self.dropped.append(int(n))

    def check(self) -> None:
        """Raise if any recorded call dropped assignments (call after the step has run)."""
        bad = sum(self.dropped)
        if bad:
            raise RuntimeError(f"expert-parallel dispatch dropped {bad} assignments over {len(self.dropped)} calls "
                               f"(capacity_factor={self.capacity_factor}); raise it or use -1 (worst case, dropless)")

    def dispatch(self, z, ids, weights, w1, w3, w2, act: Callable, *, act_quant: Callable | None = None):
        """z [M, P], ids/weights [M, A], w1/w3 [E, P, F], w2 [E, F, P] (or each a ``PackedWeight``: w1/w3 uint8
        [E, F, P/2] + [E, F, P/32], w2 [E, P, F/2] + [E, P, F/32]; or each of them a ``LoraWeight`` over such a
        base: A1/A3 [E, P, r], B1/B3 [E, r, F], A2 [E, F, r], B2 [E, r, P], each A possibly one [P, r] / [F, r]
        shared by the experts) → (y [M, P] acc dtype, dropped int32)."""
        M, A = ids.shape
        E = num_experts(w1)
        X, T = self.n_shards, self.n_token_shards
        if E % X:
            raise InputError(f"num_experts={E} is not divisible by the expert mesh axis {self.expert_axis!r} "
                             f"(size {X})")
        if act_quant is not None:
            # the experts' MXFP8 input quantized once per token, before the exchange replicates it to its A slots
            # (row-wise blocks along P: the same values; ~1/20 of the bytes of quantizing the receive buffer at K3's
            # shapes); the local experts then quantize only h (``quantized_input``, ``_local_experts``)
            z = act_quant(z)
        if self.replicate_tokens:
            return self._dispatch_replicated(z, ids, weights, w1, w3, w2, act, act_quant)
        if M % T:
            raise InputError(f"{M} token rows are not divisible by the token mesh axes {self.token_axes} "
                             f"(product {T})")
        m, El = M // T, E // X
        C = bucket_capacity(m, A, El, X, self.capacity_factor)
        kw = dict(act=act, act_quant=act_quant, axis=self.expert_axis, n_shards=X, capacity=C,
                  tensor_axes=self.tensor_axes)
        reduce_axes = self.token_axes

        def local(z, ids, wts, w1, w3, w2):
            # chosen in here, where the current mesh is shard_map's (its device: the platform being compiled for)
            kernels = _packed_kernels(self.packed_kernel) if isinstance(_base(w1), PackedWeight) else None
            w1, w3, w2 = per_device_dropout(self._gather_width(w1, w3, w2), self.token_axes, self.tensor_axes)
            bucketed, ragged = partial(_bucketed, **kw, kernels=kernels), partial(_ragged, **kw, kernels=kernels)
            args = (z, ids, wts, w1, w3, w2)
            if X == 1:          # no expert axis (a ContextParallel's MoE): every expert here, on this shard's rows
                y = _local_experts(z, ids, w1, w3, w2, act, act_quant, self.tensor_axes, kernels, weights=wts)
                return y, jnp.int32(0) if not reduce_axes else lax.psum(jnp.int32(0), reduce_axes)
            if self.impl == "bucketed":
                y, d = bucketed(*args)
            elif self.impl == "ragged":
                y, d = ragged(*args)
            else:
                y, d = lax.platform_dependent(*args, cpu=bucketed, default=ragged)
            return y, (lax.psum(d, reduce_axes) if reduce_axes else d)

        tok = P(self.token_axes or None, None)
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(tok, tok, tok, *self._weight_specs(w1, w3, w2)),
                           out_specs=(tok, P()))
        return fn(z, ids, weights, w1, w3, w2)

    def _weight_specs(self, w1, w3, w2):
        """in_specs of w1, w3, w2: experts over the expert axis, F over the tensor axes; a float stack's width P
        also over ``width_axes`` (as the parameter is stored), gathered inside by ``_gather_width``.

        A ``LoraWeight``'s factors follow its base: A1/A3 [E, P, r] and B2 [E, r, P] split P over ``width_axes``
        (gathered inside like a float base, whatever the base: the factors are trained Params stored so, and the
        gather's transpose hands their gradients back reduce-scattered) and never over the tensor axes; B1/B3
        [E, r, F] and A2 [E, F, r] split F over the tensor axes as the base does. Each tensor shard then computes
        a_t = x W1_t + (x A1) B1_t, its own F slice of the gate, and y_t = h_t W2_t + (h_t A2_t) B2, a partial sum
        that the psum over the tensor axes completes: Σ_t (h_t A2_t) B2 = (h A2) B2. A shared A ([P, r] or [F, r],
        no expert axis: ``LoRAConfig.experts_shared_a``) is split the same way but never over the expert axis: every
        expert shard holds it whole, and its gradient — each shard's partial sum over its own experts' rows — is
        summed over the expert axis by the transpose of its implicit cast to varying (as for the token axes)."""
        t = self.tensor_axes or None
        p = self.width_axes or None
        e = self.expert_axis if self.n_shards > 1 else None     # a size-1 axis in a spec would mark them varying
        if isinstance(_base(w1), PackedWeight):  # torch orientation [E, out, in/2]: F is w1/w3's dim 1, w2's dim 2
            base_in, base_out = P(e, t, None), P(e, None, t)
            if _base(w1).stacked:                # stacks of layers [L, E, ...] and the layer's index, whole
                base_in, base_out = (PackedWeight(P(None, *b), P(None, *b), P()) for b in (base_in, base_out))
        else:
            base_in, base_out = P(e, p, t), P(e, t, p)
        def lora(w, base, a_in, b_out):  # a_in: A's input dim split, b_out: B's output dim split
            a = P(a_in, None) if w.a.ndim == 2 else P(e, a_in, None)  # a shared A [in, r]: whole on every expert shard
            return LoraWeight(base, a, P(e, None, b_out), jax.tree.map(lambda _: P(), w.dropout))  # key: whole

        return tuple(lora(w, base, a_in, b_out) if isinstance(w, LoraWeight) else base
                     for w, base, a_in, b_out in ((w1, base_in, p, t), (w3, base_in, p, t), (w2, base_out, t, p)))

    def _gather_width(self, w1, w3, w2):
        """Inside the shard_map: a float stack's width P all-gathered over ``width_axes`` (w1/w3 dim 1, w2 dim 2).
        The gather is the ZeRO-3 weight gather done where autodiff sees it: its transpose is a reduce-scatter, so
        each expert gradient leaves the shard_map already in its parameter's sharding. Gathered outside (an
        in_spec without those axes) the cotangent was psum'd whole over them and sliced afterwards: the v5p-512
        QAT step's all-reduce buffers inside the scan (experiments/LOG.md). Packed stacks (frozen, no gradient)
        enter whole along P. LoRA factors along P (A1/A3 dim 1 — dim 0 of a shared A —, B2 dim 2) are gathered the
        same way over a float or a packed base."""
        if not self.width_axes:
            return w1, w3, w2
        ax = self.width_axes if len(self.width_axes) > 1 else self.width_axes[0]
        g = partial(lax.all_gather, axis_name=ax, tiled=True)

        def gather(w, dim, a_dim=None, b_dim=None):
            if isinstance(w, LoraWeight):
                a = w.a if a_dim is None else g(w.a, axis=a_dim)
                b = w.b if b_dim is None else g(w.b, axis=b_dim)
                return LoraWeight(gather(w.base, dim), a, b, w.dropout)
            # w2's P is its last dim: its gradient leaves the TPU compiler's way (whole-stack all-reduces); gathered
            # on its transposed view instead, the full QAT step moved more (experiments/LOG.md, session 29)
            return w if isinstance(w, PackedWeight) else g(w, axis=dim)

        def a_in(w):  # A1/A3's P dim: 1 of [E, P, r], 0 of a shared [P, r]
            return w.a.ndim - 2 if isinstance(w, LoraWeight) else None

        return gather(w1, 1, a_dim=a_in(w1)), gather(w3, 1, a_dim=a_in(w3)), gather(w2, 2, b_dim=2)

    def _dispatch_replicated(self, z, ids, weights, w1, w3, w2, act, act_quant):
        def local(z, ids, wts, w1, w3, w2):
            kernels = _packed_kernels(self.packed_kernel) if isinstance(_base(w1), PackedWeight) else None
            w1, w3, w2 = per_device_dropout(self._gather_width(w1, w3, w2), (self.expert_axis,) if self.n_shards > 1
                                            else (), self.tensor_axes)  # the other axes hold the same rows: alike
            return _replicated(z, ids, wts, w1, w3, w2, act=act, act_quant=act_quant, axis=self.expert_axis,
                               n_shards=self.n_shards, tensor_axes=self.tensor_axes, kernels=kernels)

        rep = P()
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(rep, rep, rep, *self._weight_specs(w1, w3, w2)),
                           out_specs=(rep, P()))
        return fn(z, ids, weights, w1, w3, w2)

    def __call__(self, z, ids, weights, w1, w3, w2, act: Callable, *, act_quant: Callable | None = None):
        y, dropped = self.dispatch(z, ids, weights, w1, w3, w2, act, act_quant=act_quant)
        if self.replicate_tokens:
            return y
        M, A = ids.shape
        El = num_experts(w1) // self.n_shards
        m = M // self.n_token_shards
        if bucket_capacity(m, A, El, self.n_shards, self.capacity_factor) < m * min(A, El):
            jax.debug.callback(self._record, dropped)
        return y
