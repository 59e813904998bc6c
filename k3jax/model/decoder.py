"""One decoder layer (token mixer + FFN, their norms and AttnRes queries) and the stacked group of layers.

    layer = {"input_norm": [D], "post_norm": [D], "attn_res" / "mlp_res": AttnResQuery (AttnRes only),
             "kda": KDA | "mla": MLA,  "mlp": GLU | "moe": MoE}
    carry, (mixer_aux, ffn_aux) = layer(carry, l, mixer, cfg, run, dispatch)   # one layer on the residual carry

A layer holds only what its parameters need; which layer index it is (and so where AttnRes commits a block) is the
caller's, so the same class is vmapped into the stack. Its ``__call__`` owns the residual wiring, written once for the
plain residual and both AttnRes forms (k3jax/model/residual.py): the unrolled stack, the scanned one and the cached
``extend`` all call it, with their own token-mixer call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config, LoRAConfig, RunConfig
from k3jax.layers.attn_res import AttnResQuery
from k3jax.layers.common import param, vec
from k3jax.layers.ffn import GLU
from k3jax.layers.kda import KDA
from k3jax.layers.lora import add_adapters, dropout_scope
from k3jax.layers.mla import MLA
from k3jax.layers.moe import MoE
from k3jax.model.layout import layer_kind
from k3jax.model.residual import unpinned
from k3jax.ops.lora import LoraDropout
from k3jax.ops.norms import rms_norm


class DecoderLayer(nnx.Module):
    """HF module ``model.layers.{l}.``."""

    HF = {
        "input_norm": vec("input_layernorm.weight"),
        "post_norm": vec("post_attention_layernorm.weight"),
        "attn_res": "self_attention_res",
        "mlp_res": "mlp_res",
        "kda": "self_attn.",
        "mla": "self_attn.",
        "mlp": "mlp.",
        "moe": "block_sparse_moe.",
    }

    def __init__(self, cfg: K3Config, kind: tuple[str, str], dtype, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        mixer, ffn = kind
        self.input_norm = param(jnp.ones((d,), dtype), ("norm",))
        self.post_norm = param(jnp.ones((d,), dtype), ("norm",))
        if cfg.uses_attn_res:
            self.attn_res = AttnResQuery(d, dtype)
            self.mlp_res = AttnResQuery(d, dtype)
        if mixer == "mla":
            self.mla = MLA(d=d, num_heads=cfg.mla_num_heads, q_lora_rank=cfg.q_lora_rank,
                           kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                           qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                           output_gate=cfg.mla_output_gate, dtype=dtype, rngs=rngs)
        else:
            self.kda = KDA(d=d, num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim, conv_size=cfg.kda_conv_size,
                           full_rank_gate=cfg.kda_full_rank_gate, gate_lower_bound=cfg.kda_gate_lower_bound,
                           dtype=dtype, rngs=rngs)
        if ffn == "moe":
            self.moe = MoE(d=d, num_experts=cfg.num_experts, expert_hidden=cfg.moe_intermediate_size,
                           num_shared=cfg.num_shared_experts, latent=cfg.routed_expert_hidden_size,
                           latent_norm=cfg.latent_moe_use_norm, dtype=dtype, rngs=rngs)
        else:
            self.mlp = GLU(d=d, hidden=cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, carry, l, mixer, cfg: K3Config, run: RunConfig, dispatch, pin=unpinned,
                 dropout: LoraDropout | None = None, mix_gram: bool = False):
        """Layer l on the residual carry (``residual.Stream`` / ``Blocks`` / ``Buffer``; l traced for a ``Buffer``)
        → (the new carry, (token mixer aux, FFN aux)). Pre-norm sublayers: the token mixer reads the carry's mix
        through ``attn_res`` (AttnRes commits its block at l mod S = 0 first), the FFN through ``mlp_res``, and each
        adds its output to the stream.

        ``mixer(layer, x)``: the token mixer on the normed input → (y, aux): ``mixer`` or ``mixer_cached`` bound by
        the caller; the layer is handed back because under remat it is this one merged inside the checkpoint.
        ``dispatch``: the FFN's (``ffn``). ``pin``: constrains stream arrays to the token sharding. ``dropout``: the
        forward's LoRA dropout (training), folded with l here and in scope around the mixer and the FFN, so that
        every layer's adapters draw their own masks (k3jax/layers/lora.py); None: none. ``mix_gram``: each norm
        takes its mean square from the AttnRes mix before it (the Gram form, ``k3jax.ops.attn_res``; short pieces)."""
        eps, size, cdt = cfg.rms_norm_eps, cfg.attn_res_block_size, jnp.dtype(run.compute_dtype)
        drop = None if dropout is None else dropout.fold(l)
        x, carry, mark = carry.enter(getattr(self, "attn_res", None), l, size, eps, pin, with_ms=mix_gram)
        x, ms = x if mix_gram else (x, None)
        with dropout_scope(drop):
            a, ax = mixer(self, rms_norm(x, self.input_norm[...], eps, out_dtype=cdt, ms=ms))
        carry = carry.add(a, pin)
        x = carry.ffn_input(getattr(self, "mlp_res", None), mark, eps, with_ms=mix_gram)
        x, ms = x if mix_gram else (x, None)
        with dropout_scope(drop):
            f, fx = self.ffn(rms_norm(x, self.post_norm[...], eps, out_dtype=cdt, ms=ms), cfg, run, dispatch)
        return carry.add(f, pin), (ax, fx)

    def add_lora(self, lora: LoRAConfig, rngs: nnx.Rngs) -> None:
        """LoRA adapters on the blocks ``lora.targets`` name (k3jax/layers/lora.py); works on a stacked group's
        layer too (each layer of the stack gets its own factors); ``lora.experts_shared_a``: one A per routed stack,
        shared by its experts."""
        kw = dict(rank=lora.rank, scale=lora.scale, rngs=rngs)
        blocks = [("attn", getattr(self, "kda", None)), ("attn", getattr(self, "mla", None)),
                  ("dense", getattr(self, "mlp", None))]
        if hasattr(self, "moe"):
            blocks += [("shared", getattr(self.moe, "shared", None)), ("experts", self.moe.experts)]
        for target, block in blocks:
            if block is not None and target in lora.targets:
                add_adapters(block, **kw, shared_a=target == "experts" and lora.experts_shared_a)

    def mixer(self, h, cfg: K3Config, run: RunConfig, segment_ids=None, context=None, rows=None):
        """Token mixer on the normed input h → (y, aux). ``segment_ids`` [B, T]: packed documents, each mixed on
        its own (``k3jax.ops.segments``). ``context``: a ``ContextParallel`` (the sequence split over devices).
        ``rows``: a ``RowSplit`` (whole sequences per device), where MLA's flash kernel runs per device."""
        docs = {} if segment_ids is None else {"segment_ids": segment_ids}
        if context is not None:
            docs["context"] = context
        if hasattr(self, "mla"):
            y, max_logit = self.mla(h, norm_eps=cfg.mla_norm_eps, block_size=run.mla_block_size, impl=run.mla_impl,
                                    rows=rows, **docs)
            return y, {"mla_max_logit": max_logit}
        y, _ = self.kda(h, eps=cfg.rms_norm_eps, impl=run.kda_impl, chunk_size=run.kda_chunk_size, **docs)
        return y, {}

    def mixer_cached(self, h, cfg: K3Config, run: RunConfig, cache: dict, *, start, lengths, absorbed: bool,
                     layer=None, context=None, rows=None):
        """Token mixer on a right-padded piece that continues the layer's cache → (y, the updated layer cache).

        start [B]: tokens already in the cache per row; lengths [B]: real tokens of the piece per row. layer: None,
        or the index of this layer's slice in a cache stacked over the scanned groups (``model.cache``): MLA
        writes and reads its latent in the stack in place; KDA's conv tails are small and are sliced out and written
        back, its state is advanced in the stack (in place by the decode kernel). context: a ``ContextParallel``
        (the piece split over devices), or None. rows: a ``RowSplit`` (the caches' rows split over devices; the
        stream's too unless ``stream_whole``), where KDA's core and MLA's attention run per row shard, or None."""
        if rows is not None and rows.stream_whole:   # the projections see every row (``RowSplit.enter``)
            h = rows.whole(h)
        if hasattr(self, "mla"):
            return self.mla.extend(h, cache, start=start, lengths=lengths, norm_eps=cfg.mla_norm_eps,
                                   block_size=run.mla_block_size, absorbed=absorbed, layer=layer, context=context,
                                   impl=run.mla_impl, rows=rows)
        # stacked: the state stays whole (KDA advances its slice, in place under the decode kernel), the rest sliced
        mine = cache if layer is None else {n: x if n == "state" else x[layer] for n, x in cache.items()}
        y, new = self.kda(h, eps=cfg.rms_norm_eps, impl=run.kda_impl, chunk_size=run.kda_chunk_size, cache=mine,
                          lengths=lengths, start=start, context=context, rows=rows, layer=layer,
                          step_impl=run.kda_step_impl)
        if layer is not None:
            new = {n: x if n == "state" else jax.lax.dynamic_update_index_in_dim(cache[n], x.astype(cache[n].dtype),
                                                                                   layer, 0)
                   for n, x in new.items()}
        return y, new

    def ffn(self, h, cfg: K3Config, run: RunConfig, dispatch):
        """FFN on the normed input h → (y, aux)."""
        kw = dict(act=cfg.hidden_act, beta1=cfg.situ_beta, beta2=cfg.situ_linear_beta)
        if hasattr(self, "moe"):
            y, routing = self.moe(h, top_k=cfg.num_experts_per_token, renormalize=cfg.moe_renormalize,
                                  scaling_factor=cfg.routed_scaling_factor, norm_eps=cfg.rms_norm_eps,
                                  dispatch=dispatch, qat=run.qat, qat_weight_rule=run.qat_weight_rule,
                                  qat_act_rule=run.qat_act_rule, **kw)
            return y, {"routing": routing}
        return self.mlp(h, **kw), {}


class Group(nnx.Module):
    """One period of the repeating schedule (K3: [KDA, KDA, KDA, MLA]); vmapped into the stack."""

    HF = {"layers": None}  # its layers are named by layer index (k3jax.model.layout)

    def __init__(self, cfg: K3Config, layers: tuple[int, ...], dtype, *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, layer_kind(cfg, l), dtype, rngs=rngs) for l in layers])


__all__ = ["DecoderLayer", "Group"]
