"""Speculative decoding, exact: a drafter proposes K tokens, one target ``extend`` verifies them through the hybrid
cache, and the standard acceptance rules keep the target's output.

    out = generate_speculative(params, prompts, cfg, run, drafter=DSparkDrafter(draft, dcfg, params, cfg, run),
                               max_new_tokens=200, sampling=Sampling(greedy=True), rollback="copy")
    out.tokens, out.logits, out.stop_reason, out.timing      # as ``k3jax.model.generate.generate``
    out.timing["acceptance_length"]                          # tokens emitted per target verify

One step (every row at once, each with its own cache length): the anchor is the last token emitted and not yet in
the target cache, at position P. The drafter proposes d_1..d_K for positions P+1..P+K; the target runs one
``extend`` over [anchor, d_1..d_K] (K+1 tokens) with per-token KDA records (``k3jax.model.rollback``) and its logits
z_0..z_K (z_j is the target's distribution for position P+j+1).

* Greedy: n = the longest prefix with d_i == argmax z_{i-1}; the row emits d_1..d_n and the bonus argmax z_n.
* Sampling (temperature / top-k / top-p, ``Sampling``): p_i = the sampler's own distribution of z_i
  (``filtered_logits``), q_i = the drafter's distribution d_i was drawn from. d_i is accepted with probability
  min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection the row draws from norm(max(0, p - q)) there, and after K
  acceptances from p_K. Each emitted token then has exactly the target sampler's distribution given the tokens
  before it (Leviathan et al. 2023, Chen et al. 2023), for any q: a bad draft costs speed, never exactness.
  Where p - q has no positive mass (q == p up to rounding) a rejection has probability ~0; the draw then falls
  back to p.

The row then keeps n + 1 of the K + 1 verified tokens (the anchor and d_1..d_n): ``rollback`` resets every KDA
layer's state and conv tails to that token (``copy``: the per-token states of the verify pass; ``replay``: rebuilt
from per-token records) and drops the rejected latents; the bonus token becomes the next anchor. Rows accept
different lengths; a finished row (stop id or its budget) verifies nothing more. The logits behind each emitted
token are the target's (z_0..z_n): ``--logits-out`` with a draft gives what it gives without one, up to the
~1e-6 by which a piece of K + 1 tokens differs from one token at a time.

Drafters: ``DSparkDrafter`` (a ``k3jax.draft.network.DraftModel`` reading the target's hidden states at its tapped
layers) and ``TargetDrafter`` (the target drafting for itself with decode steps: acceptance 1.0 under greedy, the
check that the verification keeps what it should). A drafter has ``K``, ``taps`` (target layers it reads; () for
none) and ``start(taps, lengths)``, ``propose(state, anchor, key, sampling, cache)``, ``accept(state, taps, keep)``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import K3Config, RunConfig, default_run
from k3jax.distributed import host_value
from k3jax.draft.network import draft_cache
from k3jax.errors import InputError
from k3jax.model.cache import CacheError, capacity, decode_step, extend, init_cache
from k3jax.model.generate import CompileClock, Generation, Sampling, filtered_logits, prompt_lengths, sample
from k3jax.model.rollback import rollback, with_records

ROLLBACKS = ("copy", "replay")


# ---------------------------------------------------------------------------------------------------------------
# Acceptance rules (pure, jitted)


@jax.jit
def accept_greedy(target_logits, draft_ids):
    """target_logits [B, K+1, W], draft_ids [B, K] → (n [B] drafted tokens accepted, the bonus token [B])."""
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)                  # [B, K+1]
    K = draft_ids.shape[1]
    n = jnp.sum(jnp.cumprod(draft_ids == best[:, :K], axis=1), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("s",))
def accept_sampled(target_logits, draft_ids, q_probs, key, s: Sampling):
    """Speculative rejection sampling (module docstring): target_logits [B, K+1, W], draft_ids [B, K], q_probs
    [B, K, W] (the distributions the drafted ids were drawn from) → (n [B] accepted, the next token [B])."""
    B, K = draft_ids.shape
    p = jax.nn.softmax(filtered_logits(target_logits, s), axis=-1)             # [B, K+1, W]
    p_d = jnp.take_along_axis(p[:, :K], draft_ids[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q_probs, draft_ids[..., None], axis=-1)[..., 0]
    k_acc, k_res = jax.random.split(key)
    u = jax.random.uniform(k_acc, (B, K))
    ok = u * q_d < p_d                                  # u < p / q without dividing (q_d > 0: d was drawn from q)
    n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]                 # [B, W]
    q_pad = jnp.concatenate([q_probs, jnp.zeros_like(q_probs[:, :1])], axis=1)   # after K acceptances: p itself
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    res = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(res, axis=-1, keepdims=True)
    res = jnp.where(mass > 0, res, p_n)
    nxt = jax.random.categorical(k_res, jnp.log(res), axis=-1).astype(jnp.int32)
    return n, nxt


# ---------------------------------------------------------------------------------------------------------------
# Drafters


def _draw(z, key, s: Sampling):
    """One drafted token per row from logits z [B, W] under the sampler → (ids [B], its distribution [B, W] or None
    for greedy)."""
    if s.greedy:
        return jnp.argmax(z, axis=-1).astype(jnp.int32), None
    zf = filtered_logits(z, s)
    return jax.random.categorical(key, zf, axis=-1).astype(jnp.int32), jax.nn.softmax(zf, axis=-1)


class DSparkDrafter:
    """A DSpark draft (``k3jax.draft.network.DraftModel``) for a target: its context is the target's hidden states
    at ``dcfg.target_layer_ids`` for the positions in the target cache; it proposes K tokens in one forward of the
    block, then adds the Markov bias token by token (greedy: arg-max; sampling: a draw from the sampler's
    distribution of the biased logits, which is the q the acceptance divides by)."""

    def __init__(self, model, dcfg, target_params, cfg: K3Config, run: RunConfig | None = None, *,
                 K: int | None = None):
        run = default_run(cfg) if run is None else run
        K = dcfg.block_size if K is None else K
        if not 1 <= K <= dcfg.block_size:
            raise InputError(f"--draft-tokens must lie in [1, {dcfg.block_size}] (the draft's block size), got {K}")
        self.K, self.dcfg, self.taps = K, dcfg, tuple(dcfg.target_layer_ids)
        self.gdef, self.state = nnx.split(model)
        cdt = jnp.dtype(run.compute_dtype)
        self.embed = jnp.asarray(target_params["embed"]).astype(cdt)
        self.head = (self.embed.T if cfg.tie_word_embeddings else jnp.asarray(target_params["lm_head"])).astype(cdt)
        self.dtype = cdt

    def start(self, taps, lengths, capacity: int):
        cache = draft_cache(self.dcfg, taps.shape[0], capacity, self.dtype)
        return _append(self.gdef, self.state, cache, taps, jnp.asarray(lengths, jnp.int32))

    def propose(self, cache, anchor, key, s: Sampling, target_cache=None):
        return _propose(self.gdef, self.state, cache, jnp.asarray(anchor, jnp.int32), self.embed, self.head, key,
                        s=s, K=self.K)

    def accept(self, cache, taps, keep):
        return _append(self.gdef, self.state, cache, taps, jnp.asarray(keep, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0,))
def _append(gdef, state, cache, taps, lengths):
    return nnx.merge(gdef, state).append_context(cache, taps, lengths)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("s", "K"))
def _propose(gdef, state, cache, anchor, embed, head, key, s: Sampling, K: int):
    model = nnx.merge(gdef, state)
    base, _ = model.propose(cache, anchor, embed=embed, head=head)               # [B, Kb, W]
    prev, ids, qs = anchor, [], []
    for i in range(K):                  # the Markov bias needs the token before: sequential, cheap (rank r)
        z = base[:, i].astype(jnp.float32) + model.markov_bias(prev).astype(jnp.float32)
        prev, q = _draw(z, jax.random.fold_in(key, i), s)
        ids.append(prev)
        qs.append(q)
    return jnp.stack(ids, axis=1), (None if s.greedy else jnp.stack(qs, axis=1))


class TargetDrafter:
    """The target drafting for itself: K decode steps from the current cache (a copy: the verify pass starts from
    the original). Greedy, every drafted token is the target's arg-max, so every verify accepts all K (up to
    near-ties that the piece's ~1e-6 rounding can flip); sampled, q equals p up to that rounding."""

    taps = ()

    def __init__(self, params, cfg: K3Config, run: RunConfig | None = None, *, K: int):
        if K < 1:
            raise InputError(f"--draft-tokens must be >= 1, got {K}")
        self.params, self.cfg, self.run, self.K = params, cfg, default_run(cfg) if run is None else run, K

    def start(self, taps, lengths, capacity: int):
        return None

    def propose(self, state, anchor, key, s: Sampling, target_cache=None):
        cache, tok, ids, qs = target_cache, np.asarray(anchor), [], []
        for i in range(self.K):
            logits, cache = decode_step(self.params, tok, cache, self.cfg, self.run)
            tok, q = _draw(logits.astype(jnp.float32), jax.random.fold_in(key, i), s)
            ids.append(tok)
            qs.append(q)
        return jnp.stack(ids, axis=1), (None if s.greedy else jnp.stack(qs, axis=1))

    def accept(self, state, taps, keep):
        return None


# ---------------------------------------------------------------------------------------------------------------
# The loop


def speculative_step(params, cache, state, anchor, live, drafter, key, sampling: Sampling, cfg: K3Config,
                     run: RunConfig, rollback_mode: str = "copy"):
    """One draft-verify-accept step for every live row (module docstring): anchor [B] (the last emitted token, not
    yet in ``cache``), live [B] bool → (n [B] drafted tokens accepted, the next anchor [B], the verified piece
    [B, K+1] = [anchor, d_1..d_K], the target's logits over it [B, K+1, W], the rolled-back cache — rows hold
    their anchor and d_1..d_n more — and the drafter's new state). Rows not live are left as they were. ``cache``
    is donated: use the returned one."""
    K, taps = drafter.K, tuple(drafter.taps)
    k_draft, k_acc = jax.random.split(key)
    draft_ids, q = drafter.propose(state, anchor, k_draft, sampling, cache)
    piece = np.concatenate([np.asarray(anchor)[:, None], host_value(draft_ids)], axis=1).astype(np.int32)
    live = np.asarray(live, bool)
    start = host_value(cache["lengths"]).astype(np.int32)
    got = extend(params, np.where(live[:, None], piece, 0), np.where(live, K + 1, 0).astype(np.int32),
                 with_records(cache, cfg, K + 1, rollback_mode), cfg, run, absorbed=True, donate=True,
                 **({"taps": taps} if taps else {}))
    vlogits, vcache = got[:2]
    if sampling.greedy:
        acc, nxt = accept_greedy(vlogits, jnp.asarray(piece[:, 1:]))
    else:
        acc, nxt = accept_sampled(vlogits, jnp.asarray(piece[:, 1:]), q, k_acc, sampling)
    acc, nxt = host_value(acc).astype(np.int64), host_value(nxt).astype(np.int32)
    keep = np.where(live, acc + 1, 0).astype(np.int32)
    cache = rollback(vcache, cfg, keep, start=start, donate=True)
    state = drafter.accept(state, got[2] if taps else None, keep)
    return acc, np.where(live, nxt, anchor).astype(np.int32), piece, vlogits, cache, state


def generate_speculative(params, prompts, cfg: K3Config, run: RunConfig | None = None, *, drafter,
                         max_new_tokens: int, sampling: Sampling | None = None, seed: int = 0, stop=(),
                         rollback_mode: str = "copy", on_token=None) -> Generation:
    """``k3jax.model.generate.generate`` with a drafter (module docstring): prompts [B, T] (-1 right padding).
    ``rollback_mode``: "copy" | "replay". ``on_token(step, ids [B], done [B])`` is called per emitted position
    (a verify step emits up to K + 1 per row; ids -1 where a row emitted nothing there). Timing adds
    ``verify_steps``, ``acceptance_length`` (mean tokens emitted per row and verify, the first token from the
    prefill excluded) and ``accepted_histogram`` (per number of drafted tokens accepted, 0..K, the row-steps)."""
    run = default_run(cfg) if run is None else run
    sampling = Sampling() if sampling is None else sampling
    if rollback_mode not in ROLLBACKS:
        raise InputError(f"--rollback must be one of {ROLLBACKS}, got {rollback_mode!r}")
    prompts = np.asarray(prompts)
    n = prompt_lengths(prompts)
    if max_new_tokens < 1:
        raise CacheError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B, K = prompts.shape[0], drafter.K
    max_len = int(n.max()) + max_new_tokens + K + 1           # a verify piece may run K + 1 past the last emitted
    stop_ids = np.asarray(sorted({int(s) for s in stop}), np.int64)
    key = jax.random.key(seed)
    taps = tuple(drafter.taps)
    tokens = np.full((B, max_new_tokens), -1, np.int32)
    out_logits = None
    count = np.zeros((B,), np.int64)
    done = np.zeros((B,), bool)
    reason = ["length"] * B
    hist = np.zeros((K + 1,), np.int64)                  # row-steps per number of drafted tokens accepted

    def emit(ids, logits, live_n):
        """Append per row b the first live_n[b] of ids [B, m] (logits [B, m, W]), stopping at a stop id or the
        budget; calls on_token per position."""
        nonlocal out_logits
        if out_logits is None:
            out_logits = np.zeros((B, max_new_tokens, logits.shape[-1]), np.float32)
        for j in range(ids.shape[1]):
            live = (~done) & (j < live_n)
            if not live.any():
                break
            for b in np.flatnonzero(live):
                tokens[b, count[b]] = ids[b, j]
                out_logits[b, count[b]] = logits[b, j]
                count[b] += 1
                if np.isin(ids[b, j], stop_ids):
                    reason[b], done[b] = "stop", True
                elif count[b] == max_new_tokens:
                    done[b] = True
            if on_token is not None:
                on_token(int(count.max()) - 1, np.where(live, ids[:, j], -1), done.copy())

    with CompileClock() as clock:
        t0 = time.perf_counter()
        cache = init_cache(cfg, B, max_len, run)
        got = extend(params, np.where(prompts >= 0, prompts, 0), n, cache, cfg, run, last_only=True,
                     **({"taps": taps} if taps else {}))
        logits, cache = got[:2]
        state = drafter.start(got[2] if taps else None, n, capacity(cfg, max_len, run))
        logits = jax.block_until_ready(logits)
        t_prefill = time.perf_counter() - t0
        at_prefill = len(clock)
        anchor = host_value(sample(logits, jax.random.fold_in(key, 0), sampling))
        emit(anchor[:, None], host_value(logits)[:, None].astype(np.float32), np.ones((B,), np.int64))
        t1 = time.perf_counter()
        steps, t_first, first_count = 0, 0.0, 0
        while not done.all():
            live = ~done
            acc, nxt, piece, vlogits, cache, state = speculative_step(
                params, cache, state, anchor, live, drafter, jax.random.fold_in(key, steps + 1), sampling, cfg, run,
                rollback_mode)
            ids = np.concatenate([piece[:, 1:], np.zeros((B, 1), np.int32)], axis=1)
            ids[np.arange(B), acc] = nxt                                  # d_1..d_n, then the bonus / resample
            emit(ids, host_value(vlogits).astype(np.float32, copy=False), np.where(live, acc + 1, 0))
            np.add.at(hist, acc[live], 1)
            anchor = nxt
            steps += 1
            if steps == 1:                  # the first step compiles the drafter, the verify and the rollback
                jax.block_until_ready(cache["lengths"])
                t_first, first_count = time.perf_counter() - t1, int(count.sum())
        jax.block_until_ready(cache["lengths"])
        t_decode = time.perf_counter() - t1
    after, later = t_decode - t_first, int(count.sum()) - first_count
    row_steps = int(hist.sum())
    timing = {"prefill_s": t_prefill, "prefill_tokens": int(n.sum()),
              "prefill_compile_s": clock.seconds(0, at_prefill), "decode_s": t_decode, "decode_steps": steps,
              "verify_steps": steps, "decode_compile_s": clock.seconds(at_prefill), "first_step_s": t_first,
              "decode_tokens_per_s": later / after if steps > 1 and after > 0 else None,
              "acceptance_length": float((hist * np.arange(1, K + 2)).sum() / row_steps) if row_steps else None,
              "accepted_histogram": hist.tolist(), "draft_tokens": K, "rollback": rollback_mode}
    return Generation(tokens, out_logits, reason, timing)


__all__ = ["DSparkDrafter", "ROLLBACKS", "TargetDrafter", "accept_greedy", "accept_sampled", "generate_speculative",
           "speculative_step"]
