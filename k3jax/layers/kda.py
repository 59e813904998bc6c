"""One KDA token mixer (docs/model.md §4.1) as an NNX block that owns its parameters.

    blk = KDA(d=384, num_heads=6, head_dim=64, conv_size=4, full_rank_gate=True, gate_lower_bound=-5.0,
              dtype=jnp.float32, rngs=nnx.Rngs(0))
    y, cache = blk(x_btd, eps=1e-5, impl="chunked", chunk_size=64)

Steps: q/k/v projections -> three separate causal depthwise convs (tap W-1 hits the current token) -> SiLU ->
per-head l2norm of q and k -> forget gate g per head AND key channel from (x f_a) f_b (no activation between),
fp32 -> beta = sigmoid(x w_beta) -> KDA core -> gated RMSNorm per head over K (shared o_norm, eps on the mean)
times sigmoid(x w_gate) (or the low-rank sigmoid((x g_a) g_b)) -> wo.

Parameters (N heads, K head dim, R = K the f_a / g_a rank, Wc conv taps): wq/wk/wv [D, N, K]; conv_q/k/v
[N*K, Wc] (head-major channels); f_a [D, R]; f_b [R, N, K]; dt_bias [N, K]; A_log [N]; w_beta [D, N];
w_gate [D, N, K] (full rank) or g_a [D, R] + g_b [R, N, K]; o_norm [K]; wo [N, K, D].
Gate init follows fla (docs/model.md §4.2): safe gate A_log = 0, softplus gate A_log = log U(1, 16);
dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1). Conv weights: PyTorch Conv1d default (kaiming-uniform,
fan_in = kernel size for a depthwise conv).

Cache (docs/model.md §4.6): ``{"state": [B, N, K, V] K-first fp32, "conv_q"/"conv_k"/"conv_v": [B, Wc-1, N*K]}``, the
last Wc-1 pre-conv inputs oldest first. ``cache=None`` runs a full sequence from a zero state; with a cache, T == 1
takes one ``kda_step`` and T > 1 continues the chosen path from the cached state and conv tails. The returned cache
describes the state after the last token (but for a recorded verify piece, below). ``lengths`` [B] (ragged,
right-padded pieces): row b's tokens at t >= lengths[b] are padding — their gate and write strength are set to g = 0,
beta = 0, which leaves the state exactly as it was (S = exp(0) S + 0), and the conv tails end at each row's last real
token; their outputs are not meaningful.

Verify records (a speculative-decoding verify piece, ``k3jax.model.rollback``): a cache that also holds ``rec_*``
leaves (``RECORDS``) runs the piece token by token (``kda_recurrent_recorded``, the same outputs as the other paths
to fp rounding) and fills them: ``rec_x`` [B, T, 3 N K] the pre-conv q|k|v projections; copy mode ``rec_state``
[B, T, N, K, V] the state after each token; replay mode ``rec_k`` [B, T, N, K] (post-conv, l2-normed keys),
``rec_u`` [B, T, N, V] (update vectors) and ``rec_g`` [B, T, N, K] (cumulative log-decays from the piece's start).
The state and conv tails are then NOT advanced: they stay those of the piece's start, which is what a rollback
rebuilds from (so the records need no copy of them), and the cache is pending until ``rollback`` commits a prefix.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import KDA_IMPLS
from k3jax.layers import backends, lora
from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.ops import kda as kda_ops
from k3jax.ops.kda.recurrent import kda_recurrent_recorded
from k3jax.ops.norms import acc_dtype
from k3jax.ops.segments import runs

IMPLS = KDA_IMPLS

# The verify records a cache may carry per mode (module docstring; ``k3jax.model.rollback`` allocates them).
RECORDS = {"copy": ("rec_state", "rec_x"), "replay": ("rec_g", "rec_k", "rec_u", "rec_x")}

_QKV = ("embed", "heads", "head_dim")


def _core(impl, q, k, v, g, beta, *, scale, initial_state, chunk_size, gate_lower_bound, segment_ids=None):
    docs = {} if segment_ids is None else {"segment_ids": segment_ids}   # the no-document programs stay as they were
    if impl == "recurrent":
        return kda_ops.kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state, **docs)
    if impl == "chunked":
        return kda_ops.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   chunk_size=chunk_size, gate_lower_bound=gate_lower_bound, **docs)
    if impl == "pallas":
        return backends.kda_chunk_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         chunk_size=chunk_size, gate_lower_bound=gate_lower_bound, **docs)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _aligned(impl, q, k, v, g, beta, start, *, chunk_size, **kw):
    """The chunked core for the cached (prefill) path, on a piece whose row b continues a state of start[b] tokens.

    * The whole sequence's chunk grid: row b is shifted right by start[b] mod C behind no-op tokens (g = 0,
      beta = 0, q = k = v = 0: S stays exactly as it was), so its chunks end where a one-shot prefill's do, and the
      outputs are shifted back. The piece widens to a multiple of C holding T + C - 1 tokens (one chunk more).
    * Exact pairwise in-sub-chunk decays (``gate_lower_bound=None``) also for K3's bounded gate: the bounded
      factorisation (rows and columns scaled around one anchor) rounds each decay's exponent at |G| ~ 40 (k3-tiny's
      fp32 prefill logits: 1.5e-6 rel-RMS from float64, vs 6.6e-7 pairwise, as close as the token-by-token
      recurrence), and a prompt fed in pieces then differs from one prefill of it by 1.0e-6 at one cut chunk
      (pairwise: 5.6e-7). The cost is ~1.4-1.9x the KDA core's time on prefill (T = 4096, k3-mini's heads, this CPU);
      training keeps the faster factorisation (experiments/LOG.md, 2026-12-02)."""
    kw["gate_lower_bound"] = None
    B, T = q.shape[:2]
    C = chunk_size
    Tp = -(-(T + C - 1) // C) * C
    off = jnp.asarray(start, jnp.int32) % C
    src = jnp.arange(Tp, dtype=jnp.int32)[None, :] - off[:, None]             # [B, Tp]: source token or < 0 / >= T
    keep = (src >= 0) & (src < T)
    idx = jnp.clip(src, 0, T - 1)

    def shift(a):
        m = keep.reshape(keep.shape + (1,) * (a.ndim - 2))
        got = jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)
        return jnp.where(m, got, jnp.zeros((), a.dtype))

    o, S = _core(impl, shift(q), shift(k), shift(v), shift(g), shift(beta), chunk_size=C, **kw)
    back = jnp.arange(T, dtype=jnp.int32)[None, :] + off[:, None]
    return jnp.take_along_axis(o, back.reshape(back.shape + (1,) * (o.ndim - 2)), axis=1), S


def _recorded(us, ws, g, beta, cache, *, heads, scale):
    """The piece token by token from the cache's state and tails, filling the cache's record leaves (module
    docstring) → (o [B, T, N, V], the records). us: the pre-conv projections [B, T, N K] x 3; ws: the conv weights;
    g, beta: padding already made a no-op."""
    B, T = g.shape[:2]
    names = {n for n in cache if n.startswith("rec_")}
    if not names <= {*RECORDS["copy"], *RECORDS["replay"]}:
        raise ValueError(f"unknown verify record(s) {sorted(names - {*RECORDS['copy'], *RECORDS['replay']})}")
    for n in sorted(names):
        if cache[n].shape[1] != T:
            raise ValueError(f"verify record {n} {tuple(cache[n].shape)} was made for a piece of "
                             f"{cache[n].shape[1]} tokens; this piece has {T}")
    tails = [cache[n] for n in ("conv_q", "conv_k", "conv_v")]
    (q, _), (k, _), (v, _) = (kda_ops.causal_conv_silu(u, w, tail) for u, w, tail in zip(us, ws, tails, strict=True))
    q = kda_ops.l2norm(q.reshape(B, T, heads, -1))
    k = kda_ops.l2norm(k.reshape(B, T, heads, -1))
    v = v.reshape(B, T, heads, -1)
    o, _, u, states = kda_recurrent_recorded(q, k, v, g, beta, initial_state=cache["state"], scale=scale,
                                             keep_states="rec_state" in names)
    got = {"rec_x": jnp.concatenate(us, axis=-1), "rec_state": states, "rec_k": k, "rec_u": u,
           "rec_g": jnp.cumsum(g.astype(u.dtype), axis=1)}
    return o, {n: got[n].astype(cache[n].dtype) for n in names}


class KDA(nnx.Module):
    """Kimi Delta Attention token mixer; HF module ``self_attn.``."""

    LORA = ("wq", "wk", "wv", "w_gate", "wo")  # the projections an adapter may target (k3jax/layers/lora.py)
    HF = {
        "wq": HFLeaf("q_proj.weight"),
        "wk": HFLeaf("k_proj.weight"),
        "wv": HFLeaf("v_proj.weight"),
        "conv_q": HFLeaf("q_conv1d.weight", "conv", "F32k3"),
        "conv_k": HFLeaf("k_conv1d.weight", "conv", "F32k3"),
        "conv_v": HFLeaf("v_conv1d.weight", "conv", "F32k3"),
        "f_a": HFLeaf("f_a_proj.weight"),
        "f_b": HFLeaf("f_b_proj.weight"),
        "dt_bias": HFLeaf("dt_bias", "flat", "F32"),
        "A_log": HFLeaf("A_log", "A_log", "F32"),
        "w_beta": HFLeaf("b_proj.weight"),
        "w_gate": HFLeaf("g_proj.weight"),
        "g_a": HFLeaf("g_a_proj.weight"),
        "g_b": HFLeaf("g_b_proj.weight"),
        "o_norm": vec("o_norm.weight", "F32k3"),
        "wo": HFLeaf("o_proj.weight", in_axes=2),
    }

    def __init__(self, *, d: int, num_heads: int, head_dim: int, conv_size: int, full_rank_gate: bool,
                 gate_lower_bound: float | None, dtype=jnp.float32, rngs: nnx.Rngs):
        N, K = num_heads, head_dim
        f32 = acc_dtype(dtype)  # the release stores these F32: keep at least float32
        self.gate_lower_bound = gate_lower_bound
        bound = 1.0 / math.sqrt(conv_size)

        def conv():
            return param(jax.random.uniform(rngs.params(), (N * K, conv_size), f32, -bound, bound),
                         ("heads", "conv_tap"))  # channels are head-major, so they shard like heads

        self.wq = param(normal(rngs, (d, N, K), dtype), _QKV)
        self.wk = param(normal(rngs, (d, N, K), dtype), _QKV)
        self.wv = param(normal(rngs, (d, N, K), dtype), _QKV)
        self.conv_q, self.conv_k, self.conv_v = conv(), conv(), conv()
        self.f_a = param(normal(rngs, (d, K), dtype), ("embed", "kda_rank"))
        self.f_b = param(normal(rngs, (K, N, K), dtype), ("kda_rank", "heads", "head_dim"))
        dt = jnp.exp(jax.random.uniform(rngs.params(), (N, K), f32, math.log(1e-3), math.log(1e-1)))
        self.dt_bias = param((dt + jnp.log(-jnp.expm1(-dt))).astype(f32), ("heads", "head_dim"))  # softplus^-1
        if gate_lower_bound is None:
            A_log = jnp.log(jax.random.uniform(rngs.params(), (N,), f32, 1.0, 16.0))
        else:
            A_log = jnp.zeros((N,), f32)
        self.A_log = param(A_log, ("heads",))
        self.w_beta = param(normal(rngs, (d, N), dtype), ("embed", "heads"))
        if full_rank_gate:
            self.w_gate = param(normal(rngs, (d, N, K), dtype), _QKV)
        else:
            self.g_a = param(normal(rngs, (d, K), dtype), ("embed", "kda_rank"))
            self.g_b = param(normal(rngs, (K, N, K), dtype), ("kda_rank", "heads", "head_dim"))
        self.o_norm = param(jnp.ones((K,), f32), ("norm",))
        self.wo = param(normal(rngs, (N, K, d), dtype), ("heads", "head_dim", "embed"))

    def __call__(self, x, *, eps: float, impl: str = "chunked", chunk_size: int = 64, cache: dict | None = None,
                 lengths=None, start=None, segment_ids=None, context=None, rows=None, layer=None,
                 step_impl: str = "xla"):
        """x [B, T, D] normed layer input (any float dtype) → (y [B, T, D] in x.dtype, the new cache).

        eps: RMSNorm eps of the gated output norm (``rms_norm_eps``); impl: "recurrent" | "chunked" | "pallas"
        (interpret mode off-GPU); cache: None or a cache dict (module docstring; with ``rec_*`` leaves: a recorded
        verify piece); lengths: None (every token is real) or [B] int, the real tokens of each right-padded row.
        segment_ids: None, or [B, T] document ids of packed rows (``k3jax.ops.segments``): the state and the conv
        windows restart at every document boundary (training and scoring; not with a cache). context: None, or a
        ``ContextParallel`` (T split over devices: the convs and the core run per shard and combine their states,
        k3jax/sharding/context_parallel.py; a cached piece then continues the cache from any ``start`` on the
        shards' own chunk grids). rows: None, or a ``RowSplit`` the cache's rows are split by: the core runs on them
        between ``RowSplit.enter`` and ``leave`` (the stream may hold every row, k3jax/sharding/row_split.py).
        layer: None, or this layer's index in a cache whose state is stacked over layers (cache["state"]
        [L, B, N, K, V]; the other leaves are this layer's): the returned state is the stack with this layer's slice
        advanced. step_impl: a one-token step's "xla" update or "pallas" kernel (``backends.kda_decode_step``:
        the state read and written once, in place in its stack; per device under ``rows`` where it holds every head,
        ``RowSplit.heads_whole``; XLA's step on a GPU, under ``context`` and under rows with the heads split)."""
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if segment_ids is not None and (cache or lengths is not None or start is not None):
            raise ValueError("segment_ids (packed documents) runs a whole row from a zero state: no cache, "
                             "lengths or start")
        if x.ndim != 3:
            raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
        B, T, D = x.shape
        Dw, N, K = self.wq.shape
        if Dw != D:
            raise ValueError(f"x width {D} does not match wq {tuple(self.wq.shape)}")
        ct = acc_dtype(x.dtype)
        mm = lambda eq, a, b: jnp.einsum(eq, a, b[...], preferred_element_type=ct)  # noqa: E731
        cache = cache or {}
        us = [lora.proj(self, name, "btd,dnk->btnk", x, getattr(self, name)[...], ct).reshape(B, T, -1)
              for name in ("wq", "wk", "wv")]                                # head-major columns (docs/model.md §2.1)
        ws = [w[...] for w in (self.conv_q, self.conv_k, self.conv_v)]
        tails = [cache.get(n) for n in ("conv_q", "conv_k", "conv_v")]
        raw = jnp.einsum("btr,rnk->btnk", mm("btd,dr->btr", x, self.f_a), self.f_b[...],
                         preferred_element_type=ct)                                  # no activation between
        if self.gate_lower_bound is None:
            g = kda_ops.gate_softplus(raw, self.dt_bias[...], self.A_log[...])
        else:
            g = kda_ops.gate_safe(raw, self.dt_bias[...], self.A_log[...], self.gate_lower_bound)
        beta = jax.nn.sigmoid(mm("btd,dn->btn", x, self.w_beta))
        if rows is not None:                      # the cache's rows (a no-op unless the stream holds every row)
            us = [rows.enter(u, 2) for u in us]
            g, beta = rows.enter(g, 2), rows.enter(beta, 2)
        if lengths is not None:                                     # padding: g = 0, beta = 0 keeps S unchanged
            real = jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None]
            g = jnp.where(real[:, :, None, None], g, 0.0)
            beta = jnp.where(real[:, :, None], beta, 0.0)
        scale = K ** -0.5
        stack = cache.get("state") if layer is not None else None
        state = cache.get("state") if stack is None else stack[layer]
        records = {}
        if any(n.startswith("rec_") for n in cache):                       # a verify piece (module docstring)
            if context is not None or state is None:
                raise ValueError("verify records need a cache's state and one device (no context split)")
            o, records = _recorded(us, ws, g, beta, {**cache, "state": state}, heads=N, scale=scale)
            S, (tq, tk, tv) = state, tails                                  # committed later by rollback
        elif context is not None and not (state is not None and T == 1):
            core = functools.partial(_core, impl, scale=scale, chunk_size=chunk_size,
                                     gate_lower_bound=self.gate_lower_bound)
            o, S, (tq, tk, tv) = context.kda(core, us, ws, g, beta, heads=N, tails=None if not cache else tails,
                                             state=state, lengths=lengths, segment_ids=segment_ids)
        else:
            run = None if segment_ids is None else runs(segment_ids)
            (q, tq), (k, tk), (v, tv) = (kda_ops.causal_conv_silu(u, w, tail, lengths, run)
                                         for u, w, tail in zip(us, ws, tails, strict=True))
            q = kda_ops.l2norm(q.reshape(B, T, N, K))
            k = kda_ops.l2norm(k.reshape(B, T, N, K))
            v = v.reshape(B, T, N, -1)
            if state is not None and T == 1:
                kernel = step_impl == "pallas" and context is None and (rows is None or rows.heads_whole)
                step = backends.kda_decode_step(scale=scale) if kernel else None
                if step is None:
                    o, S = kda_ops.kda_step(q, k, v, g, beta, state, scale=scale)
                else:                                     # an unstacked state is a stack of one
                    states, at = (state[None], 0) if stack is None else (stack, layer)
                    args = (*(a[:, 0] for a in (q, k, v, g, beta)), states, at)
                    o, states = step(*args) if rows is None else rows.kda_step(step, *args)
                    o = o[:, None].astype(q.dtype)
                    S, stack = (states[0], None) if stack is None else (None, states)
            elif start is not None and impl != "recurrent":
                o, S = _aligned(impl, q, k, v, g, beta, start, scale=scale, initial_state=state,
                                chunk_size=chunk_size)
            else:
                o, S = _core(impl, q, k, v, g, beta, scale=scale, initial_state=state, chunk_size=chunk_size,
                             gate_lower_bound=self.gate_lower_bound, segment_ids=segment_ids)
        o = o.astype(ct)
        gather_first = rows is not None and not rows.heads_whole    # the output norm and gate after the gather
        o = rows.leave(o, 2) if gather_first else o
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * self.o_norm[...].astype(ct)
        if hasattr(self, "w_gate"):
            gate = lora.proj(self, "w_gate", "btd,dnk->btnk", x, self.w_gate[...], ct)
        else:
            gate = jnp.einsum("btr,rnk->btnk", mm("btd,dr->btr", x, self.g_a), self.g_b[...],
                              preferred_element_type=ct)
        if rows is not None and not gather_first:     # per row, then the rows' gather (``RowSplit.heads_whole``)
            o = rows.leave(o * jax.nn.sigmoid(rows.enter(gate, 2)), 2)
        else:
            o = o * jax.nn.sigmoid(gate)
        y = lora.proj(self, "wo", "btnk,nkd->btd", o, self.wo[...], ct)
        if stack is not None:                         # the stacked state: this layer's slice advanced (in place)
            S = stack if S is None else jax.lax.dynamic_update_index_in_dim(stack, S.astype(stack.dtype), layer, 0)
        return y.astype(x.dtype), {"state": S, "conv_q": tq, "conv_k": tk, "conv_v": tv, **records}


__all__ = ["IMPLS", "KDA", "RECORDS"]
