"""The K3 network as an NNX module (docs/model.md §1.3): embedding, the decoder layers in the stacked layout
(k3jax/model/layout.py), the output AttnRes mix, the final norm and the LM head.

    model = K3Model(cfg, rngs=nnx.Rngs(0))              # run settings: K3Model(cfg, run=RunConfig(...), ...)
    logits = model(tokens)                               # [B, T, W] float32 (or wider)
    logits, aux = model(tokens, return_aux=True)         # aux["routing"]: one Routing per MoE layer (layer order)
                                                         # aux["mla_max_logit"]: [B, N] per MLA layer

With AttnRes (K3, docs/model.md §1.3 / §3.2) there is no classic residual: sublayer outputs accumulate into the running
block sum ``part``; committed block sums form ``blocks``; every sublayer input is an AttnRes mix of
``blocks ++ [part]``. Sources and partial sums are kept in at-least-fp32. Without AttnRes (Kimi-Linear) the
standard pre-norm residual is used. The model reads ``K3Config`` (architecture) and ``RunConfig`` (dtypes,
kernels, dispatch, QAT, block sizes; default: the preset's, ``config.default_run``); blocks get plain arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import REMAT_POLICIES, K3Config, RunConfig, default_run
from k3jax.layers.attn_res import AttnResQuery
from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.layers.experts import PackedExperts
from k3jax.model.block_scan import scan_saving_parts
from k3jax.model.decoder import DecoderLayer, Group
from k3jax.model.layout import layer_kind, layout
from k3jax.ops.norms import acc_dtype, rms_norm


def context_of(dispatch):
    """The ``ContextParallel`` (k3jax/sharding/context_parallel.py) a call runs under: the dispatch itself, an
    ``ExpertParallel``'s, or None."""
    return getattr(dispatch, "context", None)


# The leaves stacked over the groups, sliced per group: Params, and routed experts held packed (frozen, not Params).
STACKED = (nnx.Param, PackedExperts)


def remat_policy(remat: str):
    """The ``jax.checkpoint`` policy of a ``RunConfig.remat`` name other than "none" ("full", "group": None, keep
    only the inputs; otherwise the ``jax.checkpoint_policies`` entry of that name)."""
    if remat not in REMAT_POLICIES or remat == "none":
        raise ValueError(f"remat policy {remat!r}: must be one of {REMAT_POLICIES[1:]}")
    return None if remat in ("full", "group") else getattr(jax.checkpoint_policies, remat)


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
        if run.lora is not None:  # after every base draw: the base parameters are those of the plain model
            for layer in (*self.pre, *(self.groups.layers if lay.groups else ()), *self.post):
                layer.add_lora(run.lora, rngs)

    def layers(self):
        """(layer index, DecoderLayer) in layer order; stacked layers are sliced out of the stack."""
        lay = layout(self.cfg)
        out = list(zip(lay.pre, self.pre, strict=True))
        if lay.groups:
            # Only the STACKED leaves are sliced; other variables a wrapper attaches (e.g. qwix's Rngs) are not sliced.
            gdef, gparams, grest = nnx.split(self.groups, STACKED, ...)
            for g in range(lay.groups):
                grp = nnx.merge(gdef, jax.tree.map(lambda x, g=g: x[g], gparams), grest)
                out += [(lay.start + g * lay.period + j, layer) for j, layer in enumerate(grp.layers)]
        return out + list(zip(lay.post, self.post, strict=True))

    def hidden_states(self, tokens, *, dispatch=None, segment_ids=None):
        """Final hidden state before the output norm [B, T, D] (acc dtype) and the aux dict. ``segment_ids``
        [B, T]: the documents of packed rows (``k3jax.ops.segments``): KDA's state and conv windows restart and MLA
        attends within each; AttnRes and the FFNs act per token, so nothing else changes."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")
        if segment_ids is not None and tuple(segment_ids.shape) != tuple(tokens.shape):
            raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must equal tokens' {tuple(tokens.shape)}")

        context = context_of(dispatch)
        if context is not None:
            context.check(tokens.shape[1])

        def mixer(l, layer, h):
            return layer.mixer(h, self.cfg, self.run, segment_ids, context)

        return self._walk(tokens, mixer, dispatch, scan=self.run.layer_stack == "scan", remat=self.run.remat)

    def _walk(self, tokens, mixer, dispatch, *, scan: bool = False, remat: str = "none", side: dict | None = None):
        """The layer stack on tokens [B, T]; ``mixer(l, layer, normed h) → (y, aux)`` runs each token mixer (with
        ``scan``, l is traced inside the repeating group: the mixer must not index by it).

        ``scan``: the layout's head (``pre``) and tail (``post``) run as a Python loop, the repeating group as one
        ``lax.scan`` over its stacked parameters. The AttnRes block sums then live in a fixed buffer [NB, B, T, D]
        (NB = the commits of the whole stack) with a traced count, mixed by ``AttnResQuery.masked``; a commit at
        layer l (l mod S = 0) falls at a different place of the period in different groups, so it is a select.
        Per-layer outputs (routing, MLA max logits) come out of the scan stacked over groups and are put back in
        layer order.

        ``remat`` (a ``RunConfig.remat`` name): in the loop each decoder layer — its AttnRes mixes, token mixer and
        FFN — runs under ``jax.checkpoint`` with that policy (``_checkpointed``); in the scanned stack the unit is
        one scan iteration, the group of ``period`` layers (see ``_scan_groups``). The mixer must then be free of
        side effects (the cached ``extend`` path passes the default "none").

        ``side`` (with ``scan``): {"groups": per position j of the period, a pytree stacked over the groups} carried
        through the scan — the inference cache of the stacked layers (``extend``). The mixer of a stacked layer is
        then called as ``mixer(l, layer, h, side_j, g)`` and returns ``(y, aux, new side_j)``; after the scan
        ``side["groups"]`` holds the final value.

        A ``dispatch`` object with a ``constrain_tokens(x, batch_dim)`` method (``ExpertParallel``) pins the
        residual stream [B, T, D] and the AttnRes block sums to its token sharding at every layer boundary.
        Without it XLA's sharding propagation may follow the weights instead: with D split over fsdp × expert
        (``zero3_ep_tp``) it replicated the batch, and the full model asked the TPU compiler for terabytes of
        temporaries per chip (experiments/LOG.md, 2026-12-02 session 10)."""
        cfg, run = self.cfg, self.run
        pin = getattr(dispatch, "constrain_tokens", None) or (lambda x, batch_dim=0: x)
        cdt = jnp.dtype(run.compute_dtype)
        acc = acc_dtype(cdt)
        eps = cfg.rms_norm_eps
        dispatch = dispatch or run.moe_impl
        aux = {"routing": [], "mla_max_logit": []}
        lay = layout(cfg)

        def collect(a):
            for k, v in a.items():
                aux[k].append(v)

        def ffn(layer, h):
            return layer.ffn(rms_norm(h, layer.post_norm[...], eps, out_dtype=cdt), cfg, run, dispatch)

        def mix(l, layer, h, *slot):
            return mixer(l, layer, rms_norm(h, layer.input_norm[...], eps, out_dtype=cdt), *slot)

        S = cfg.attn_res_block_size

        def plain_layer(l, layer, h):
            a, ax = mix(l, layer, h)
            h = pin(h + a.astype(acc))
            f, fx = ffn(layer, h)
            return pin(h + f.astype(acc)), (ax, fx)

        def attn_res_layer(l, layer, part, blocks):
            """blocks: the block sums committed before layer l (a commit at l appends ``part``, the caller's)."""
            blocks = list(blocks)
            h = part if not blocks else layer.attn_res(blocks + [part], eps)
            if l % S == 0:
                blocks.append(part)
                part = None
            a, ax = mix(l, layer, h)
            part = pin(a.astype(acc) if part is None else part + a.astype(acc))
            f, fx = ffn(layer, layer.mlp_res(blocks + [part], eps))
            return pin(part + f.astype(acc)), (ax, fx)

        def unrolled(pairs, state):
            for l, layer in pairs:
                if cfg.uses_attn_res:
                    fn = self._checkpointed(lambda layer, *xs, l=l: attn_res_layer(l, layer, *xs), remat)
                    new, (ax, fx) = fn(layer, state, tuple(blocks))
                    if l % S == 0:
                        blocks.append(state)
                else:
                    fn = self._checkpointed(lambda layer, *xs, l=l: plain_layer(l, layer, *xs), remat)
                    new, (ax, fx) = fn(layer, state)
                collect(ax)
                collect(fx)
                state = new
            return state

        stacked = scan and lay.groups > 0
        blocks: list = []
        state = pin(self.embed[...][tokens].astype(acc))     # h (plain residual) or part (AttnRes)
        if not stacked:
            state = unrolled(self.layers(), state)
        else:
            state = unrolled(zip(lay.pre, self.pre, strict=True), state)
            state, blocks[:] = self._scan_groups(state, blocks, mix, ffn, remat, pin, side)(collect)
            state = unrolled(zip(lay.post, self.post, strict=True), state)
        if not cfg.uses_attn_res:
            return state, aux
        return self.out_res(blocks + [state], eps), aux

    @staticmethod
    def _checkpointed(fn, remat: str):
        """``fn(layer, *arrays)`` under ``jax.checkpoint`` with the ``remat`` policy ("none": ``fn`` itself).

        An NNX module is not a JAX pytree: the layer is split into its graph and state, the state enters the
        checkpoint as an explicit input (its parameters, like the incoming activations, are inputs: always kept),
        and the layer is merged back inside. "full" is ``jax.checkpoint`` without a policy (only the inputs are
        kept); any other name is the ``jax.checkpoint_policies`` entry of that name. ``prevent_cse`` stays on in
        the unrolled stack (XLA could otherwise merge the recompute with the forward and keep the activations after
        all); the scanned stack's group checkpoint turns it off, since the loop already keeps them apart (the JAX
        docs' advice for checkpoint in scan)."""
        if remat == "none":
            return fn
        policy = remat_policy(remat)

        def wrapped(layer, *xs):
            gdef, state = nnx.split(layer)

            def pure(state, *xs):
                return fn(nnx.merge(gdef, state), *xs)

            return jax.checkpoint(pure, policy=policy)(state, *xs)

        return wrapped

    def _scan_groups(self, state, blocks: list, mix, ffn, remat: str = "none", pin=lambda x, batch_dim=0: x,
                     side: dict | None = None):
        """The repeating group as one lax.scan (see ``_walk``). Returns a function of ``collect`` that hands the
        per-layer aux to it in layer order and returns (the new state, the committed blocks as a list); with
        ``side``, the scan carries ``side["groups"]`` and leaves its final value there."""
        cfg = self.cfg
        lay = layout(cfg)
        acc = state.dtype
        eps = cfg.rms_norm_eps
        gdef, gparams, grest = nnx.split(self.groups, STACKED, ...)
        attn_res = cfg.uses_attn_res
        S = cfg.attn_res_block_size
        commits = [l for l in range(cfg.num_layers) if attn_res and l % S == 0]
        NB = len(commits)
        if attn_res:
            buf = jnp.zeros((NB, *state.shape), acc)
            for i, b in enumerate(blocks):
                buf = buf.at[i].set(b)
            buf = pin(buf, batch_dim=1)
        carry0 = (state, buf) if attn_res else (state,)
        if side is not None:
            carry0 = (*carry0, tuple(side["groups"]))

        def one_layer(layer, carry, l, mixer):
            """Layer l (traced) of the group on the carry → (the new carry, (mixer aux, FFN aux))."""
            if attn_res:
                part, buf = carry
                nb = (l + S - 1) // S                     # blocks committed before layer l
                h = layer.attn_res.masked(buf, nb, part, eps)
                commit = l % S == 0
                # a commit writes slot nb; otherwise slot nb gets its own value back: one slot of traffic, where a
                # select between the updated and the old buffer read and wrote all NB of them at every layer (the
                # frozen-experts v5p-512 plan's ~3.2 TB of f32 [8, B, T, D] selects, experiments/LOG.md)
                slot = jax.lax.dynamic_index_in_dim(buf, nb, 0, keepdims=False)
                buf = pin(jax.lax.dynamic_update_index_in_dim(buf, jnp.where(commit, part, slot), nb, 0), batch_dim=1)
                part = jnp.where(commit, jnp.zeros_like(part), part)     # 0 + a == a exactly
                a, ax = mixer(l, layer, h)
                part = pin(part + a.astype(acc))
                f, fx = ffn(layer, layer.mlp_res.masked(buf, nb + commit, part, eps))
                return (pin(part + f.astype(acc)), buf), (ax, fx)
            (h,) = carry
            a, ax = mixer(l, layer, h)
            h = pin(h + a.astype(acc))
            f, fx = ffn(layer, h)
            return (pin(h + f.astype(acc)),), (ax, fx)

        def group(p, carry, g, per_layer: bool = False):
            grp = nnx.merge(gdef, p, grest)
            core, sides = (carry[:-1], list(carry[-1])) if side is not None else (carry, None)
            outs = []
            def carried(j):                               # the mixer of position j on the carried cache, at g
                def mixer(l, layer, h):
                    y, ax, sides[j] = mix(l, layer, h, sides[j], g)
                    return y, ax
                return mixer

            for j, layer in enumerate(grp.layers):
                mixer = mix if sides is None else carried(j)
                if per_layer:
                    run_layer = self._checkpointed(lambda layer, core, l, m=mixer: one_layer(layer, core, l, m), "full")
                else:
                    run_layer = lambda layer, core, l, m=mixer: one_layer(layer, core, l, m)  # noqa: E731
                core, ax_fx = run_layer(layer, core, lay.start + g * lay.period + j)
                outs.append(ax_fx)
            return ((*core, tuple(sides)) if sides is not None else core), outs

        # The remat unit of the scanned stack is one scan iteration (a group of ``period`` layers), not one layer:
        # the carry holds the AttnRes block sums [NB, B, T, D], which a per-layer checkpoint saves at every layer
        # (88 copies at full K3: 83 GB per chip of the frozen-expert step on v5p-512) and a per-group one once per
        # group; under "full" not even that (``block_scan``: the buffer is rebuilt from its final value). Same math
        # (tests/model: scan == loop under every policy).
        # "group" differentiates the recomputed group whole; "full" checkpoints each layer inside it as well
        if attn_res and remat in ("full", "group") and side is None and not jax.tree.leaves(grest):
            carry, ys = scan_saving_parts(group, gparams, carry0, lay.groups,
                                          lambda g: (lay.start + g * lay.period + S - 1) // S,
                                          recompute=lambda p, c, g: group(p, c, g, per_layer=remat == "full"))
        else:
            if remat != "none":
                group = jax.checkpoint(group, policy=remat_policy(remat), prevent_cse=False)

            def body(carry, xs):
                p, g = xs
                return group(p, carry, g)

            carry, ys = jax.lax.scan(body, carry0, (gparams, jnp.arange(lay.groups)))
        last = lay.start + lay.groups * lay.period          # first layer after the group
        n_end = sum(1 for l in commits if l < last)

        if side is not None:
            side["groups"], carry = carry[-1], carry[:-1]

        def finish(collect):
            for g in range(lay.groups):
                for ax, fx in ys:
                    collect(jax.tree.map(lambda x, g=g: x[g], ax))
                    collect(jax.tree.map(lambda x, g=g: x[g], fx))
            if attn_res:
                return carry[0], [carry[1][i] for i in range(n_end)]
            return carry[0], blocks

        return finish

    def _logits(self, h):
        cdt = jnp.dtype(self.run.compute_dtype)
        hn = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps, out_dtype=cdt)
        head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("...d,dw->...w", hn, head.astype(cdt), preferred_element_type=h.dtype)

    def extend(self, tokens, layer_caches, *, start, lengths, absorbed: bool = True, last_only: bool = False,
               dispatch=None, group_caches=None):
        """Run a right-padded piece of tokens [B, T] on top of per-layer caches (``k3jax.model.cache``).

        layer_caches: one cache dict per layer (layer order: a list, or a {layer: cache} dict); start [B]: tokens
        already cached per row; lengths [B]: real tokens of this piece per row. Returns (logits [B, T, W] — or
        [B, W] at each row's last real token with ``last_only`` — and the updated per-layer caches, in the form
        given). AttnRes mixes over depth within a token, so nothing but the token mixers' caches carries over.

        ``group_caches`` (the scanned layout): the caches of the stacked layers, per position j of the period a
        dict stacked over the groups [G, ...]; ``layer_caches`` then holds the unstacked layers only, and the
        repeating group runs as one ``lax.scan`` carrying them (MLA writes and reads its latent in the stack in
        place). Returns (logits, per-layer caches, group caches)."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")
        T = tokens.shape[1]
        real = jnp.arange(T)[None, :] < lengths[:, None]
        tokens = jnp.where(real, tokens, 0)                                 # padding ids are never looked up
        new = dict(layer_caches) if isinstance(layer_caches, dict) else list(layer_caches)
        context = context_of(dispatch) if T > 1 else None          # one decode token is not split
        kw = dict(start=start, lengths=lengths, absorbed=absorbed, context=context)

        def mixer(l, layer, h, cache=None, g=None):
            if g is not None:                                   # a stacked layer: its slice of the carried cache
                y, cache = layer.mixer_cached(h, self.cfg, self.run, cache, layer=g, **kw)
                return y, {}, cache
            y, new[l] = layer.mixer_cached(h, self.cfg, self.run, layer_caches[l], **kw)
            return y, {}

        side = None if group_caches is None else {"groups": tuple(group_caches)}
        h, _ = self._walk(tokens, mixer, dispatch, scan=side is not None, side=side)
        if last_only:
            h = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
        if side is None:
            return self._logits(h), new
        return self._logits(h), new, side["groups"]

    def __call__(self, tokens, *, return_aux: bool = False, dispatch=None, segment_ids=None):
        """tokens [B, T] int → logits [B, T, W] in at-least-fp32 (and the aux dict if ``return_aux``);
        ``segment_ids`` [B, T]: packed documents (``hidden_states``)."""
        h, aux = self.hidden_states(tokens, dispatch=dispatch, segment_ids=segment_ids)
        logits = self._logits(h)
        return (logits, aux) if return_aux else logits


__all__ = ["K3Model"]
