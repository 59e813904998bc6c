"""Gated MLA token mixer (docs/model.md §5.1) as an NNX block: NoPE, optional q-LoRA, an unrotated shared key slice k^R,
scale 1/√(Hn+Hr), element-wise sigmoid output gate before o_proj, causal attention computed blockwise
(k3jax.ops.attention).

Parameters (N heads, Hn nope, Hr rope-sized slice, V value, Rq / Rkv the q / kv LoRA ranks):
q_a [D, Rq], q_a_norm [Rq], q_b [Rq, N, Hn+Hr] (q-LoRA) or wq [D, N, Hn+Hr]; kv_a [D, Rkv+Hr]; kv_a_norm [Rkv];
kv_b [Rkv, N, Hn+V]; w_gate [D, N, V] (output gate); wo [N, V, D].

Inference (``extend``): the layer's cache is the latent itself — ``c_kv`` after ``kv_a_layernorm`` (R values per
token) and the shared key slice ``k_rope`` (Hr) — written at each row's own position; attention reads it through
``ops.latent_attention`` in the absorbed form (decode) or the materialized one (the reference). The output gate is
element-wise per head and value channel, applied before ``wo``: that is why W_UV cannot be folded into W_o.

``impl`` ("xla" or "pallas", ``RunConfig.mla_impl``): the Pallas latent-attention kernels (pallas_kernels/mla, reached
through ``layers.backends``) run the whole-sequence attention (flash attention over the latent, keys up-projected per
key block; under context parallelism per shard over the gathered latent, its queries load-balanced), the cached
pieces longer than ``MAX_DECODE_QUERIES`` tokens (the same kernel over the cache, with per-row offsets) and the
absorbed decode of shorter pieces (a decode step, a speculative verify block; under a context axis the XLA path).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import backends, lora
from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.ops.attention import causal_attention
from k3jax.ops.latent_attention import DECODE_BLOCK, latent_attention
from k3jax.ops.norms import acc_dtype, rms_norm

_QKV = ("embed", "heads", "head_dim")
MAX_DECODE_QUERIES = 8  # query tokens per row of the Pallas decode kernel (a speculative verify block)


def big_key_block(T: int, block_size: int) -> int | None:
    """The large key block ``extend`` reads a cache in for a piece of T tokens: about ``DECODE_BLOCK`` for one token
    (decode), None (blocks of ``block_size`` only) otherwise."""
    return max(DECODE_BLOCK // block_size, 1) * block_size if T == 1 else None


class MLADims(NamedTuple):
    num_heads: int  # N
    nope: int  # Hn
    rope: int  # Hr (the shared, unrotated key slice)
    value: int  # V


class MLA(nnx.Module):
    """Gated multi-head latent attention; HF module ``self_attn.``."""

    LORA = ("q_a", "q_b", "wq", "kv_a", "kv_b", "w_gate", "wo")  # adapter targets (k3jax/layers/lora.py)
    HF = {
        "q_a": HFLeaf("q_a_proj.weight"),
        "q_a_norm": vec("q_a_layernorm.weight"),
        "q_b": HFLeaf("q_b_proj.weight"),
        "wq": HFLeaf("q_proj.weight"),
        "kv_a": HFLeaf("kv_a_proj_with_mqa.weight"),
        "kv_a_norm": vec("kv_a_layernorm.weight"),
        "kv_b": HFLeaf("kv_b_proj.weight"),
        "w_gate": HFLeaf("g_proj.weight"),
        "wo": HFLeaf("o_proj.weight", in_axes=2),
    }

    def __init__(self, *, d: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, output_gate: bool,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        N, Hn, Hr, V = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.dims = MLADims(N, Hn, Hr, V)
        if q_lora_rank:
            self.q_a = param(normal(rngs, (d, q_lora_rank), dtype), ("embed", "q_lora"))
            self.q_a_norm = param(jnp.ones((q_lora_rank,), dtype), ("norm",))
            self.q_b = param(normal(rngs, (q_lora_rank, N, Hn + Hr), dtype), ("q_lora", "heads", "head_dim"))
        else:
            self.wq = param(normal(rngs, (d, N, Hn + Hr), dtype), _QKV)
        self.kv_a = param(normal(rngs, (d, kv_lora_rank + Hr), dtype), ("embed", "kv_lora"))
        self.kv_a_norm = param(jnp.ones((kv_lora_rank,), dtype), ("norm",))
        self.kv_b = param(normal(rngs, (kv_lora_rank, N, Hn + V), dtype), ("kv_lora", "heads", "head_dim"))
        if output_gate:
            self.w_gate = param(normal(rngs, (d, N, V), dtype), _QKV)
        self.wo = param(normal(rngs, (N, V, d), dtype), ("heads", "head_dim", "embed"))

    def project(self, x, norm_eps: float, rows=None):
        """x [B, T, D] → q [B, T, N, Hn+Hr], c_kv [B, T, R] (normed latent, x.dtype), k_rope [B, T, Hr] (acc).
        ``rows``: a ``RowSplit`` the queries enter (``RowSplit.enter``; a no-op unless x holds every row): with a
        query low rank before its up-projection, so each device up-projects its own rows only."""
        acc = acc_dtype(x.dtype)
        cdt = x.dtype
        rkv = self.kv_a_norm.shape[0]
        if hasattr(self, "q_a"):
            c_q = lora.proj(self, "q_a", "btd,dr->btr", x, self.q_a[...].astype(cdt), acc)
            c_q = rms_norm(c_q, self.q_a_norm[...], norm_eps, out_dtype=cdt)
            c_q = c_q if rows is None else rows.enter(c_q, None)
            q = lora.proj(self, "q_b", "btr,rnh->btnh", c_q, self.q_b[...].astype(cdt), acc)
        else:
            q = lora.proj(self, "wq", "btd,dnh->btnh", x, self.wq[...].astype(cdt), acc)
            q = q if rows is None else rows.enter(q, 2)
        ckv = lora.proj(self, "kv_a", "btd,dr->btr", x, self.kv_a[...].astype(cdt), acc)
        c_kv = rms_norm(ckv[..., :rkv], self.kv_a_norm[...], norm_eps, out_dtype=cdt)
        return q, c_kv, ckv[..., rkv:]  # k_rope: ONE slice shared by all heads, not rotated (NoPE)

    def output(self, x, o, rows=None):
        """Per-head attention output o [B, T, N, V] (acc) → the gated, projected y [B, T, D] in x.dtype. ``rows``:
        a ``RowSplit`` whose rows o is split by (``RowSplit.leave`` gathers them where x holds every row): where
        ``rows.heads_whole`` the gate applies per row and the gated o, in x.dtype, is gathered — half the bytes of
        the fp32 o and no whole-row gate pass."""
        acc = acc_dtype(x.dtype)
        cdt = x.dtype
        early = rows is not None and rows.heads_whole
        o = rows.leave(o, 2) if rows is not None and not early else o
        if hasattr(self, "w_gate"):
            gate = lora.proj(self, "w_gate", "btd,dnv->btnv", x, self.w_gate[...].astype(cdt), acc)
            o = jax.nn.sigmoid(rows.enter(gate, 2) if early else gate) * o
        o = rows.leave(o.astype(cdt), 2) if early else o.astype(cdt)
        y = lora.proj(self, "wo", "btnv,nvd->btd", o, self.wo[...].astype(cdt), acc)
        return y.astype(cdt)

    def __call__(self, x, *, norm_eps: float, block_size: int = 512, segment_ids=None, context=None,
                 impl: str = "xla", rows=None):
        """x [B, T, D] (normed layer input) → (y [B, T, D], max_logit [B, N]) — max_logit feeds QK-Clip.
        ``segment_ids`` [B, T]: packed documents; each token attends within its own (``k3jax.ops.segments``).
        K3's MLA is NoPE (docs/model.md §5.1): there are no positions to restart at a boundary. ``context``: None, or a
        ``ContextParallel`` (T split over devices): the latent is all-gathered along the sequence and each shard
        attends from its own queries (k3jax/sharding/context_parallel.py). ``impl``: "xla" or "pallas" (the module
        docstring). ``rows``: None, or a ``RowSplit`` (whole sequences per device, no context): the Pallas kernel
        then runs per device on its rows (k3jax/sharding/row_split.py); the XLA path ignores it."""
        acc = acc_dtype(x.dtype)
        cdt = x.dtype
        N, Hn, Hr, V = self.dims
        q, c_kv, k_rope = self.project(x, norm_eps)
        if impl == "pallas":
            kv_b = lora.merged(self, "kv_b").astype(cdt)         # the kernel up-projects each key block itself
            flash = functools.partial(backends.mla_flash, scale=1.0 / math.sqrt(Hn + Hr), block_size=block_size)
            args = (q.astype(acc), c_kv, k_rope.astype(acc), kv_b[..., :Hn], kv_b[..., Hn:])
            if context is None and rows is None:
                o, max_logit = flash(*args, segment_ids=segment_ids)
            elif context is None:
                o, max_logit = rows.latent_flash(flash, *args, segment_ids=segment_ids)
            else:   # per shard over the gathered latent, queries mirror-balanced (k3jax/sharding/context_parallel.py)
                o, max_logit = context.latent_flash(flash, *args, segment_ids=segment_ids)
            return self.output(x, o), max_logit
        if context is not None:                     # the latent (R + Hr per token) is what crosses the shards
            c_kv, k_rope = context.gather_seq(c_kv), context.gather_seq(k_rope)
        kv = lora.proj(self, "kv_b", "btr,rnh->btnh", c_kv, self.kv_b[...].astype(cdt), acc)
        k_nope, v = kv[..., :Hn], kv[..., Hn:]
        B, T = x.shape[:2]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (B, T, N, Hr))], axis=-1)
        attend = causal_attention if context is None else context.attention
        o, max_logit = attend(q.astype(acc), k.astype(acc), v.astype(acc), scale=1.0 / math.sqrt(Hn + Hr),
                              block_size=block_size, segment_ids=segment_ids)
        return self.output(x, o), max_logit

    def extend(self, x, cache: dict, *, start, lengths, norm_eps: float, block_size: int, absorbed: bool,
               layer=None, context=None, impl: str = "xla", rows=None):
        """Append a right-padded piece to the latent cache and attend over it (prefill pieces and decode steps).

        x [B, T, D] normed input of the new tokens; cache {"c_kv": [B, S, R], "k_rope": [B, S, Hr]} (both in the
        compute dtype, ``model.cache``); start [B] the tokens already cached per row; lengths [B] the real tokens of
        this piece per row (the rest is right padding, written nowhere). Token t of row b sits at position
        start[b] + t. Keys are read in blocks of ``block_size``; for one token, first in blocks of about
        ``DECODE_BLOCK``.
        absorbed: the absorbed form (decode) or the materialized one (the reference; ``ops.latent_attention``).
        layer: None, or an index into a cache stacked over the scanned groups ([G, B, S, ...]: the new tokens are
        scattered into the stack in place and the keys read from it block by block).
        context: None, or a ``ContextParallel`` (the piece split over devices): each shard's queries read the layer's
        whole latent cache, gathered along S (k3jax/sharding/context_parallel.py).
        impl: "pallas" runs the absorbed form of a piece of at most ``MAX_DECODE_QUERIES`` tokens through the Pallas
        decode kernel (every latent read once for all heads and queries; under ``context`` the XLA path), and a
        longer piece (either form) through the Pallas flash kernel over the updated cache (``backends.mla_flash``
        with per-row offsets q_offset = start: online softmax, key blocks above a row's diagonal skipped, each key
        block up-projected with W_UK / W_UV inside the kernel; under ``context`` per shard,
        ``ContextParallel.latent_flash_cached``). Keys past a row's written positions lie above its real queries'
        diagonal; padding queries (t ≥ lengths) may see stale cache rows (finite) and their outputs are unused.
        With a stacked cache the kernel reads the layer's [B, S, ·] slice, a copy of it (one read and one write of
        B · S · (R + Hr) values per call; the kernel then reads its blocks).
        rows: None, or a ``RowSplit`` (the rows and their caches split over devices, no context): attention runs per
        device inside its ``shard_map`` (k3jax/sharding/row_split.py), kernels or XLA, on the caches as placed; with
        the stream's rows whole, the queries enter the split and the outputs leave it (``RowSplit.enter`` / ``leave``).
        Returns (y [B, T, D] in x.dtype, the updated cache)."""
        N, Hn, Hr, V = self.dims
        B, T = x.shape[:2]
        q, c_kv, k_rope = self.project(x, norm_eps, rows)
        start = jnp.asarray(start, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        S = cache["c_kv"].shape[-2]
        t = jnp.arange(T, dtype=jnp.int32)[None, :]
        pos = start[:, None] + t                                                       # [B, T]
        dest = jnp.where(t < lengths[:, None], pos, S)                                # padding → out of range: dropped
        row_ids = jnp.arange(B)[:, None]
        at = (row_ids, dest) if layer is None else (layer, row_ids, dest)
        new = {"c_kv": cache["c_kv"].at[at].set(c_kv.astype(cache["c_kv"].dtype), mode="drop"),
               "k_rope": cache["k_rope"].at[at].set(k_rope.astype(cache["k_rope"].dtype), mode="drop")}
        kv_b = lora.merged(self, "kv_b")                    # the absorbed form reads W_UK / W_UV blocks whole
        big = big_key_block(T, block_size)
        attend = functools.partial(latent_attention, scale=1.0 / math.sqrt(Hn + Hr), block=block_size,
                                   big_block=big, absorbed=absorbed)
        lay = (lambda c: c) if layer is None else (lambda c: jax.lax.dynamic_index_in_dim(c, layer, 0, False))
        if impl == "pallas" and absorbed and T <= MAX_DECODE_QUERIES and context is None:
            decode = functools.partial(backends.mla_decode, scale=1.0 / math.sqrt(Hn + Hr))
            args = (q[..., :Hn], q[..., Hn:], new["c_kv"], new["k_rope"], kv_b[..., :Hn], kv_b[..., Hn:])
            kw = dict(q_pos=pos, kv_len=start + lengths, layer=layer)
            o = decode(*args, **kw) if rows is None else rows.latent_decode(decode, *args, **kw)
        elif impl == "pallas" and T > MAX_DECODE_QUERIES:      # a prefill piece: the flash kernel over the cache
            acc = acc_dtype(x.dtype)
            w = kv_b.astype(x.dtype)                            # as __call__: the kernel up-projects each key block
            flash = functools.partial(backends.mla_flash, scale=1.0 / math.sqrt(Hn + Hr), block_size=block_size)
            args = (q.astype(acc), lay(new["c_kv"]), lay(new["k_rope"]).astype(acc), w[..., :Hn], w[..., Hn:])
            if rows is not None:
                o, _ = rows.latent_flash(flash, *args, q_offset=start)
            elif context is None:
                o, _ = flash(*args, q_offset=start)
            else:
                context.check(T, "piece length")
                o = context.latent_flash_cached(flash, *args, start=start)
        elif context is not None:
            context.check(T, "piece length")
            o = context.latent_attention(attend, q[..., :Hn], q[..., Hn:], lay(new["c_kv"]), lay(new["k_rope"]),
                                         kv_b[..., :Hn], kv_b[..., Hn:], q_pos=pos, kv_len=start + lengths)
        else:                                    # under a row split per device, as the caches are split
            args = (q[..., :Hn], q[..., Hn:], new["c_kv"], new["k_rope"], kv_b[..., :Hn], kv_b[..., Hn:])
            kw = dict(q_pos=pos, kv_len=start + lengths, layer=layer)
            o = attend(*args, **kw) if rows is None else rows.latent_decode(attend, *args, **kw)
        return self.output(x, o, rows), new


__all__ = ["MAX_DECODE_QUERIES", "MLA", "MLADims", "big_key_block"]
