"""The K3 network as an NNX module (docs/model.md §1.3): embedding, the decoder layers in the stacked layout
(k3jax/model/layout.py), the output AttnRes mix, the final norm and the LM head.

    model = K3Model(cfg, rngs=nnx.Rngs(0))              # run settings: K3Model(cfg, run=RunConfig(...), ...)
    logits = model(tokens)                               # [B, T, W] float32 (or wider)
    logits, aux = model(tokens, return_aux=True)         # aux["routing"]: one Routing per MoE layer (layer order)
                                                         # aux["mla_max_logit"]: [B, N] per MLA layer

With AttnRes (K3, docs/model.md §1.3 / §3.2) there is no classic residual: sublayer outputs accumulate into the running
block sum ``part``; committed block sums form ``blocks``; every sublayer input is an AttnRes mix of
``blocks ++ [part]``. Sources and partial sums are kept in at-least-fp32. Without AttnRes (Kimi-Linear) the
standard pre-norm residual is used. One layer's wiring is ``DecoderLayer.__call__`` over a carry of
k3jax/model/residual.py; this module only loops the layers (the unrolled stack, ``extend``) or scans them (the
repeating group), with remat around each. The model reads ``K3Config`` (architecture) and ``RunConfig`` (dtypes,
kernels, dispatch, QAT, block sizes; default: the preset's, ``config.default_run``); blocks get plain arguments.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import REMAT_POLICIES, K3Config, RunConfig, default_run
from k3jax.layers.attn_res import AttnResQuery
from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.layers.experts import PackedExperts, read_in_place
from k3jax.model.block_scan import scan_saving_parts
from k3jax.model.decoder import DecoderLayer, Group
from k3jax.model.layout import layer_kind, layout
from k3jax.model.residual import Blocks, Buffer, Stream, unpinned
from k3jax.ops.lora import LoraDropout
from k3jax.ops.norms import acc_dtype, rms_norm


def context_of(dispatch):
    """The ``ContextParallel`` (k3jax/sharding/context_parallel.py) a call runs under: the dispatch itself, an
    ``ExpertParallel``'s, or None."""
    return getattr(dispatch, "context", None)


def rows_of(dispatch):
    """The ``RowSplit`` (k3jax/sharding/row_split.py: whole sequences per device) an uncached call runs its MLA
    flash kernel under: an ``ExpertParallel``'s, or None."""
    return getattr(dispatch, "rows", None)


# The leaves stacked over the groups, sliced per group: Params, and routed experts held packed (frozen, not Params).
STACKED = (nnx.Param, PackedExperts)
# ``extend`` pieces of at most this many positions per row take the norms' mean squares off the AttnRes mixes: a
# decode step (1) and a speculative verify (the draft's tokens + 1, at most 8: the latent-decode kernel's query limit)
GRAM_POSITIONS = 8


def remat_policy(remat: str):
    """The ``jax.checkpoint`` policy of a ``RunConfig.remat`` name other than "none" ("full", "group": None, keep
    only the inputs; otherwise the ``jax.checkpoint_policies`` entry of that name)."""
    if remat not in REMAT_POLICIES or remat == "none":
        raise ValueError(f"remat policy {remat!r}: must be one of {REMAT_POLICIES[1:]}")
    return None if remat in ("full", "group") else getattr(jax.checkpoint_policies, remat)


def _collect(aux: dict, *per_layer: dict) -> None:
    """Append each layer's aux entries (``mla_max_logit``, ``routing``) to the model's lists, in layer order."""
    for a in per_layer:
        for k, v in a.items():
            aux[k].append(v)


def stream_value(carry):
    """The residual-stream value a carry stands for [B, T, D]: what a plain residual would hold after the layers run
    so far (the embedding plus every sublayer output). ``Stream``: h; AttnRes: the committed block sums plus the
    running part (a ``Buffer``'s unfilled slots are zeros). What ``K3Model.extend(taps=...)`` reads after a layer."""
    if isinstance(carry, Stream):
        return carry.h
    if isinstance(carry, Buffer):
        return jnp.sum(carry.buf, axis=0) + carry.part
    return sum(carry.blocks, carry.part)


def _layer_step(mixer, cfg: K3Config, run: RunConfig, dispatch, pin, dropout=None, mix_gram: bool = False):
    """``step(layer, carry, l)``: ``DecoderLayer.__call__`` with ``mixer(l, layer, x)`` bound to l, the unit that
    ``K3Model._checkpointed`` wraps; ``dropout``: the forward's ``LoraDropout`` (the layer folds in l) or None;
    ``mix_gram``: the norms read their mean square off the AttnRes mixes (``DecoderLayer.__call__``)."""
    def step(layer, carry, l):
        return layer(carry, l, partial(mixer, l), cfg, run, dispatch, pin, dropout=dropout, mix_gram=mix_gram)
    return step


def lora_dropout(run: RunConfig, key) -> LoraDropout | None:
    """The LoRA dropout of a forward given ``key`` (a training step's): None without a key, without adapters or at
    ``run.lora.dropout`` 0 — the forward then traces exactly as without a key."""
    rate = run.lora.dropout if run.lora is not None else 0.0
    return LoraDropout(key, rate) if key is not None and rate > 0 else None


def _on_slot(mixer, sides: list, j: int, g):
    """``mixer`` of the stacked position j in group g (traced), on its carried cache ``sides[j]``, which it replaces:
    ``mixer(l, layer, x) → (y, aux)``."""
    def on_slot(l, layer, x):
        y, aux, sides[j] = mixer(l, layer, x, sides[j], g)
        return y, aux
    return on_slot


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

    def hidden_states(self, tokens, *, dispatch=None, segment_ids=None, taps: tuple = (), dropout_key=None):
        """Final hidden state before the output norm [B, T, D] (acc dtype) and the aux dict. ``segment_ids``
        [B, T]: the documents of packed rows (``k3jax.ops.segments``): KDA's state and conv windows restart and MLA
        attends within each; AttnRes and the FFNs act per token, so nothing else changes. ``taps``: layer indices
        whose stream values go to ``aux["taps"]`` [B, T, len(taps), D] (``_walk``). ``dropout_key``: a training
        forward's PRNG key for LoRA dropout (``lora_dropout``; each layer folds in its index, each adapted projection
        its id: k3jax/layers/lora.py); None (eval, scoring, generation): no dropout."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")
        if segment_ids is not None and tuple(segment_ids.shape) != tuple(tokens.shape):
            raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must equal tokens' {tuple(tokens.shape)}")

        context, rows = context_of(dispatch), rows_of(dispatch)
        if context is not None:
            context.check(tokens.shape[1])

        def mixer(l, layer, x):
            return layer.mixer(x, self.cfg, self.run, segment_ids, context, rows)

        return self._walk(tokens, mixer, dispatch, scan=self.run.layer_stack == "scan", remat=self.run.remat,
                          taps=tuple(taps), dropout=lora_dropout(self.run, dropout_key))

    def _walk(self, tokens, mixer, dispatch, *, scan: bool = False, remat: str = "none", side: dict | None = None,
              taps: tuple = (), dropout: LoraDropout | None = None, mix_gram: bool = False):
        """The layer stack on tokens [B, T]: each layer is ``DecoderLayer.__call__`` on the residual carry
        (k3jax/model/residual.py) with ``mixer(l, layer, normed x) → (y, aux)`` bound to its index (with ``scan``, l
        is traced inside the repeating group: the mixer must not index by it).

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
        then called as ``mixer(l, layer, x, side_j, g)`` and returns ``(y, aux, new side_j)``; after the scan
        ``side["groups"]`` holds the final value.

        A ``dispatch`` object with a ``constrain_tokens(x, batch_dim)`` method (``ExpertParallel``) pins the
        residual stream [B, T, D] and the AttnRes block sums to its token sharding at every layer boundary.

        ``dropout``: a training forward's ``LoraDropout`` (``lora_dropout``), handed to every layer, unrolled or
        scanned; each folds in its index (``DecoderLayer.__call__``). ``mix_gram``: every layer's norms take their
        mean square from the AttnRes mix before them (``k3jax.ops.attn_res``; ``extend`` sets it for short pieces).

        ``taps`` (layer indices): the stream's value after each of these layers (``stream_value``) is put in
        ``aux["taps"]`` [B, T, len(taps), D], in the order given (in the scanned group a tap is a select into a
        buffer carried through the scan, written in the iteration of its group).
        Without it XLA's sharding propagation may follow the weights instead: with D split over fsdp × expert
        (``zero3_ep_tp``) it replicated the batch, and the full model asked the TPU compiler for terabytes of
        temporaries per chip (experiments/LOG.md, 2026-12-02 session 10)."""
        cfg, run = self.cfg, self.run
        pin = getattr(dispatch, "constrain_tokens", None) or unpinned
        dispatch = dispatch or run.moe_impl
        aux = {"routing": [], "mla_max_logit": []}
        lay = layout(cfg)
        h = pin(self.embed[...][tokens].astype(acc_dtype(jnp.dtype(run.compute_dtype))))
        carry = Blocks(h) if cfg.uses_attn_res else Stream(h)

        step = _layer_step(mixer, cfg, run, dispatch, pin, dropout, mix_gram)

        tapped = {}

        def unrolled(pairs, carry):
            for l, layer in pairs:                        # l static: bound, not a checkpoint input
                carry, (ax, fx) = self._checkpointed(partial(step, l=l), remat)(layer, carry)
                _collect(aux, ax, fx)
                if l in taps:
                    tapped[l] = stream_value(carry)
            return carry

        if not (scan and lay.groups > 0):
            carry = unrolled(self.layers(), carry)
        else:
            carry = unrolled(zip(lay.pre, self.pre, strict=True), carry)
            carry, per_layer = self._scan_groups(carry, mixer, dispatch, remat, pin, side, taps, tapped, dropout,
                                                 mix_gram)
            _collect(aux, *per_layer)
            carry = unrolled(zip(lay.post, self.post, strict=True), carry)
        if taps:
            aux["taps"] = jnp.stack([tapped[l] for l in taps], axis=2)
        if isinstance(carry, Stream):
            return carry.h, aux
        return self.out_res([*carry.blocks, carry.part], cfg.rms_norm_eps), aux

    @staticmethod
    def _checkpointed(fn, remat: str):
        """``fn(layer, *arrays)`` under ``jax.checkpoint`` with the ``remat`` policy ("none": ``fn`` itself).

        An NNX module is not a JAX pytree: the layer is split into its graph and state, the state enters the
        checkpoint as an explicit input (its parameters, like the incoming activations, are inputs: always kept),
        and the layer is merged back inside. "full" is ``jax.checkpoint`` without a policy (only the inputs are
        kept); any other name is the ``jax.checkpoint_policies`` entry of that name. ``prevent_cse`` stays on in
        the unrolled stack (XLA could otherwise merge the recompute with the forward and keep the activations after
        all); the scanned stack's group checkpoint turns it off, since the loop already keeps them apart (the JAX
        docs' advice for checkpoint in scan).

        An input ``fn`` returns unchanged (the AttnRes blocks a layer passes on, or commits) goes around the
        checkpoint, not out of it: as an output it would take its later uses' gradient inside the checkpoint's
        backward, summed there in another order."""
        if remat == "none":
            return fn
        policy = remat_policy(remat)

        def wrapped(layer, *xs):
            gdef, state = nnx.split(layer)
            ins, out = jax.tree.leaves(xs), {}

            def pure(state, *xs):
                leaves, out["tree"] = jax.tree.flatten(fn(nnx.merge(gdef, state), *xs))
                given = {id(x): i for i, x in enumerate(jax.tree.leaves(xs))}
                out["given"] = [given.get(id(x)) for x in leaves]
                return [x for x, i in zip(leaves, out["given"]) if i is None]

            made = iter(jax.checkpoint(pure, policy=policy)(state, *xs))
            return jax.tree.unflatten(out["tree"], [next(made) if i is None else ins[i] for i in out["given"]])

        return wrapped

    def _scan_groups(self, carry, mixer, dispatch, remat: str = "none", pin=unpinned, side: dict | None = None,
                     taps: tuple = (), tapped: dict | None = None, dropout: LoraDropout | None = None,
                     mix_gram: bool = False):
        """The repeating group as one lax.scan (see ``_walk``) on the carry of the layers before it → (the carry
        after it, in the same form, and the per-layer aux dicts in layer order); with ``side``, the scan carries
        ``side["groups"]`` and leaves its final value there. ``taps`` inside the group are carried in a buffer
        [n, B, T, D] and put in ``tapped`` {layer: value} afterwards."""
        cfg = self.cfg
        lay = layout(cfg)
        gdef, gparams, grest = nnx.split(self.groups, STACKED, ...)
        attn_res = cfg.uses_attn_res
        S = cfg.attn_res_block_size
        commits = [l for l in range(cfg.num_layers) if attn_res and l % S == 0]
        carry0 = tuple(carry.buffered(len(commits), pin) if attn_res else carry)
        inner = [l for l in taps if lay.start <= l < lay.start + lay.groups * lay.period]
        if side is not None:
            carry0 = (*carry0, tuple(side["groups"]))
        if inner:
            first = carry0[0]                                 # the stream h, or the running part: [B, T, D]
            carry0 = (*carry0, jnp.zeros((len(inner), *first.shape), first.dtype))
        form = Buffer if attn_res else Stream
        n_core = len(Buffer._fields if attn_res else Stream._fields)

        def group(p, carry, g, per_layer: bool = False, whole=None):
            """One scan iteration: group g's layers on the scan carry → (the new carry, per position its aux).
            ``whole``: the packed experts of every group (not sliced by the scan), read in place at g."""
            grp = nnx.merge(gdef, p, grest) if whole is None else nnx.merge(gdef, p, whole, grest)
            if whole is not None:
                read_in_place(grp, g)
            core = form(*carry[:n_core])
            sides = list(carry[n_core]) if side is not None else None
            buf = carry[-1] if inner else None
            outs = []
            for j, layer in enumerate(grp.layers):
                step = _layer_step(mixer if sides is None else _on_slot(mixer, sides, j, g), cfg, self.run,
                                   dispatch, pin, dropout, mix_gram)   # the layer folds its traced index into the key
                step = self._checkpointed(step, "full") if per_layer else step
                core, ax_fx = step(layer, core, lay.start + g * lay.period + j)
                outs.append(ax_fx)
                for i, l in enumerate(inner):                 # this position's taps: written in their group only
                    if (l - lay.start) % lay.period == j:
                        buf = buf.at[i].set(jnp.where(g == (l - lay.start) // lay.period, stream_value(core),
                                                      buf[i]))
            out = tuple(core) + ((tuple(sides),) if sides is not None else ()) + ((buf,) if inner else ())
            return out, outs

        # The remat unit of the scanned stack is one scan iteration (a group of ``period`` layers), not one layer:
        # the carry holds the AttnRes block sums [NB, B, T, D], which a per-layer checkpoint saves at every layer
        # (88 copies at full K3: 83 GB per chip of the frozen-expert step on v5p-512) and a per-group one once per
        # group; under "full" not even that (``block_scan``: the buffer is rebuilt from its final value). Same math
        # (tests/model: scan == loop under every policy).
        # "group" differentiates the recomputed group whole; "full" checkpoints each layer inside it as well
        if attn_res and remat in ("full", "group") and side is None and not inner and not jax.tree.leaves(grest):
            carry, ys = scan_saving_parts(group, gparams, carry0, lay.groups,
                                          lambda g: (lay.start + g * lay.period + S - 1) // S,
                                          recompute=lambda p, c, g: group(p, c, g, per_layer=remat == "full"))
        else:
            # the packed experts stay whole, out of the scanned xs: the kernels read each group's from the stacks
            # (a slice per iteration is a copy of every local expert per layer; ``read_in_place``)
            whole, gparams = nnx.split_state(gparams, PackedExperts, ...)
            group = partial(group, whole=whole) if jax.tree.leaves(whole) else group
            if remat != "none":
                group = jax.checkpoint(group, policy=remat_policy(remat), prevent_cse=False)

            def body(carry, xs):
                p, g = xs
                return group(p, carry, g)

            carry, ys = jax.lax.scan(body, carry0, (gparams, jnp.arange(lay.groups)))
        if inner:
            carry, buf = carry[:-1], carry[-1]
            tapped.update({l: buf[i] for i, l in enumerate(inner)})
        if side is not None:
            side["groups"], carry = carry[-1], carry[:-1]
        per_layer = [jax.tree.map(lambda x, g=g: x[g], a) for g in range(lay.groups) for ax_fx in ys for a in ax_fx]
        last = lay.start + lay.groups * lay.period          # first layer after the group
        if attn_res:
            return Buffer(*carry).listed(sum(1 for l in commits if l < last)), per_layer
        return Stream(*carry), per_layer

    def _logits(self, h):
        cdt = jnp.dtype(self.run.compute_dtype)
        hn = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps, out_dtype=cdt)
        head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("...d,dw->...w", hn, head.astype(cdt), preferred_element_type=h.dtype)

    def extend(self, tokens, layer_caches, *, start, lengths, absorbed: bool = True, last_only: bool = False,
               dispatch=None, group_caches=None, taps: tuple = ()):
        """Run a right-padded piece of tokens [B, T] on top of per-layer caches (``k3jax.model.cache``).

        layer_caches: one cache dict per layer (layer order: a list, or a {layer: cache} dict); start [B]: tokens
        already cached per row; lengths [B]: real tokens of this piece per row. Returns (logits [B, T, W] — or
        [B, W] at each row's last real token with ``last_only`` — and the updated per-layer caches, in the form
        given). AttnRes mixes over depth within a token, so nothing but the token mixers' caches carries over.

        ``group_caches`` (the scanned layout): the caches of the stacked layers, per position j of the period a
        dict stacked over the groups [G, ...]; ``layer_caches`` then holds the unstacked layers only, and the
        repeating group runs as one ``lax.scan`` carrying them (MLA writes and reads its latent in the stack in
        place). Returns (logits, per-layer caches, group caches).

        ``taps`` (layer indices, e.g. a draft model's): one more value at the end, the residual-stream value after
        each tapped layer at every position of the piece, [B, T, len(taps), D] in the stream's dtype
        (``stream_value``; all T positions also with ``last_only``).

        A piece of at most ``GRAM_POSITIONS`` positions (a decode step, a speculative verify) takes each norm's mean
        square from the AttnRes mix before it (``k3jax.ops.attn_res``, ``with_ms``): the same value in exact
        arithmetic, one all-reduce fewer per norm where the width is split (the ``serve`` layout); a longer piece
        (prefill) mixes as the forward does, where the Gram matrix's N² products per position would cost more than
        the reduction they save."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")
        T = tokens.shape[1]
        real = jnp.arange(T)[None, :] < lengths[:, None]
        tokens = jnp.where(real, tokens, 0)                                 # padding ids are never looked up
        new = dict(layer_caches) if isinstance(layer_caches, dict) else list(layer_caches)
        context = context_of(dispatch) if T > 1 else None          # one decode token is not split
        kw = dict(start=start, lengths=lengths, absorbed=absorbed, context=context, rows=rows_of(dispatch))

        def mixer(l, layer, h, cache=None, g=None):
            if g is not None:                                   # a stacked layer: its slice of the carried cache
                y, cache = layer.mixer_cached(h, self.cfg, self.run, cache, layer=g, **kw)
                return y, {}, cache
            y, new[l] = layer.mixer_cached(h, self.cfg, self.run, layer_caches[l], **kw)
            return y, {}

        side = None if group_caches is None else {"groups": tuple(group_caches)}
        h, aux = self._walk(tokens, mixer, dispatch, scan=side is not None, side=side, taps=tuple(taps),
                            mix_gram=T <= GRAM_POSITIONS)
        if last_only:
            h = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
        out = (self._logits(h), new) if side is None else (self._logits(h), new, side["groups"])
        return (*out, aux["taps"]) if taps else out

    def __call__(self, tokens, *, return_aux: bool = False, dispatch=None, segment_ids=None, taps: tuple = (),
                 dropout_key=None):
        """tokens [B, T] int → logits [B, T, W] in at-least-fp32 (and the aux dict if ``return_aux``);
        ``segment_ids`` [B, T]: packed documents; ``taps``: layers whose stream values go to ``aux["taps"]``;
        ``dropout_key``: LoRA dropout's key in a training forward (``hidden_states``)."""
        h, aux = self.hidden_states(tokens, dispatch=dispatch, segment_ids=segment_ids, taps=taps,
                                    dropout_key=dropout_key)
        logits = self._logits(h)
        return (logits, aux) if return_aux else logits


__all__ = ["GRAM_POSITIONS", "K3Model", "lora_dropout"]
