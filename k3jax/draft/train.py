"""Training a DSpark draft (k3jax/draft/network.py) for a frozen target: distillation of the target's next-token
distributions into the draft's block slots, on the data `k3 train` reads.

    summary = train_draft(TrainConfig(preset=None, steps=200, batch=8, seq_len=64, export="drafts/mini"),
                          target="k3jax/assets/k3-mini-stdlib")            # `k3 train --draft-for CKPT ...`
    loss, terms = draft_loss(draft_params, taps, target_logits, tokens, anchors, graphdef=gdef, embed=E, head=H,
                             weights=w)                                    # the objective alone

One step, one jitted program: the target (its parameters an argument of the step, never differentiated; routed
experts kept as their MXFP4 bytes where the checkpoint stores them) runs the batch's rows [b, T] once and gives its
logits and the residual-stream values at the draft's tapped layers (``K3Model(taps=...)``, each document of a packed
row on its own); A anchors per row are drawn from the step's key; the draft runs every anchor's block in one
forward (``DraftModel.train_logits``) and only its parameters get gradients and AdamW updates.

The objective (per row b, anchor P, slot i = 1..K; the block's slot i stands at position P + i and predicts the token
there, which the target predicts from its logits at P + i - 1):
  distillation  CE_i = -sum_w p(w) log q_i(w),  p = softmax(target logits at P + i - 1) (temperature 1),
                q_i = softmax(draft base logits + Markov bias W2 W1[tokens[P + i - 1]]) (teacher-forced prev);
  confidence    BCE_i of the confidence head against [argmax q_i == argmax p];
  loss = sum(m w_i CE_i) / sum(m w_i) + CONF_WEIGHT * sum(m BCE_i) / sum(m),
with m the slot mask and w_i = exp(-(i - 1) / gamma), gamma = SLOT_GAMMA: exponentially decaying slot weights as
DFlash trains its blocks with. Slot i's token is only ever used when slots 1..i-1 were all accepted, so later slots
matter less; gamma = 4 gives slot 1 e^{6/4} = 4.5x the weight of slot 7. The CE differs from KL(p || q_i) by the
target's entropy, a constant of the draft: the records report the KL (0 for a perfect draft).

Masks. A prediction of the token at t + 1 from t counts where the data's weight (``k3jax.train.data``: same
document, a target token — chat: the assistant's) is nonzero. An anchor P is valid for 1 <= P <= T - 1 with token P
in the same document as token P - 1 (its context is not empty) and the prediction P -> P + 1 counting; slot i of a
valid anchor counts while P + i - 1 <= T - 1 and every prediction P .. P + i - 1 counts (a block never runs past the
row or its document). Anchors are drawn uniformly without replacement among a row's valid positions (Gumbel
top-A); a row with fewer leaves the rest unused.

Acceptance proxy (held-out, in the step records at each evaluation): over blocks whose K slots all count, the mean
number of leading slots whose draft argmax equals the target's argmax — greedy speculative decoding's accepted
drafted tokens per block (it emits one bonus token more), teacher-forced on the data's tokens rather than on the
target's own continuation. The confidence head is trained and exported; decoding does not use it for scheduling.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.checkpoint.atomic import check_out_dir
from k3jax.checkpoint.load import load
from k3jax.config import K3Config, from_hf
from k3jax.draft.config import DraftConfig, check_target
from k3jax.draft.io import load_draft, save_draft
from k3jax.draft.network import DraftModel
from k3jax.errors import InputError
from k3jax.model import merge
from k3jax.optim.optimizer import OptimConfig, schedule
from k3jax.train import data as tdata
from k3jax.train.loop import TrainingStoppedError
from k3jax.train.records import MetricsFile, progress_line
from k3jax.train.settings import TrainConfig, make_data_mesh, run_settings, validate

SLOT_GAMMA = 4.0  # w_i = exp(-(i - 1) / gamma)
CONF_WEIGHT = 0.1  # the confidence head's BCE beside the distillation CE (it shares the slots' hidden states)
WEIGHT_DECAY = 0.1  # AdamW's, on matrices only (the trainer's value)
CLIP_NORM = 1.0  # global gradient-norm clip
EVAL_KEY = 1234  # the held-out anchors: one fixed draw, the same at every evaluation


@dataclass(frozen=True)
class DraftSpec:
    """The objective's settings: anchors per row (None: 2 T / (K + 1), so a row's blocks hold about twice its tokens
    and share the target's forward, the expensive part), slot decay, confidence weight."""

    anchors: int | None = None
    slot_gamma: float = SLOT_GAMMA
    conf_weight: float = CONF_WEIGHT

    def anchors_for(self, seq_len: int, block_size: int) -> int:
        return self.anchors if self.anchors is not None else max(1, 2 * seq_len // (block_size + 1))


# ------------------------------------------------------------------------------------------------- the objective


def slot_weights(K: int, gamma: float = SLOT_GAMMA):
    """[K] float32: w_i = exp(-(i - 1) / gamma) for slots i = 1..K."""
    return jnp.exp(-jnp.arange(K, dtype=jnp.float32) / gamma)


def anchor_mask(weights, segments=None):
    """[B, T] bool: the valid anchors (module docstring) of rows whose predictions t -> t + 1 count by weights
    [B, T] (> 0); segments [B, >= T] document ids (None: one document per row)."""
    B, T = weights.shape
    ok = (weights > 0) & (jnp.arange(T)[None, :] >= 1)
    if segments is not None:
        seg = segments[:, :T]
        ok = ok & jnp.concatenate([jnp.zeros((B, 1), bool), seg[:, 1:] == seg[:, :-1]], axis=1)
    return ok


def sample_anchors(key, valid, A: int):
    """A anchors per row drawn uniformly without replacement among the True positions of valid [B, T] (Gumbel
    top-A). Returns (anchors [B, A] int32 ascending, ok [B, A] bool: False past a row's valid count; such an
    anchor is set to position 1 and must be masked)."""
    score = jnp.where(valid, jax.random.gumbel(key, valid.shape), -jnp.inf)
    top, idx = jax.lax.top_k(score, A)
    ok = jnp.isfinite(top)
    idx = jnp.where(ok, idx, valid.shape[1] + 1)       # unused anchors sort last
    order = jnp.argsort(idx, axis=1)
    idx, ok = jnp.take_along_axis(idx, order, axis=1), jnp.take_along_axis(ok, order, axis=1)
    return jnp.where(ok, idx, 1).astype(jnp.int32), ok


def slot_mask(anchors, anchor_ok, weights, K: int):
    """[B, A, K] bool: slot i of anchor P counts (module docstring) — P + i - 1 <= T - 1 and the predictions
    P .. P + i - 1 all count by weights [B, T]."""
    T = weights.shape[1]
    at = anchors[..., None] + jnp.arange(K)                                   # P + i - 1
    inside = at <= T - 1
    w = jnp.take_along_axis(weights > 0, jnp.minimum(at, T - 1).reshape(at.shape[0], -1), axis=1)
    chain = jnp.cumprod(w.reshape(at.shape) & inside, axis=-1).astype(bool)
    return chain & anchor_ok[..., None]


def objective_terms(logits, conf, target_logits, anchors, mask, slot_w) -> dict:
    """The objective's sums over one batch (so several batches add up): logits [B, A, K, W] (base + Markov),
    conf [B, A, K] probabilities or None, target_logits [B, T, W] (no gradient), anchors [B, A], mask [B, A, K],
    slot_w [K]. Keys: ce_w / kl_w / w (slot-weighted CE, KL and weight), bce / n (confidence BCE and counted slots),
    agree [K] / slots [K] (argmax agreement and counted slots per slot), accepted / blocks (leading agreements of
    the blocks whose K slots all count, and those blocks)."""
    B, A, K, W = logits.shape
    T = target_logits.shape[1]
    at = jnp.minimum(anchors[..., None] + jnp.arange(K), T - 1).reshape(B, A * K)
    tl = jnp.take_along_axis(target_logits, at[..., None], axis=1).reshape(B, A, K, W)
    tl = jax.lax.stop_gradient(tl.astype(jnp.float32))
    logp = jax.nn.log_softmax(tl, axis=-1)
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    ce = -jnp.sum(p * logq, axis=-1)
    kl = jnp.sum(p * (logp - logq), axis=-1)
    m = mask.astype(jnp.float32)
    mw = m * slot_w
    agree = jax.lax.stop_gradient(jnp.argmax(logits, -1) == jnp.argmax(tl, -1))
    terms = {"ce_w": jnp.sum(mw * ce), "kl_w": jnp.sum(mw * kl), "w": jnp.sum(mw), "n": jnp.sum(m),
             "agree": jnp.sum(m * agree, axis=(0, 1)), "slots": jnp.sum(m, axis=(0, 1))}
    full = jnp.all(mask, axis=-1)
    lead = jnp.sum(jnp.cumprod(agree, axis=-1), axis=-1)
    terms.update(accepted=jnp.sum(jnp.where(full, lead, 0)).astype(jnp.float32),
                 blocks=jnp.sum(full).astype(jnp.float32))
    if conf is None:
        terms["bce"] = jnp.zeros((), jnp.float32)
    else:
        c = jnp.clip(conf.astype(jnp.float32), 1e-7, 1 - 1e-7)
        y = agree.astype(jnp.float32)
        terms["bce"] = jnp.sum(m * -(y * jnp.log(c) + (1 - y) * jnp.log1p(-c)))
    return terms


def loss_of(terms: dict, conf_weight: float = CONF_WEIGHT):
    """The loss from ``objective_terms``' sums (a batch with no counted slot: 0)."""
    return terms["ce_w"] / jnp.maximum(terms["w"], 1e-9) + conf_weight * terms["bce"] / jnp.maximum(terms["n"], 1.0)


def draft_loss(draft_params, target_taps, target_logits, tokens, anchors, *, graphdef, embed, head, weights,
               segment_ids=None, anchor_ok=None, gamma: float = SLOT_GAMMA, conf_weight: float = CONF_WEIGHT):
    """(loss, ``objective_terms``) of the draft ``nnx.merge(graphdef, draft_params)`` on one batch.

    target_taps [B, T, n, Dt] and target_logits [B, T, W]: the target's on tokens [B, T] (no gradient flows into
    them); anchors [B, A] (``anchor_ok`` [B, A]: which to count, default all); embed [W, Dt] / head [Dt, W]: the
    target's; weights [B, T]: the data's prediction weights (t -> t + 1 counts where > 0); segment_ids [B, T]: the
    documents of packed rows (the draft's context stays in the anchor's document)."""
    model = nnx.merge(graphdef, draft_params)
    K = model.dcfg.block_size
    taps, tl = jax.lax.stop_gradient(target_taps), jax.lax.stop_gradient(target_logits)
    logits, conf = model.train_logits(taps, tokens, anchors, embed=jax.lax.stop_gradient(embed),
                                      head=jax.lax.stop_gradient(head), segment_ids=segment_ids)
    ok = jnp.ones(anchors.shape, bool) if anchor_ok is None else anchor_ok
    terms = objective_terms(logits, conf, tl, anchors, slot_mask(anchors, ok, weights, K), slot_weights(K, gamma))
    return loss_of(terms, conf_weight), terms


# ------------------------------------------------------------------------------------------------ the programs


def target_io(tparams, cfg: K3Config):
    """(embed [W, D], head [D, W]) of the target's parameters: what the draft reads its tokens and logits through."""
    embed = tparams["embed"]
    return embed, (embed.T if cfg.tie_word_embeddings else tparams["lm_head"])


def target_outputs(tparams, tokens, cfg: K3Config, run, taps: tuple, segment_ids=None):
    """The frozen target on tokens [B, T]: (logits [B, T, W], taps [B, T, n, D]), no gradient."""
    logits, aux = merge(tparams, cfg, run)(tokens, return_aux=True, segment_ids=segment_ids, taps=taps)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(aux["taps"])


def _batch_terms(dparams, tparams, batch, key, *, cfg, run, graphdef, dcfg, spec, A, segmented):
    """(loss, terms) of a batch {"tokens" [b, T + 1], "segments" [b, T + 1], "weights" [b, T]}."""
    x, w = batch["tokens"][:, :-1], batch["weights"]
    seg = batch["segments"][:, :-1] if segmented else None
    tl, th = target_outputs(tparams, x, cfg, run, dcfg.target_layer_ids, seg)
    anchors, ok = sample_anchors(key, anchor_mask(w, seg), A)
    embed, head = target_io(tparams, cfg)
    return draft_loss(dparams, th, tl, x, anchors, graphdef=graphdef, embed=embed, head=head, weights=w,
                      segment_ids=seg, anchor_ok=ok, gamma=spec.slot_gamma, conf_weight=spec.conf_weight)


def make_optimizer():
    """AdamW with the trainer's β and weight decay (on matrices only), after a global-norm clip, WITHOUT the
    learning rate: the step scales the update by the lr it is given (``lr_schedule``), so one compiled step serves
    any --lr / --steps."""
    o = OptimConfig(mode="adamw")
    return optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.scale_by_adam(b1=o.adam_b1, b2=o.adam_b2,
                       eps=o.adam_eps), optax.add_decayed_weights(WEIGHT_DECAY, lambda p: jax.tree.map(
                           lambda x: x.ndim >= 2, p)))


def lr_schedule(lr: float, total_steps: int) -> np.ndarray:
    """[total_steps] float32: the trainer's schedule (linear warm-up over 1% of the steps, cosine to 10% of the
    peak: ``k3jax.optim.optimizer.schedule``), the lr of step s (0-based) at [s]."""
    sched = schedule(lr, OptimConfig(lr=lr, total_steps=total_steps, mode="adamw"))
    return np.asarray(jax.jit(jax.vmap(sched))(jnp.arange(total_steps)), np.float32)


def draft_graphdef(dcfg: DraftConfig, compute_dtype: str = "float32"):
    """The static structure of ``DraftModel(dcfg)`` with float32 parameters (no memory)."""
    return nnx.graphdef(nnx.eval_shape(lambda: DraftModel(dcfg, dtype=jnp.float32, compute_dtype=compute_dtype,
                                                          rngs=nnx.Rngs(0))))


@functools.lru_cache(maxsize=8)
def draft_init(dcfg: DraftConfig, compute_dtype: str = "float32"):
    """key -> a fresh draft's float32 parameters (``DraftModel``'s own init), jitted: one small compile per process
    instead of one per parameter shape."""
    return jax.jit(lambda key: nnx.state(DraftModel(dcfg, dtype=jnp.float32, compute_dtype=compute_dtype,
                                                    rngs=nnx.Rngs(key)), nnx.Param).to_pure_dict())


@functools.lru_cache(maxsize=8)
def draft_step(cfg: K3Config, run, dcfg: DraftConfig, compute_dtype: str, spec: DraftSpec, A: int, segmented: bool):
    """The jitted step ``(state, tparams, batch, key, lr, train) -> (state, metrics)``; state {"params", "opt",
    "step", "bad_streak"} is donated, ``key`` (raw key data) draws the anchors, ``lr`` scales the AdamW update.
    ``train`` False scores the batch without touching the state (the held-out evaluation runs the same compiled
    program: on XLA:CPU the compile, dominated by the target's forward, costs more than the evaluation's unused
    backward). A non-finite loss or gradient skips the update. Built once per process for each key: runs that
    differ only in steps, lr, seed, data or the draft's weights reuse it."""
    graphdef, tx = draft_graphdef(dcfg, compute_dtype), make_optimizer()
    kw = dict(cfg=cfg, run=run, graphdef=graphdef, dcfg=dcfg, spec=spec, A=A, segmented=segmented)
    grad = jax.value_and_grad(lambda p, tp, b, k: _batch_terms(p, tp, b, k, **kw), has_aux=True)

    def step(state, tparams, batch, key, lr, train):
        (loss, terms), g = grad(state["params"], tparams, batch, jax.random.wrap_key_data(key))
        gnorm = optax.tree.norm(g)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)

        def apply(_):
            updates, opt = tx.update(g, state["opt"], state["params"])
            return jax.tree.map(lambda p, u: p - lr * u, state["params"], updates), opt

        params, opt = jax.lax.cond(finite & train, apply, lambda _: (state["params"], state["opt"]), None)
        new = {"params": params, "opt": opt, "step": state["step"] + train.astype(jnp.int32),
               "bad_streak": jnp.where(train, jnp.where(finite, 0, state["bad_streak"] + 1),
                                       state["bad_streak"]).astype(jnp.int32)}
        return new, {"loss": loss, "grad_norm": gnorm, "finite": finite, **terms}

    return jax.jit(step, donate_argnums=0)


def summarize(terms: dict, conf_weight: float = CONF_WEIGHT) -> dict:
    """Host figures of (summed) terms: loss, kl, conf_bce, slot_acc [K], accept_len (NaN where nothing counted)."""
    t = {k: np.asarray(v, np.float64) for k, v in terms.items()}
    div = lambda a, b: float(a / b) if b > 0 else float("nan")  # noqa: E731
    return {"loss": div(t["ce_w"], t["w"]) + conf_weight * (div(t["bce"], t["n"]) if t["n"] > 0 else 0.0),
            "kl": div(t["kl_w"], t["w"]), "conf_bce": div(t["bce"], t["n"]),
            "slot_acc": [div(a, s) for a, s in zip(t["agree"], t["slots"], strict=True)],
            "accept_len": div(t["accepted"], t["blocks"]), "blocks": int(t["blocks"])}


# ---------------------------------------------------------------------------------------------------- the run


def as_packed(batch) -> dict:
    """A batch of ``k3jax.train.data`` as {"tokens", "segments", "weights"}: plain windows [b, T + 1] are one
    document each, every prediction counting."""
    if isinstance(batch, dict):
        return {"tokens": np.asarray(batch["tokens"], np.int32), "segments": np.asarray(batch["segments"], np.int32),
                "weights": np.asarray(batch["weights"], np.float32)}
    x = np.asarray(batch, np.int32)
    return {"tokens": x, "segments": np.zeros_like(x), "weights": np.ones((x.shape[0], x.shape[1] - 1), np.float32)}


def eval_batches(windows, batch: int):
    """The held-out windows (``k3jax.train.evaluate.Windows``) as packed batches of ``batch`` rows (the last one
    padded with rows whose weights are 0)."""
    n = windows.tokens.shape[0]
    seg = windows.segments if windows.segments is not None else np.zeros_like(windows.tokens)
    w = windows.mask if windows.mask is not None else np.ones((n, windows.tokens.shape[1] - 1), np.float32)
    for i in range(0, n, batch):
        rows = np.arange(i, i + batch)
        real = rows < n
        rows = np.minimum(rows, n - 1)
        yield {"tokens": windows.tokens[rows].astype(np.int32), "segments": seg[rows].astype(np.int32),
               "weights": (w[rows] * real[:, None]).astype(np.float32)}


def load_target(path: str, tc: TrainConfig, log, *, packed: bool = True) -> tuple[K3Config, object, dict]:
    """(cfg, run settings, params) of the frozen target on the first device, float32; MXFP4 experts kept packed
    unless ``packed`` is False (then dequantized: the same values, 7.5x the bytes; on XLA:CPU, where packed experts
    run an XLA loop over expert chunks, a k3-mini draft step takes half the time)."""
    cfg = from_hf(os.path.join(path, "config.json"), strict=tc.strict_config)
    t0 = time.perf_counter()
    cfg, params = load(path, cfg=cfg, mesh=make_data_mesh(1), dtype=jnp.float32, progress=False,
                       keep_experts_packed=packed and cfg.expert_format == "mxfp4", strict_config=tc.strict_config)
    kept = " (kept packed)" if packed and cfg.expert_format == "mxfp4" else ""
    log(f"target {path}: {cfg.num_layers} layers, vocab {cfg.vocab_size}, {cfg.expert_format} experts{kept}, "
        f"loaded in {time.perf_counter() - t0:.1f} s")
    return cfg, run_settings(tc, cfg), params


def _replicated(tparams):
    """The draft state's placement: whole on the target's devices (as the step's outputs are: one compile)."""
    sh = jax.tree.leaves(tparams)[0].sharding
    return NamedSharding(sh.mesh, PartitionSpec()) if isinstance(sh, NamedSharding) else sh


def train_draft(tc: TrainConfig, target: str, *, draft: DraftConfig | None = None, spec: DraftSpec = DraftSpec(),
                packed_target: bool = True, log=None) -> dict:
    """Train a draft for the target checkpoint ``target`` (frozen) with ``tc``'s steps, batch, sequence length,
    learning rate, seed, data, evaluation and outputs; ``tc.init``: a draft directory to start from (checked against
    the target), else ``draft`` (default ``DraftConfig.for_target(target's config)``), freshly drawn from ``tc.seed``;
    ``packed_target``: ``load_target``'s ``packed``. Writes ``tc.metrics`` / ``tc.tensorboard`` and the draft to
    ``tc.export`` (float32, ``save_draft``). Returns {"step", "final_loss", "losses", "evals": [(step, ``summarize``
    dict)], "steps_per_s" (after the first, compiling step), "dcfg", "model", "export"}."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    validate(tc, 1)
    if tc.seq_len < 2:
        raise InputError(f"--seq-len must be >= 2 for a draft (an anchor needs context), got {tc.seq_len}")
    if spec.anchors is not None and spec.anchors < 1:
        raise InputError(f"--draft-anchors must be >= 1, got {spec.anchors}")
    if tc.export:
        check_out_dir(tc.export, overwrite=tc.overwrite, flag="--export", hint="pass --overwrite")
    cfg, run, tparams = load_target(target, tc, log, packed=packed_target)
    if tc.init:
        model, dcfg = load_draft(tc.init, target_cfg=cfg, compute_dtype=tc.compute_dtype)
        if draft is not None and draft != dcfg:
            raise InputError(f"--init {tc.init}: the draft's config differs from the one asked for (drop the draft "
                             "shape flags to continue the --init draft as it is)")
    else:
        dcfg = draft or DraftConfig.for_target(cfg)
        check_target(dcfg, cfg)
        model = None
    A = min(spec.anchors_for(tc.seq_len, dcfg.block_size), tc.seq_len - 1)
    data = tdata.prepare(tc.replace(init=target), cfg, 1, log)          # the target's tokenizer for chat data
    segmented = bool(getattr(data, "packing", tc.packing_masks))
    dparams = (draft_init(dcfg, tc.compute_dtype)(jax.random.key(tc.seed)) if model is None
               else nnx.state(model, nnx.Param).to_pure_dict())
    n_params = sum(x.size for x in jax.tree.leaves(dparams))
    log(f"draft: {dcfg.num_hidden_layers} layers, width {dcfg.hidden_size}, K = {dcfg.block_size}, taps "
        f"{list(dcfg.target_layer_ids)}, {n_params:,} parameters; {A} anchors per row")
    step_fn = draft_step(cfg, run, dcfg, tc.compute_dtype, spec, A, segmented)
    lrs = lr_schedule(tc.lr, tc.total_steps or tc.steps)
    st = jax.device_put({"params": dparams, "opt": make_optimizer().init(dparams), "step": jnp.zeros((), jnp.int32),
                         "bad_streak": jnp.zeros((), jnp.int32)}, _replicated(tparams))
    key = jax.random.key(tc.seed)
    eval_key = jax.random.key_data(jax.random.key(EVAL_KEY))
    no, yes = jnp.asarray(False), jnp.asarray(True)
    mfile = MetricsFile(tc.metrics, tensorboard=tc.tensorboard)

    def evaluate(step: int) -> dict:
        nonlocal st
        tot = None
        for b in eval_batches(data.eval_set, tc.batch):
            st, m = step_fn(st, tparams, b, eval_key, jnp.float32(0), no)
            t = {k: np.asarray(v) for k, v in jax.device_get(m).items() if k not in ("loss", "grad_norm", "finite")}
            tot = t if tot is None else {k: tot[k] + t[k] for k in t}
        ev = summarize(tot, spec.conf_weight)
        log(f"step {step}: held-out draft loss {ev['loss']:.4f}, KL {ev['kl']:.4f}, accepted {ev['accept_len']:.3f}"
            f" of {dcfg.block_size} drafted tokens per block ({ev['blocks']} blocks), slot-1 agreement "
            f"{ev['slot_acc'][0]:.3f}")
        return ev

    summary = {"evals": [], "losses": [], "dcfg": dcfg}
    mfile.write({"event": "start", "step": 0, "target": target, "draft_params": n_params, "anchors": A,
                 "draft": dcfg.to_hf(torch_dtype="float32")})
    times = []
    # One trace before the first call: a target with packed experts imports the Pallas package lazily while it is
    # traced, which adds a JAX config value to the trace context, so the second call would trace and compile again.
    b0 = as_packed(data.batch(seed=tc.seed, step=0, batch=tc.batch, seq_len=tc.seq_len))
    jax.eval_shape(step_fn, st, tparams, b0, eval_key, jnp.float32(0), no)
    try:
        if tc.eval_at_start:
            ev = evaluate(0)
            summary["evals"].append((0, ev))
            mfile.write({"event": "eval", "step": 0, **{f"eval_{k}": v for k, v in ev.items()}})
        for step in range(1, tc.steps + 1):
            b = as_packed(data.batch(seed=tc.seed, step=step - 1, batch=tc.batch, seq_len=tc.seq_len))
            t0 = time.perf_counter()
            k = jax.random.key_data(jax.random.fold_in(key, step - 1))
            st, m = step_fn(st, tparams, b, k, jnp.float32(lrs[step - 1]), yes)
            m = jax.device_get(m)
            times.append(time.perf_counter() - t0)
            s = summarize(m, spec.conf_weight)
            rec = {"step": step, "loss": float(m["loss"]), "kl": s["kl"], "conf_bce": s["conf_bce"],
                   "accept_len": s["accept_len"], "slot_acc": s["slot_acc"], "grad_norm": float(m["grad_norm"]),
                   "finite": bool(m["finite"]), "lr": float(lrs[step - 1]), "step_s": times[-1],
                   "tokens_per_s": tc.batch * tc.seq_len / times[-1]}
            summary["losses"].append(rec["loss"])
            if int(st["bad_streak"]) >= tc.max_bad_steps:
                mfile.write(rec)
                raise TrainingStoppedError(f"stopped at step {step}: {tc.max_bad_steps} non-finite draft steps in a "
                                           "row")
            if step % tc.eval_every == 0 or step == tc.steps:
                ev = evaluate(step)
                summary["evals"].append((step, ev))
                rec.update({f"eval_{k}": v for k, v in ev.items()})
            mfile.write(rec)
            if tc.log_every and (step % tc.log_every == 0 or step == tc.steps):
                recent = times[1:][-tc.log_every:] or times[-1:]        # the first step holds the compile
                mean = sum(recent) / len(recent)
                log(progress_line(step, tc.steps, rec["loss"], tokens_per_s=tc.batch * tc.seq_len / mean,
                                  eta_s=(tc.steps - step) * mean) + f", batch accepted {s['accept_len']:.2f}")
    finally:
        mfile.close()
    steady = times[1:]
    summary.update(step=tc.steps, final_loss=summary["losses"][-1] if summary["losses"] else None,
                   steps_per_s=len(steady) / sum(steady) if steady else None,
                   model=nnx.merge(draft_graphdef(dcfg, tc.compute_dtype), jax.device_get(st["params"])))
    if tc.export:
        summary["export"] = save_draft(tc.export, summary["model"], dcfg, dtype="float32", overwrite=tc.overwrite)
        log(f"draft written to {tc.export}")
    return summary


__all__ = ["CONF_WEIGHT", "SLOT_GAMMA", "DraftSpec", "anchor_mask", "as_packed", "draft_graphdef",
           "draft_init", "draft_loss", "draft_step", "eval_batches", "load_target", "loss_of", "lr_schedule",
           "make_optimizer", "objective_terms", "sample_anchors", "slot_mask", "slot_weights", "summarize",
           "target_io", "target_outputs", "train_draft"]
