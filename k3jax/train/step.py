"""The jitted train step: gradient accumulation over micro-batches, one optimizer update, QK-Clip, one balancing
update, and a finite-check that turns a NaN/Inf step into a no-op — all inside one XLA program.

    state = init_state(params, tx, seed)                 # {"params", "opt", "step", "rng", "bad_streak"}
    step_fn = make_train_step(cfg, run, tx, spec)            # spec: StepSpec (balance mode, QK-Clip τ, ...)
    state, m = step_fn(state, tokens_mbt, poison)        # tokens [M, b, T + 1] int32; poison 0.0 (or NaN in tests)
    state, m = step_fn(state, packed, poison)            # packed documents: {"tokens", "segments", "weights"}

Order inside one step (docs/model.md §8.1, §9.6): every micro-batch routes with the CURRENT bias; gradients, integer
load statistics / QB histograms and per-head max logits are summed (max-ed) over micro-batches; then
  1. finite = isfinite(loss) ∧ isfinite(‖g‖)
  2. params ← optax update (fp32 master weights; the bias leaves are labelled "frozen")
  3. QK-Clip on the updated MLA weights with the step's max logits
  4. bias ← next-step bias from the step's global statistics
  5. 2-4 are one lax.cond on finite: otherwise params, optimizer state and bias stay as they were (the step
     counter still advances)
On a mesh the token axis of ``tokens`` is sharded and the state is placed by the rules table
(``k3jax.sharding.placement``); XLA inserts the gradient / histogram reductions and the FSDP gathers, and the MoE
layers run through the expert-parallel ``dispatch``.

LoRA dropout (``run.lora.dropout`` > 0 only; otherwise no key is made and the program is the one without dropout):
micro-batch i of a step runs its forward with the key fold_in(fold_in(key(state["rng"]), state["step"]), i), so
every step and micro-batch draws fresh masks, and the same state and batch give the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from k3jax.errors import InputError
from k3jax.layers.experts import merge_trees
from k3jax.model import forward
from k3jax.optim import balance as bal
from k3jax.optim.qk_clip import qk_clip


@dataclass(frozen=True)
class StepSpec:
    balance: str = "qb"  # "qb" | "sign" | "aux" | "off"
    sign_gamma: float = 1e-3
    qb_ema: float = 0.0  # EMA factor of the QB target across steps (0 = off, K3's plain QB)
    aux_alpha: float = 1e-2
    qk_clip: bool = True
    qk_tau: float = 100.0

    def __post_init__(self):
        if self.balance not in bal.MODES:
            raise InputError(f"balance mode {self.balance!r}: must be one of {bal.MODES}")
        if not 0.0 <= self.qb_ema < 1.0:
            raise InputError(f"qb_ema must lie in [0, 1), got {self.qb_ema}")
        if self.qk_tau <= 0:
            raise InputError(f"qk_tau must be > 0, got {self.qk_tau}")


def init_state(params, tx, seed: int = 0, frozen=None) -> dict:
    """The train state; ``frozen``: parameters the step uses but never updates (packed routed experts, as uint8
    leaves; ``k3 train --frozen-experts``), kept beside ``params`` so gradients and the optimizer never see them."""
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.key_data(jax.random.key(seed)), "bad_streak": jnp.zeros((), jnp.int32)}
    if frozen is not None:
        state["frozen"] = frozen
    return state


def make_loss(cfg, run, spec: StepSpec, dispatch=None):
    """``dispatch``: the MoE layers' expert computation (None: the model's default; an ``ExpertParallel`` on a mesh
    whose rules shard the experts).

    ``loss_fn(params, batch, norm)``: ``batch`` is tokens [b, T + 1] (every prediction counts: the mean) or a packed
    batch {"tokens", "segments" [b, T + 1], "weights" [b, T]} (``k3jax.train.data.packed_batch_at``): documents
    mixed on their own, the cross-entropy summed over the weighted predictions and divided by ``norm`` (the step's
    weight per micro-batch, so that the micro-batches' mean is the mean over every weighted prediction).
    ``dropout_key``: LoRA dropout's key of a training forward (``forward``); None: no dropout (evaluation)."""

    def loss_fn(params, batch, norm=None, dropout_key=None):
        tokens, seg = (batch, None) if not isinstance(batch, dict) else (batch["tokens"], batch["segments"][:, :-1])
        logits, aux = forward(params, tokens[:, :-1], cfg, run, return_aux=True, dispatch=dispatch, segment_ids=seg,
                              dropout_key=dropout_key)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        ce = jnp.mean(per_token) if seg is None else jnp.sum(per_token * batch["weights"]) / norm
        loss = ce
        if spec.balance == "aux" and aux["routing"]:
            loss = loss + spec.aux_alpha * bal.aux_loss(aux["routing"], cfg.num_experts_per_token)
        return loss, (ce, aux)

    return loss_fn


def make_train_step(cfg, run, tx, spec: StepSpec, dispatch=None):
    """(state, tokens [M, b, T+1] int32 — or a packed batch, each leaf with the leading [M, b] —, poison f32 scalar)
    -> (state, metrics). Not jitted here (see loop.py)."""
    loss_fn = make_loss(cfg, run, spec, dispatch)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    E = cfg.num_experts
    dropout = run.lora is not None and run.lora.dropout > 0     # only then a key: else the program is unchanged

    def step(state, tokens, poison):
        params = state["params"]
        frozen = state.get("frozen")
        if frozen is not None:  # gradients w.r.t. the trainable leaves only; the frozen ones join the forward
            full = jax.value_and_grad(lambda p, tok, n, k=None: loss_fn(merge_trees(p, frozen), tok, n, k),
                                      has_aux=True)
        else:
            full = grad_fn
        M = jax.tree.leaves(tokens)[0].shape[0]
        # a packed batch's weighted predictions over the whole step, per micro-batch (at least one, so that an
        # all-padding step is a zero loss, not a NaN)
        norm = jnp.maximum(jnp.sum(tokens["weights"]), 1.0) / M if isinstance(tokens, dict) else None
        moe_idx = bal.moe_layer_indices(cfg)
        n_mla = len(cfg.mla_layers)
        # the router biases live with the trained leaves, or with the frozen base (LoRA: balancing off)
        b_le = bal.biases(merge_trees(params, frozen), cfg) if moe_idx else jnp.zeros((0, E), jnp.float32)
        balance = bool(moe_idx) and spec.balance != "off"
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"]) if dropout else None

        def one(tok, i=0):
            key = None if step_key is None else jax.random.fold_in(step_key, i)  # micro-batch i's masks
            (loss, (ce, aux)), g = full(params, tok, norm, key)
            stats = bal.micro_stats(aux["routing"], b_le, E, mode=spec.balance) if moe_idx else {}
            ml = (jnp.stack([jnp.max(m, axis=0) for m in aux["mla_max_logit"]]).astype(jnp.float32) if n_mla
                  else jnp.zeros((0, 1), jnp.float32))
            return g, loss, ce, stats, ml

        def micro(carry, xs):
            g, loss, ce, stats, ml = one(*xs) if dropout else one(xs)
            acc_g, acc_loss, acc_ce, acc_stats, acc_ml = carry
            carry = (jax.tree.map(jnp.add, acc_g, g), acc_loss + loss, acc_ce + ce,
                     jax.tree.map(jnp.add, acc_stats, stats), jnp.maximum(acc_ml, ml))
            return carry, None

        # The first micro-batch starts the sums (no zero gradient tree beside the one being built: at one micro-batch
        # per step there is no accumulation loop at all, where a loop carried a second fp32 gradient tree, 28 GB per
        # chip of the full model's QAT step on v5p-512, experiments/LOG.md). x == 0 + x: the sums are unchanged.
        (g, loss, ce, stats, ml) = one(jax.tree.map(lambda x: x[0], tokens))
        if M > 1:
            rest = jax.tree.map(lambda x: x[1:], tokens)
            (g, loss, ce, stats, ml), _ = jax.lax.scan(micro, (g, loss, ce, stats, ml),
                                                       (rest, jnp.arange(1, M)) if dropout else rest)
        N = ml.shape[-1]
        scale = (1.0 + poison) / M  # poison = NaN simulates a numerical fault (tests); 1.0 + 0.0 is exact
        g = jax.tree.map(lambda x: x * scale.astype(x.dtype), g)
        loss, ce = loss * scale, ce * scale
        gnorm = optax.tree.norm(g)  # over the stacked leaves as they are: the program does not grow with depth
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)

        no_clip = {"gamma": jnp.ones((n_mla, N), jnp.float32), "clipped": jnp.zeros((n_mla, N), bool)}

        def apply(_):
            updates, opt = tx.update(g, state["opt"], params)
            new_params = optax.apply_updates(params, updates)
            clip = no_clip
            if spec.qk_clip and n_mla:
                new_params, clip = qk_clip(new_params, list(ml), cfg, tau=spec.qk_tau)
            if balance:
                new_b = bal.new_biases(stats, b_le, mode=spec.balance, top_k=cfg.num_experts_per_token,
                                       sign_gamma=spec.sign_gamma, qb_ema=spec.qb_ema)
                new_params = bal.set_biases(new_params, new_b, cfg)
            return new_params, opt, clip

        # A branch, not a select of the new state against the old: a select keeps both whole at once (the new
        # parameters and optimizer state as temporaries beside the donated old ones, 44.5 GB per chip of the full
        # model's train step on v5p-512)
        new_params, opt, clip = jax.lax.cond(finite, apply, lambda _: (params, state["opt"], no_clip), None)
        new_state = {"params": new_params, "opt": opt, "step": state["step"] + 1, "rng": state["rng"],
                     "bad_streak": jnp.where(finite, 0, state["bad_streak"] + 1).astype(jnp.int32)}
        if frozen is not None:
            new_state["frozen"] = frozen
        b_next = bal.biases(merge_trees(new_state["params"], frozen), cfg) if moe_idx else b_le
        metrics = {"loss": loss, "ce": ce, "grad_norm": gnorm, "finite": finite,
                   "load_ratio": bal.load_ratio(stats["loads"]) if moe_idx else jnp.zeros((0,)),
                   "bias_range": (jnp.max(b_next, -1) - jnp.min(b_next, -1)) if moe_idx else jnp.zeros((0,)),
                   "max_logit": ml, "qk_clipped": clip["clipped"] & finite}
        return new_state, metrics

    return step


__all__ = ["StepSpec", "init_state", "make_loss", "make_train_step"]
