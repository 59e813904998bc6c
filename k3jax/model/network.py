"""The K3 network as an NNX module (SPEC §1.3): embedding, the decoder layers in the stacked layout
(k3jax/model/layout.py), the output AttnRes mix, the final norm and the LM head.

    model = K3Model(cfg, rngs=nnx.Rngs(0))              # run settings: K3Model(cfg, run=RunConfig(...), ...)
    logits = model(tokens)                               # [B, T, W] float32 (or wider)
    logits, aux = model(tokens, return_aux=True)         # aux["routing"]: one Routing per MoE layer (layer order)
                                                         # aux["mla_max_logit"]: [B, N] per MLA layer

With AttnRes (K3, SPEC §1.3 / §3.2) there is no classic residual: sublayer outputs accumulate into the running
block sum ``part``; committed block sums form ``blocks``; every sublayer input is an AttnRes mix of
``blocks ++ [part]``. Sources and partial sums are kept in at-least-fp32. Without AttnRes (Kimi-Linear) the
standard pre-norm residual is used. The model reads ``K3Config`` (architecture) and ``RunConfig`` (dtypes,
kernels, dispatch, QAT, block sizes; default: the preset's, ``config.default_run``); blocks get plain arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config, RunConfig, default_run
from k3jax.layers.attn_res import AttnResQuery
from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.model.decoder import DecoderLayer, Group
from k3jax.model.layout import layer_kind, layout
from k3jax.ops.norms import acc_dtype, rms_norm


class K3Model(nnx.Module):
    """HF: the layout prefix (``language_model.`` for K3) + these names; layers ``model.layers.{l}.``."""

    HF = {
        "embed": vec("model.embed_tokens.weight"),
        "lm_head": HFLeaf("lm_head.weight"),
        "final_norm": vec("model.norm.weight"),
        "out_res": "model.output_attn_res",
        "pre": None, "groups": None, "post": None,  # decoder layers: ``model.layers.{l}.`` (see layout.py)
    }

    def __init__(self, cfg: K3Config, run: RunConfig | None = None, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.run = run = default_run(cfg) if run is None else run
        dtype = jnp.dtype(run.param_dtype)
        d, W = cfg.hidden_size, cfg.vocab_size
        lay = layout(cfg)
        self.embed = param(normal(rngs, (W, d), dtype), ("vocab", "embed"))
        self.pre = nnx.List([DecoderLayer(cfg, layer_kind(cfg, l), dtype, rngs=rngs) for l in lay.pre])
        if lay.groups:
            first = tuple(range(lay.start, lay.start + lay.period))

            @nnx.split_rngs(splits=lay.groups)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(r):
                return Group(cfg, first, dtype, rngs=r)

            self.groups = stacked(rngs)
            for _, var in nnx.to_flat_state(nnx.state(self.groups, nnx.Param)):
                var.set_metadata("axes", ("layers", *var.get_metadata()["axes"]))
        self.post = nnx.List([DecoderLayer(cfg, layer_kind(cfg, l), dtype, rngs=rngs) for l in lay.post])
        self.final_norm = param(jnp.ones((d,), dtype), ("norm",))
        if cfg.uses_attn_res:
            self.out_res = AttnResQuery(d, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(normal(rngs, (d, W), dtype), ("embed", "vocab"))

    def layers(self):
        """(layer index, DecoderLayer) in layer order; stacked layers are sliced out of the stack."""
        lay = layout(self.cfg)
        out = list(zip(lay.pre, self.pre, strict=True))
        if lay.groups:
            # Only the Params are stacked; other variables a wrapper attaches (e.g. qwix's Rngs) are not sliced.
            gdef, gparams, grest = nnx.split(self.groups, nnx.Param, ...)
            for g in range(lay.groups):
                grp = nnx.merge(gdef, jax.tree.map(lambda x, g=g: x[g], gparams), grest)
                out += [(lay.start + g * lay.period + j, layer) for j, layer in enumerate(grp.layers)]
        return out + list(zip(lay.post, self.post, strict=True))

    def hidden_states(self, tokens, *, dispatch=None):
        """Final hidden state before the output norm [B, T, D] (acc dtype) and the aux dict."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")

        def mixer(l, layer, h):
            return layer.mixer(h, self.cfg, self.run)

        return self._walk(tokens, mixer, dispatch)

    def _walk(self, tokens, mixer, dispatch):
        """The layer stack on tokens [B, T]; ``mixer(l, layer, normed h) → (y, aux)`` runs each token mixer."""
        cfg, run = self.cfg, self.run
        cdt = jnp.dtype(run.compute_dtype)
        acc = acc_dtype(cdt)
        eps = cfg.rms_norm_eps
        dispatch = dispatch or run.moe_impl
        aux = {"routing": [], "mla_max_logit": []}

        def collect(a):
            for k, v in a.items():
                aux[k].append(v)

        emb = self.embed[...][tokens]
        if not cfg.uses_attn_res:
            h = emb.astype(acc)
            for l, layer in self.layers():
                a, ax = mixer(l, layer, rms_norm(h, layer.input_norm[...], eps, out_dtype=cdt))
                collect(ax)
                h = h + a.astype(acc)
                f, fx = layer.ffn(rms_norm(h, layer.post_norm[...], eps, out_dtype=cdt), cfg, run, dispatch)
                collect(fx)
                h = h + f.astype(acc)
            return h, aux
        S = cfg.attn_res_block_size
        blocks: list = []
        part = emb.astype(acc)
        for l, layer in self.layers():
            h = part if not blocks else layer.attn_res(blocks + [part], eps)
            if l % S == 0:
                blocks.append(part)
                part = None
            a, ax = mixer(l, layer, rms_norm(h, layer.input_norm[...], eps, out_dtype=cdt))
            collect(ax)
            part = a.astype(acc) if part is None else part + a.astype(acc)
            h = layer.mlp_res(blocks + [part], eps)
            f, fx = layer.ffn(rms_norm(h, layer.post_norm[...], eps, out_dtype=cdt), cfg, run, dispatch)
            collect(fx)
            part = part + f.astype(acc)
        return self.out_res(blocks + [part], eps), aux

    def _logits(self, h):
        cdt = jnp.dtype(self.run.compute_dtype)
        hn = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps, out_dtype=cdt)
        head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("...d,dw->...w", hn, head.astype(cdt), preferred_element_type=h.dtype)

    def extend(self, tokens, layer_caches: list, *, start, lengths, absorbed: bool = True, last_only: bool = False,
               dispatch=None):
        """Run a right-padded piece of tokens [B, T] on top of per-layer caches (``k3jax.model.cache``).

        layer_caches: one cache dict per layer (layer order); start [B]: tokens already cached per row; lengths
        [B]: real tokens of this piece per row. Returns (logits [B, T, W] — or [B, W] at each row's last real
        token with ``last_only`` — and the updated per-layer caches). AttnRes mixes over depth within a token,
        so nothing but the token mixers' caches carries over between pieces."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")
        T = tokens.shape[1]
        real = jnp.arange(T)[None, :] < lengths[:, None]
        tokens = jnp.where(real, tokens, 0)                                 # padding ids are never looked up
        new = list(layer_caches)

        def mixer(l, layer, h):
            y, new[l] = layer.mixer_cached(h, self.cfg, self.run, layer_caches[l], start=start, lengths=lengths,
                                           absorbed=absorbed)
            return y, {}

        h, _ = self._walk(tokens, mixer, dispatch)
        if last_only:
            h = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
        return self._logits(h), new

    def __call__(self, tokens, *, return_aux: bool = False, dispatch=None):
        """tokens [B, T] int → logits [B, T, W] in at-least-fp32 (and the aux dict if ``return_aux``)."""
        h, aux = self.hidden_states(tokens, dispatch=dispatch)
        logits = self._logits(h)
        return (logits, aux) if return_aux else logits


__all__ = ["K3Model"]
