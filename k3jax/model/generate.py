"""Sampling from the model: one prefill of every (ragged) prompt, then one ``decode_step`` per new token.

    out = generate(params, prompts, cfg, max_new_tokens=32, greedy=True)          # prompts [B, T], -1 padded
    out.tokens        # [B, N] int32, -1 after a row stopped
    out.logits        # [B, N, W] float32: the logits each new token was drawn from (zeros after a stop)
    out.stop_reason   # per row: "stop" (drew a --stop id, kept as its last token) or "length"
    out.timing        # seconds: prefill and decode, each with its compile time apart; tokens/s after compile

Sampling: greedy is the arg-max; otherwise logits / temperature, then top-k (k > 0), then top-p (the smallest
set of most likely tokens whose probability reaches p; the most likely token is always kept), then one
categorical draw. Step t's key is ``fold_in(key(seed), t)``: the same seed gives the same samples.

Timing (``Generation.timing``): ``prefill_s`` and ``decode_s`` are wall times, the compiles included;
``prefill_compile_s`` and ``decode_compile_s`` the part of each JAX spent tracing, lowering and compiling (its
compile events, ``jax.monitoring``); ``first_step_s`` the first draw + decode step, which compile theirs; and
``decode_tokens_per_s`` the throughput of the steps after it (rows x steps / seconds), compiles excluded — None
with fewer than two decode steps.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config, RunConfig, default_run
from k3jax.distributed import host_value
from k3jax.errors import InputError
from k3jax.model.cache import CacheError, decode_step, init_cache, prefill


@dataclass(frozen=True)
class Sampling:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise InputError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top-p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top-k must be >= 0 (0: off), got {self.top_k}")


def filtered_logits(logits, s: Sampling):
    """The logits a draw is made from, [..., W] float32: logits / temperature, then the top-k and top-p cuts
    (module docstring) as the float32 minimum, so softmax of them is the sampler's distribution exactly (what
    speculative sampling compares against, k3jax/draft/speculative.py)."""
    z = logits.astype(jnp.float32) / s.temperature
    neg = jnp.finfo(z.dtype).min
    if s.top_k:
        kth = jax.lax.top_k(z, min(s.top_k, z.shape[-1]))[0][..., -1:]
        z = jnp.where(z < kth, neg, z)
    if s.top_p < 1:
        order = jnp.argsort(-z, axis=-1)
        zs = jnp.take_along_axis(z, order, axis=-1)
        ps = jax.nn.softmax(zs, axis=-1)
        before = jnp.cumsum(ps, axis=-1) - ps                          # mass of the more likely tokens
        keep_sorted = before < s.top_p                                 # always keeps the first
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
        z = jnp.where(keep, z, neg)
    return z


@functools.partial(jax.jit, static_argnames=("s",))
def sample(logits, key, s: Sampling):
    """logits [B, W] → token ids [B] int32 (module docstring)."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, s), axis=-1).astype(jnp.int32)


# JAX's compile events (jax._src.dispatch): a jit's trace, its lowering to MLIR and the backend compile.
_COMPILE_EVENTS = frozenset(("/jax/core/compile/jaxpr_trace_duration",
                             "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"))


class CompileClock:
    """The (start, end) spans of JAX's compile events while it is open (``with CompileClock() as c``);
    ``c.seconds(i, j)`` is the time covered by spans ``i:j`` (nested ones, e.g. an inner jit's trace, counted
    once) and ``len(c)`` the spans so far — marks to split a run into parts."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []

    def _on(self, event, start, end, **_):
        if event in _COMPILE_EVENTS:
            self.spans.append((start, end))

    def __enter__(self):
        jax.monitoring.register_event_time_span_listener(self._on)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_time_span_listener(self._on)

    def __len__(self):
        return len(self.spans)

    def seconds(self, i: int = 0, j: int | None = None) -> float:
        total, reach = 0.0, -float("inf")
        for a, b in sorted(self.spans[i:j]):
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total


@dataclass
class Generation:
    tokens: np.ndarray  # [B, N] int32, -1 after a stop
    logits: np.ndarray  # [B, N, W] float32, zeros after a stop
    stop_reason: list
    timing: dict = field(default_factory=dict)


def prompt_lengths(prompts: np.ndarray) -> np.ndarray:
    """Real tokens per row of a right-padded [B, T] prompt array (-1 = padding); refuses inner padding."""
    prompts = np.asarray(prompts)
    if prompts.ndim != 2:
        raise CacheError(f"prompts must be [B, T] token ids, got shape {prompts.shape}")
    real = prompts >= 0
    n = real.sum(axis=1)
    for b in range(prompts.shape[0]):
        if n[b] == 0:
            raise CacheError(f"prompt row {b} is empty (every id is -1 padding)")
        if not real[b, : n[b]].all():
            raise CacheError(f"prompt row {b}: -1 padding may only follow the prompt (right padding)")
    return n.astype(np.int32)


def generate(params, prompts, cfg: K3Config, run: RunConfig | None = None, *, max_new_tokens: int,
             sampling: Sampling = Sampling(), seed: int = 0, stop=(), max_len: int | None = None,
             on_token=None, dispatch=None, place_cache=None) -> Generation:
    """Prefill ``prompts`` [B, T] (-1 right padding) and draw up to ``max_new_tokens`` per row.

    stop: token ids that end a row (kept as its last token). max_len: the cache's positions per row (default
    the longest prompt + max_new_tokens). on_token(step, ids [B], done [B]) is called after every draw.
    On a mesh: ``dispatch`` is the prefill's (a ``ContextParallel``: each prompt split over the context axis; the
    decode steps continue from the cache it leaves) and ``place_cache(cache)`` places the empty cache (rows over
    data, positions over context). The drawn ids and logits come to the host from whichever processes hold them
    (``distributed.host_value``), so every process of a multi-process job calls this alike and gets every row."""
    run = default_run(cfg) if run is None else run
    prompts = np.asarray(prompts)
    n = prompt_lengths(prompts)
    if max_new_tokens < 1:
        raise CacheError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_len = int(n.max()) + max_new_tokens if max_len is None else max_len
    if int(n.max()) + max_new_tokens > max_len:
        raise CacheError(f"the longest prompt ({int(n.max())} tokens) + {max_new_tokens} new tokens exceeds the "
                         f"maximum length {max_len}")
    B = prompts.shape[0]
    stop_ids = np.asarray(sorted({int(s) for s in stop}), np.int64)
    key = jax.random.key(seed)
    with CompileClock() as clock:
        t0 = time.perf_counter()
        cache = init_cache(cfg, B, max_len, run)
        if place_cache is not None:
            cache = place_cache(cache)
        logits, cache = prefill(params, np.where(prompts >= 0, prompts, 0), n, cache, cfg, run, last_only=True,
                                dispatch=dispatch)
        logits = jax.block_until_ready(logits)
        t_prefill = time.perf_counter() - t0
        at_prefill = len(clock)
        tokens = np.full((B, max_new_tokens), -1, np.int32)
        out_logits = np.zeros((B, max_new_tokens, logits.shape[-1]), np.float32)
        done = np.zeros((B,), bool)
        reason = ["length"] * B
        t1 = time.perf_counter()
        t_first, steps = 0.0, 0
        for t in range(max_new_tokens):
            ids = host_value(sample(logits, jax.random.fold_in(key, t), sampling))
            live = ~done
            tokens[live, t] = ids[live]
            out_logits[live, t] = host_value(logits).astype(np.float32, copy=False)[live]
            hit = live & np.isin(ids, stop_ids)
            for b in np.flatnonzero(hit):
                reason[b] = "stop"
            done |= hit
            if on_token is not None:
                on_token(t, np.where(live, ids, -1), done.copy())
            if done.all() or t == max_new_tokens - 1:
                break
            logits, cache = decode_step(params, ids, cache, cfg, run, active=~done, donate=True)
            steps += 1
            if steps == 1:  # the first draw and step compile the sampler and the decode step
                jax.block_until_ready(logits)
                t_first = time.perf_counter() - t1
        jax.block_until_ready(logits)
        t_decode = time.perf_counter() - t1
    after = t_decode - t_first  # the steps after the first: compiled
    timing = {"prefill_s": t_prefill, "prefill_tokens": int(n.sum()),
              "prefill_compile_s": clock.seconds(0, at_prefill), "decode_s": t_decode, "decode_steps": steps,
              "decode_compile_s": clock.seconds(at_prefill), "first_step_s": t_first,
              "decode_tokens_per_s": (steps - 1) * B / after if steps > 1 and after > 0 else None}
    return Generation(tokens, out_logits, reason, timing)


__all__ = ["CompileClock", "Generation", "Sampling", "filtered_logits", "generate", "prompt_lengths", "sample"]
