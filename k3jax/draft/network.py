"""The DSpark draft network (``DraftModel``): a few dense RoPE-MLA layers that draft K tokens in one forward from the
target's hidden states, the target's embedding and the target's lm_head.

    cache = draft_cache(dcfg, batch=B, capacity=S, dtype=jnp.bfloat16)
    cache = model.append_context(cache, taps, lengths)               # target taps [B, T, n, Dt] of new positions
    base, h = model.propose(cache, anchor_ids, embed=E, head=H)      # [B, K, W] f32, [B, K, D]
    logits_k = base[:, k] + model.markov_bias(prev_k)                # prev: the anchor, then each drafted token
    logits, conf = model.train_logits(taps, tokens, anchors, embed=E, head=H)   # many blocks per row, one forward

Context. A target position t contributes the feature f_t = context_norm(context_proj([h_t^(l) for l in taps]))
(the taps concatenated in ``target_layer_ids`` order). Each draft layer projects f_t with ITS OWN kv_a (no input
norm: f_t is normed already) into a latent c_t = kv_a_layernorm(f_t W_kva[:, :R]) and a rope key k_t = RoPE(f_t
W_kva[:, R:], t). ``append_context`` writes them into the layer's cache (k already rotated at its position).

Block. The anchor (the last emitted token, at position P = context length) and K mask tokens, at positions P .. P+K,
enter as the target's embeddings. Each layer is pre-norm MLA + GLU MLP on a standard residual; the block's queries
attend to every context key of the row (positions < P) and to every block position (NON-causal inside the block:
slot i sees slots after it). Slot i (1..K) after ``final_norm`` and the target's lm_head gives the base logits of
the token at P + i; the anchor slot's output is unused. The rank-r Markov head adds W2 · W1[prev] with prev the
token before the predicted one (the anchor for slot 1); ``propose`` leaves that to the sampler (prev is the token it
just drafted), ``train_logits`` adds it teacher-forced (prev = tokens[P + i - 1]).

Attention is written plainly: keys materialised from the latents through kv_b (``latent_attention_dense``), one
dense masked softmax over [context keys | block keys]; the draft is small. Scores are (q^N·k^N + q^R·k^R) ·
attn_scale / sqrt(Hn + Hr), with YaRN's attn_scale (k3jax/ops/rope.py).

The confidence head σ(w · [h_i, W1[prev]] + b) estimates whether slot i's token will be accepted. It is trained and
exported; speculative decoding does not use it to schedule (every block is verified at full width).

Dtypes: parameters in ``dtype``; the residual stream, scores, softmax and logits in fp32 (at least); the normed
layer inputs, matmul operands and cached latents in ``compute_dtype`` (as k3jax/layers/mla.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.draft.config import DraftConfig
from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.layers.ffn import GLU
from k3jax.layers.mla import MLA
from k3jax.ops.norms import acc_dtype, rms_norm
from k3jax.ops.rope import RopeSpec, apply_rope, rope_spec


def draft_cache(dcfg: DraftConfig, batch: int, capacity: int, dtype=jnp.float32) -> dict:
    """An empty draft cache: per layer the latent ``c_kv`` [B, S, R] and the rotated rope key ``k_rope`` [B, S, Hr]
    of each context position, and ``lengths`` [B] int32 (context positions held per row)."""
    B, S = batch, capacity
    layer = lambda: {"c_kv": jnp.zeros((B, S, dcfg.kv_lora_rank), dtype),  # noqa: E731
                     "k_rope": jnp.zeros((B, S, dcfg.qk_rope_head_dim), dtype)}
    return {"layers": [layer() for _ in range(dcfg.num_hidden_layers)], "lengths": jnp.zeros((B,), jnp.int32)}


def latent_attention_dense(q_nope, q_rope, c_kv, k_rope, kv_b, mask, *, scale: float):
    """Masked softmax attention over latent keys, keys and values materialised through kv_b.

    q_nope: [B, Q, N, Hn]; q_rope: [B, Q, N, Hr] (rotated); c_kv: [B, S, R] (compute dtype); k_rope: [B, S, Hr]
    (rotated, one per key, shared by the heads); kv_b: [R, N, Hn+V]; mask: [B, Q, S] bool, at least one True per
    query. Returns o [B, Q, N, V] in the accumulation dtype.
    """
    acc = acc_dtype(c_kv.dtype)
    Hn = q_nope.shape[-1]
    kv = jnp.einsum("bsr,rnh->bsnh", c_kv, kv_b.astype(c_kv.dtype), preferred_element_type=acc)
    s = (jnp.einsum("bqnh,bsnh->bnqs", q_nope.astype(acc), kv[..., :Hn])
         + jnp.einsum("bqnh,bsh->bnqs", q_rope.astype(acc), k_rope.astype(acc))) * scale
    s = jnp.where(mask[:, None], s, jnp.finfo(acc).min)
    return jnp.einsum("bnqs,bsnv->bqnv", jax.nn.softmax(s, axis=-1), kv[..., Hn:])


class DraftLayer(nnx.Module):
    """One draft layer; HF module ``layers.{i}.``."""

    HF = {"input_norm": vec("input_layernorm.weight"), "post_norm": vec("post_attention_layernorm.weight"),
          "attn": "self_attn.", "mlp": "mlp."}

    def __init__(self, dcfg: DraftConfig, dtype, *, rngs: nnx.Rngs):
        D = dcfg.hidden_size
        self.input_norm = param(jnp.ones((D,), dtype), ("norm",))
        self.post_norm = param(jnp.ones((D,), dtype), ("norm",))
        self.attn = MLA(d=D, num_heads=dcfg.num_attention_heads, q_lora_rank=dcfg.q_lora_rank,
                        kv_lora_rank=dcfg.kv_lora_rank, qk_nope_head_dim=dcfg.qk_nope_head_dim,
                        qk_rope_head_dim=dcfg.qk_rope_head_dim, v_head_dim=dcfg.v_head_dim, output_gate=False,
                        dtype=dtype, rngs=rngs)
        self.mlp = GLU(d=D, hidden=dcfg.intermediate_size, dtype=dtype, rngs=rngs)

    def latents(self, f, positions, rope: RopeSpec, eps: float):
        """Context features f [B, T, D] (compute dtype) at positions [B, T] → (c_kv [B, T, R] in f.dtype,
        k_rope [B, T, Hr] rotated, fp32)."""
        acc = acc_dtype(f.dtype)
        R = self.attn.kv_a_norm.shape[0]
        ckv = jnp.einsum("btd,dr->btr", f, self.attn.kv_a[...].astype(f.dtype), preferred_element_type=acc)
        return rms_norm(ckv[..., :R], self.attn.kv_a_norm[...], eps, out_dtype=f.dtype), apply_rope(
            ckv[..., R:], positions, rope)

    def __call__(self, h, positions, keys, mask, *, rope: RopeSpec, eps: float, act: str, cdt):
        """h [B, Q, D] residual (fp32) of block tokens at positions [B, Q]; keys (c_kv [B, S, R], k_rope [B, S, Hr])
        of the context; mask [B, Q, S + Q] over [context | block] keys → the new residual [B, Q, D]."""
        acc = h.dtype
        N, Hn, Hr, V = self.attn.dims
        x = rms_norm(h, self.input_norm[...], eps, out_dtype=cdt)
        q, c_blk, kr_blk = self.attn.project(x, eps)           # the block's own latents, as the context's
        c_all = jnp.concatenate([keys[0].astype(cdt), c_blk], axis=1)
        kr_all = jnp.concatenate([keys[1].astype(acc), apply_rope(kr_blk, positions, rope)], axis=1)
        o = latent_attention_dense(q[..., :Hn], apply_rope(q[..., Hn:], positions, rope), c_all, kr_all,
                                   self.attn.kv_b[...], mask, scale=rope.attn_scale / math.sqrt(Hn + Hr))
        h = h + self.attn.output(x, o).astype(acc)             # no output gate: o @ W_o
        return h + self.mlp(rms_norm(h, self.post_norm[...], eps, out_dtype=cdt), act=act).astype(acc)


class DraftModel(nnx.Module):
    """The DSpark draft; HF names have no ``model.`` prefix (k3jax/draft/io.py)."""

    HF = {
        "context_proj": HFLeaf("context_proj.weight"),
        "context_norm": vec("context_norm.weight"),
        "layers": "layers.",
        "final_norm": vec("final_norm.weight"),
        "markov_w1": vec("markov_head.markov_w1.weight"),
        "markov_w2": vec("markov_head.markov_w2.weight"),
        "conf_w": HFLeaf("confidence_head.proj.weight", "row"),
        "conf_b": vec("confidence_head.proj.bias"),
    }

    def __init__(self, dcfg: DraftConfig, *, dtype=jnp.float32, compute_dtype=None, rngs: nnx.Rngs):
        self.dcfg = dcfg
        self.compute_dtype = jnp.dtype(compute_dtype or dtype)
        self.rope = rope_spec(dcfg.qk_rope_head_dim, dcfg.rope_theta, dcfg.rope_scaling)
        D, W, r = dcfg.hidden_size, dcfg.vocab_size, dcfg.markov_rank
        # [n * Dt, D]: the concatenated taps are a wide input, split like an MLP's hidden
        self.context_proj = param(normal(rngs, (dcfg.num_target_layers * dcfg.target_hidden_size, D), dtype),
                                  ("mlp", "embed"))
        self.context_norm = param(jnp.ones((D,), dtype), ("norm",))
        self.layers = nnx.List([DraftLayer(dcfg, dtype, rngs=rngs) for _ in range(dcfg.num_hidden_layers)])
        self.final_norm = param(jnp.ones((D,), dtype), ("norm",))
        # W1 [W, r] is an embedding table, W2 [W, r] (torch's [out, in]) the bias head; the rank is never split
        self.markov_w1 = param(normal(rngs, (W, r), dtype), ("vocab", "head_dim"))
        self.markov_w2 = param(normal(rngs, (W, r), dtype), ("vocab", "head_dim"))
        if dcfg.enable_confidence_head:
            self.conf_w = param(normal(rngs, (dcfg.confidence_width,), dtype), ("norm",))
            self.conf_b = param(jnp.zeros((1,), dtype), ("norm",))

    # --------------------------------------------------------------------------------------------- pieces
    def features(self, taps):
        """taps [B, T, n, Dt] (any float dtype) → context features [B, T, D] in the compute dtype."""
        cdt, eps = self.compute_dtype, self.dcfg.rms_norm_eps
        B, T, n, Dt = taps.shape
        x = taps.reshape(B, T, n * Dt).astype(cdt)
        f = jnp.einsum("btk,kd->btd", x, self.context_proj[...].astype(cdt), preferred_element_type=acc_dtype(cdt))
        return rms_norm(f, self.context_norm[...], eps, out_dtype=cdt)

    def markov_bias(self, prev_ids):
        """prev_ids [...] int → W2 · W1[prev] [..., W] fp32."""
        cdt = self.compute_dtype
        e = self.markov_w1[...][prev_ids].astype(cdt)
        return jnp.einsum("...r,wr->...w", e, self.markov_w2[...].astype(cdt), preferred_element_type=acc_dtype(cdt))

    def confidence(self, h, prev_ids):
        """h [..., D] (a slot's final-normed hidden state), prev_ids [...] → P(slot accepted) [...] fp32."""
        if not self.dcfg.enable_confidence_head:
            raise ValueError("this draft has no confidence head (enable_confidence_head is false)")
        acc = acc_dtype(self.compute_dtype)
        D = self.dcfg.hidden_size
        w = self.conf_w[...].astype(acc)
        z = jnp.einsum("...d,d->...", h.astype(acc), w[:D])
        if self.dcfg.confidence_head_with_markov:
            z = z + jnp.einsum("...r,r->...", self.markov_w1[...][prev_ids].astype(acc), w[D:])
        return jax.nn.sigmoid(z + self.conf_b[...][0].astype(acc))

    def _block(self, tokens, positions, keys, ctx_mask, blk_mask, embed, pin=None):
        """Block tokens [B, Q] at positions [B, Q] over context keys (per layer (c_kv [B, S, R], k_rope [B, S, Hr]))
        with masks [B, Q, S] / [B, Q, Q] → final-normed h [B, Q, D] in the compute dtype. ``pin``: a sharding
        constraint for the embedded tokens [B, Q, D] (``propose``)."""
        d, cdt = self.dcfg, self.compute_dtype
        h = embed[tokens].astype(acc_dtype(cdt))
        h = h if pin is None else pin(h)
        mask = jnp.concatenate([ctx_mask, blk_mask], axis=-1)
        for layer, kv in zip(self.layers, keys, strict=True):
            h = layer(h, positions, kv, mask, rope=self.rope, eps=d.rms_norm_eps, act=d.hidden_act, cdt=cdt)
        return rms_norm(h, self.final_norm[...], d.rms_norm_eps, out_dtype=cdt)

    def _logits(self, h, head):
        cdt = self.compute_dtype
        return jnp.einsum("...d,dw->...w", h, head.astype(cdt), preferred_element_type=acc_dtype(cdt))

    # --------------------------------------------------------------------------------------------- inference
    def append_context(self, cache: dict, taps, lengths) -> dict:
        """Write the features of a right-padded piece of context into the cache.

        taps [B, T, n, Dt]: the target's tapped hidden states of the piece; lengths [B]: its real positions per row
        (the rest is padding, written nowhere). Row b's token t lands at position cache["lengths"][b] + t; positions
        past the capacity are dropped. Returns the cache with lengths advanced by ``lengths``."""
        start = cache["lengths"]
        lengths = jnp.asarray(lengths, jnp.int32)
        B, T = taps.shape[:2]
        f = self.features(taps)
        t = jnp.arange(T, dtype=jnp.int32)[None, :]
        pos = start[:, None] + t
        rows = jnp.arange(B)[:, None]
        layers = []
        for layer, lc in zip(self.layers, cache["layers"], strict=True):
            dest = jnp.where(t < lengths[:, None], pos, lc["c_kv"].shape[1])   # padding → out of range: dropped
            c, kr = layer.latents(f, pos, self.rope, self.dcfg.rms_norm_eps)
            layers.append({"c_kv": lc["c_kv"].at[rows, dest].set(c.astype(lc["c_kv"].dtype), mode="drop"),
                           "k_rope": lc["k_rope"].at[rows, dest].set(kr.astype(lc["k_rope"].dtype), mode="drop")})
        return {"layers": layers, "lengths": start + lengths}

    def propose(self, cache: dict, anchor_ids, *, embed, head, pin=None):
        """One block per row: [anchor, mask x K] at positions cache["lengths"] + 0..K over the row's context.

        anchor_ids [B] int; embed [W, Dt] and head [Dt, W]: the target's. Returns (base_logits [B, K, W] fp32, the
        slots' final-normed hidden states h [B, K, D]); slot k predicts the token at position lengths + k + 1 (add
        ``markov_bias`` of the token before it). ``pin`` (on a mesh): h [B, K + 1, D] constrained to a sharding
        after the embedding's gather, which otherwise leaves it as the table's split makes it."""
        d = self.dcfg
        K = d.block_size
        anchor_ids = jnp.asarray(anchor_ids, jnp.int32)
        B = anchor_ids.shape[0]
        tokens = jnp.concatenate([anchor_ids[:, None], jnp.full((B, K), d.mask_token_id, jnp.int32)], axis=1)
        start = cache["lengths"]
        pos = start[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None, :]
        S = cache["layers"][0]["c_kv"].shape[1]
        ctx_mask = jnp.broadcast_to(jnp.arange(S)[None, None, :] < start[:, None, None], (B, K + 1, S))
        keys = [(lc["c_kv"], lc["k_rope"]) for lc in cache["layers"]]
        h = self._block(tokens, pos, keys, ctx_mask, jnp.ones((B, K + 1, K + 1), bool), embed, pin)[:, 1:]
        return self._logits(h, head), h

    # --------------------------------------------------------------------------------------------- training
    def train_logits(self, taps, tokens, anchors, *, embed, head, segment_ids=None):
        """Many blocks per sequence in one forward, teacher-forced.

        taps [B, T, n, Dt]: the target's tapped hidden states of every position; tokens [B, T]; anchors [B, A]:
        anchor positions P in [0, T) (block a: [tokens[P], mask x K] at P .. P+K, attending to context positions
        < P, in the anchor's document when ``segment_ids`` [B, T] is given, and to its own block only).
        Returns (logits [B, A, K, W] fp32 = base + markov_bias(tokens[P + i - 1]) for slot i = 1..K, conf
        [B, A, K] fp32 or None without a confidence head). Slots whose position P + i is past T - 1 have no label;
        their values are finite and the loss must mask them."""
        d = self.dcfg
        K, Q = d.block_size, d.block_size + 1
        tokens = jnp.asarray(tokens, jnp.int32)
        anchors = jnp.asarray(anchors, jnp.int32)
        B, T = tokens.shape
        A = anchors.shape[1]
        f = self.features(taps)
        tpos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
        keys = [layer.latents(f, tpos, self.rope, d.rms_norm_eps) for layer in self.layers]
        at = jnp.clip(anchors, 0, T - 1)
        first = jnp.take_along_axis(tokens, at, axis=1)                                          # [B, A]
        block = jnp.concatenate([first[..., None], jnp.full((B, A, K), d.mask_token_id, jnp.int32)], axis=-1)
        pos = (anchors[..., None] + jnp.arange(Q, dtype=jnp.int32)).reshape(B, A * Q)
        q_anchor = jnp.repeat(anchors, Q, axis=1)                                                # [B, A*Q]
        ctx_mask = jnp.arange(T)[None, None, :] < q_anchor[:, :, None]                           # [B, A*Q, T]
        if segment_ids is not None:
            seg = jnp.asarray(segment_ids)
            q_seg = jnp.repeat(jnp.take_along_axis(seg, at, axis=1), Q, axis=1)
            ctx_mask = ctx_mask & (seg[:, None, :] == q_seg[:, :, None])
        which = jnp.arange(A * Q) // Q
        blk_mask = jnp.broadcast_to(which[:, None] == which[None, :], (B, A * Q, A * Q))
        h = self._block(block.reshape(B, A * Q), pos, keys, ctx_mask, blk_mask, embed)
        h = h.reshape(B, A, Q, -1)[:, :, 1:]                                                     # [B, A, K, D]
        prev_at = jnp.clip(anchors[..., None] + jnp.arange(K, dtype=jnp.int32), 0, T - 1)       # P + i - 1
        prev = jnp.take_along_axis(tokens, prev_at.reshape(B, A * K), axis=1).reshape(B, A, K)
        logits = self._logits(h, head) + self.markov_bias(prev)
        conf = self.confidence(h, prev) if d.enable_confidence_head else None
        return logits, conf


__all__ = ["DraftLayer", "DraftModel", "draft_cache", "latent_attention_dense"]
