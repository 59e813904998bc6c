"""Whole sequences per device: the MLA flash kernel under a row split (``--mesh fsdp=8,expert=64``, no context axis).

    rows = RowSplit(mesh, ("fsdp", "expert"))                 # rows over those axes, heads over ``head_axes``
    o, max_logit = rows.latent_flash(flash, q, c_kv, k_rope, w_uk, w_uv, segment_ids=seg)
    o = rows.latent_decode(decode, q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos=pos, kv_len=n)   # serving

A Pallas call (Mosaic on TPU, Triton on GPU) is not partitioned by the compiler: outside ``shard_map`` it runs on one
device. When the mesh splits only the batch (each device holds whole rows: training's token axes, no ``context``),
attention needs nothing from another device, so the kernel runs per device inside one ``shard_map``: each device
attends over its own rows, for the heads it holds (``heads`` under the rules: ``tensor``). The weights W_UK / W_UV
enter whole along R and split by head like q; their gradients are summed over the row axes by ``shard_map``'s
transpose (the kernel's backward marks them as not varying over the rows: ``match_varying``). The max logit is per
row and head, so no collective is needed. Under a context axis the sequence is split and the kernels run in
``ContextParallel`` instead (k3jax/sharding/context_parallel.py); the small-batch rule (every row on every device)
has no row split.

Serving (``K3Model.extend``) splits its caches by the same rows (``placement.cache_shardings``), so a decode step
runs the split-KV decode kernel per device (``latent_decode``; the XLA path too) and a prefill piece the flash kernel
with its rows' offsets (``latent_flash(q_offset=)``). Without it the 64-row, 128K-token decode plan on v5p-64 ran
XLA's blockwise absorbed attention, ~37 GB of its 131 GB per chip per step for 15.4 GB of cache. Where the batch
divides, the latent's rows are split over the heads' axis as well (``latent_cache_rows``): each device then swaps
its rows' queries for its cache rows' over that axis, attends with every head and swaps the outputs back, so each
latent is read once instead of once per head shard (experiments/LOG.md, 2026-12-07).

The serve column's decode keeps the stream's rows whole on every device (``stream_whole``; ``placement.whole_rows``:
its projections split the model width over the token axis) and splits only the caches by rows. Each mixer then
hands its per-row inputs to the split (``enter``: reduced whole, then sliced — no collective) and its outputs back
(``leave``: an all-gather over the rows' axes) around the per-row attention: KDA's recurrent step on its state's
rows, MLA's ``latent_decode``. kimi-k3 at B = 64, 128K on v5p-64: 26.5 ms per step against ep_tp's 42.7 ms, the
non-expert weights read over 64 chips instead of 4 (experiments/LOG.md, 2026-12-07 session 33).

Why this matters: without it the plans' training steps ran MLA through XLA's blockwise attention, whose [N, T, bk]
fp32 score blocks go through HBM (~1.4 TB of the frozen-experts step's 28.5 TB per chip on v5p-512;
experiments/LOG.md). The KDA kernel is not run this way: its backward is the jnp chunked path's VJP and its forward
declares no cost estimate, so a plan would not count its bytes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.sharding.mesh import axis_sizes


def _spec(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def latent_cache_rows(mesh, row_axes: tuple[str, ...], head_axes: tuple[str, ...], batch: int) -> tuple[str, ...]:
    """The mesh axes an MLA latent cache's rows are split over when the rows are over ``row_axes`` and the heads
    over ``head_axes``: the rows' axes and, where ``batch`` divides, the heads' one axis too. The latent is shared by
    every head, so a cache split by rows alone is read whole by each head shard (kimi-k3 decode at B = 64 on tensor 4:
    15.4 GB per chip and step for 3.9 GB of cache); split by the heads' axis as well each latent is read once, and
    the decode kernel exchanges queries and outputs over that axis instead (``RowSplit.latent_decode``)."""
    sizes = axis_sizes(mesh)
    rows = tuple(a for a in row_axes if sizes.get(a, 1) > 1)
    heads = tuple(a for a in head_axes if sizes.get(a, 1) > 1 and a not in rows)
    ways = math.prod(sizes[a] for a in (*rows, *heads))
    return (*rows, *heads) if len(heads) == 1 and batch % ways == 0 else rows


def _to_cache_rows(x, axis):
    """[b, T, N/n, ·] (a device's rows, its heads) → [b/n, T, N, ·] (its cache slice's rows, every head): an
    all-to-all over the heads' mesh ``axis``."""
    return jax.lax.all_to_all(x, axis, 0, 2, tiled=True)


def _to_query_rows(x, axis, heads_dim: int):
    """The inverse of ``_to_cache_rows`` for an output whose heads are dimension ``heads_dim``."""
    return jax.lax.all_to_all(x, axis, heads_dim, 0, tiled=True)


class RowSplit:
    """The rows of a batch split over ``row_axes`` of ``mesh`` (whole sequences per device), heads over
    ``head_axes``; carried by ``ExpertParallel.rows`` (module docstring)."""

    def __init__(self, mesh: jax.sharding.Mesh, row_axes: tuple[str, ...], head_axes: tuple[str, ...] = (),
                 stream_whole: bool = False):
        sizes = axis_sizes(mesh)
        self.mesh, self.stream_whole = mesh, stream_whole
        self.row_axes = tuple(a for a in row_axes if sizes.get(a, 1) > 1)
        self.head_axes = tuple(a for a in head_axes if sizes.get(a, 1) > 1)

    def _cache_split(self, batch: int):
        """(the PartitionSpec entry of a latent cache's rows, whether they are split over the heads' axis too: then
        queries and outputs swap rows for heads over that axis, ``_to_cache_rows`` / ``_to_query_rows``)."""
        rows = latent_cache_rows(self.mesh, self.row_axes, self.head_axes, batch)
        return _spec(rows), rows != self.row_axes

    def _pin(self, x, heads_dim: int | None, whole: bool):
        spec = [P.UNCONSTRAINED] * x.ndim
        spec[0] = None if whole else _spec(self.row_axes)
        if heads_dim is not None:
            spec[heads_dim] = _spec(self.head_axes)
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.mesh, P(*spec)))

    def whole(self, x):
        """``x`` [B, ...] with every row on every device (its other dimensions as the partitioner places them): the
        stream under ``stream_whole``."""
        return self._pin(x, None, whole=True)

    def enter(self, x, heads_dim: int | None):
        """A mixer's per-row input ``x`` [B, ...] (heads at ``heads_dim``, or None: no heads dimension) handed from
        a whole stream to the rows' split: pinned whole first, so that the projection that made it reduces its
        partial sums over the width's axes, then sliced. Left to itself the partitioner computed such projections
        on a slice of the rows with their weights all-gathered over the width's axis (kimi-k3 decode at B = 64 on
        v5p-64: 66 gathers of [3072, 7168] per step; experiments/LOG.md, 2026-12-07). Unchanged when the stream is
        split by rows."""
        if not self.stream_whole:
            return x
        return self._pin(self._pin(x, heads_dim, whole=True), heads_dim, whole=False)

    @property
    def heads_whole(self) -> bool:
        """Whether the stream holds every row and each device every head (serve with no ``tensor`` axis). There a
        mixer applies its output gate per row, before ``leave`` gathers its output, and KDA's decode step runs its
        kernel: the gate's partial sums are all-reduced with the projections' and the gather carries one gated
        array; the kernel reads and writes each layer's state once (kimi-k3 decode at B = 64 on v5p-64, serve
        expert=64: 32.5 → 31.3 GB per chip and step, with MLA's queries up-projected per row). With the heads split
        over ``tensor`` XLA all-reduced the gate apart from the projections (one collective more per layer: 0.3 ms
        more step on serve expert=16,tensor=4), and around the kernel it made 66 of its empty all-reduces real ones
        over the 64-way expert axis (2.1 ms more step on v6e-256, serve expert=64,tensor=4; both the latency
        term's; experiments/LOG.md, 2026-12-07 session 35): there the gate applies after the gather and XLA's step
        runs."""
        return self.stream_whole and not self.head_axes

    def leave(self, x, heads_dim: int):
        """A per-row output ``x`` [B, ...] back to the whole stream (an all-gather over the rows' axes) before the
        projection that follows it; unchanged when the stream is split by rows."""
        return self._pin(x, heads_dim, whole=True) if self.stream_whole else x

    def latent_flash(self, flash, q, c_kv, k_rope, w_uk, w_uv, *, segment_ids=None, q_offset=None):
        """``flash(q, c_kv, k_rope, w_uk, w_uv[, segment_ids=][, q_offset=])`` → (o, max_logit) run per device on its
        rows (e.g. ``layers.backends.mla_flash`` with its scale and block bound): q [B, T, N, Hn+Hr], c_kv [B, S, R],
        k_rope [B, S, Hr], w_uk [R, N, Hn], w_uv [R, N, V], segment_ids [B, T] or None, q_offset [B] or None (a
        prefill piece over its rows' caches, split by ``latent_cache_rows`` and swapped as ``latent_decode`` does:
        query t of row b sits at position q_offset[b] + t). Returns (o [B, T, N, V], max logit [B, N]), split like
        q."""
        b, h = _spec(self.row_axes), _spec(self.head_axes)
        extra = {k: v for k, v in (("segment_ids", segment_ids), ("q_offset", q_offset)) if v is not None}
        cached = q_offset is not None and segment_ids is None
        c, swap = self._cache_split(q.shape[0]) if cached else (b, False)

        def local(q, c, r, wk, wv, *more):
            q = _to_cache_rows(q, h) if swap else q
            o, mx = flash(q, c, r, wk, wv, **dict(zip(extra, more, strict=True)))
            return (_to_query_rows(o, h, 2), _to_query_rows(mx, h, 1)) if swap else (o, mx)

        w = P(None, None, None) if swap else P(None, h, None)
        in_specs = (P(b, None, h, None), P(c, None, None), P(c, None, None), w, w)
        in_specs += tuple(P(b, None) if k == "segment_ids" else P(c) for k in extra)
        args = (q, c_kv, k_rope, w_uk, w_uv, *(jnp.asarray(v, jnp.int32) for v in extra.values()))
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=(P(b, None, h, None), P(b, h)))
        return fn(*args)

    def latent_decode(self, decode, q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, q_pos, kv_len, layer=None):
        """``decode(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos=, kv_len=, layer=)`` → o run per device on its
        rows' caches (``layers.backends.mla_decode`` with its scale: the split-KV decode kernel, each latent read
        once for the device's heads): q_nope [B, T, N, Hn], q_rope [B, T, N, Hr], c_kv [B, S, R] / k_rope [B, S, Hr]
        — or both stacked over layers [L, B, S, ·] with ``layer`` an int32 index —, w_uk [R, N, Hn], w_uv [R, N, V],
        q_pos [B, T], kv_len [B]. The caches are split by ``latent_cache_rows`` (``placement.cache_shardings``): by
        the rows' axes, or by the heads' axis too — then each device swaps its rows' queries for its cache rows' over
        that axis (an all-to-all), attends with every head (W_UK / W_UV whole) and swaps the outputs back.
        Returns o [B, T, N, V], split like q."""
        b, h = _spec(self.row_axes), _spec(self.head_axes)
        stacked = layer is not None
        c, swap = self._cache_split(q_nope.shape[0])
        cache = P(None, c, None, None) if stacked else P(c, None, None)

        def local(qn, qr, c, r, wk, wv, pos, n, *lay):
            qn, qr = (_to_cache_rows(qn, h), _to_cache_rows(qr, h)) if swap else (qn, qr)
            o = decode(qn, qr, c, r, wk, wv, q_pos=pos, kv_len=n, layer=lay[0] if stacked else None)
            return _to_query_rows(o, h, 2) if swap else o

        w = P(None, None, None) if swap else P(None, h, None)
        in_specs = (P(b, None, h, None), P(b, None, h, None), cache, cache, w, w, P(c, None), P(c)) + \
            ((P(),) if stacked else ())
        args = (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, jnp.asarray(q_pos, jnp.int32),
                jnp.asarray(kv_len, jnp.int32)) + ((jnp.asarray(layer, jnp.int32),) if stacked else ())
        # check_vma off: the kernel's index maps read each row's block count (a scalar-prefetched, row-varying
        # value) at the grid's row index (unvarying), which the varying-axes check refuses inside the TPU interpreter
        # ("dynamic_slice requires varying manual axes to match"); the only collectives inside are the swap's
        # all-to-alls, whose results vary as their inputs do
        return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=P(b, None, h, None),
                             check_vma=False)(*args)

    def kda_step(self, step, q, k, v, g, beta, states, layer):
        """``step(q, k, v, g, beta, states, layer)`` → (o, states) run per device on its rows and heads: KDA's decode
        kernel (``layers.backends.kda_decode_step``) on the rows' split of the stacked state (``cache_shardings``:
        rows over the rows' axes, heads over the heads' axes). q, k, g [B, N, K], v [B, N, V], beta [B, N] split
        like it; states [L, B, N, K, V]; layer an int32 scalar. Returns (o [B, N, V], states), split alike."""
        b, h = _spec(self.row_axes), _spec(self.head_axes)
        vec, st = P(b, h, None), P(None, b, h, None, None)
        return jax.shard_map(step, mesh=self.mesh, in_specs=(vec, vec, vec, vec, P(b, h), st, P()),
                             out_specs=(vec, st))(q, k, v, g, beta, states, jnp.asarray(layer, jnp.int32))


__all__ = ["RowSplit", "latent_cache_rows"]
