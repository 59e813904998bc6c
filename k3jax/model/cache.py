"""The hybrid inference cache (docs/model.md §4.6, §5.2) and the two ways to advance it: ``prefill`` and
``decode_step``.

    cache = init_cache(cfg, batch=2, max_len=4096)                    # zeros; ``cache_bytes(cache)`` its size
    logits, cache = prefill(params, prompts, lengths, cache, cfg)     # [B, T] right-padded, lengths [B]
    logits, cache = decode_step(params, next_ids, cache, cfg)         # one token per row -> logits [B, W]

Layout: one entry per layer (layer order), plus the per-row lengths:

    {"layers": {l: layer cache}, "lengths": [B] int32}
    KDA layer: {"state": [B, N, K, V] float32 (K-first), "conv_q" / "conv_k" / "conv_v": [B, Wc-1, N K]}
    MLA layer: {"c_kv": [B, S, R] (the latent after kv_a_layernorm), "k_rope": [B, S, Hr]}, both in the compute
               dtype: kv_lora_rank + qk_rope_head_dim values per token, as ``k3 plan``'s formula and serving stacks
               count them (bf16 runs round the shared key slice to bf16 here, where the forward keeps fp32; the
               TPU's default-precision product rounds it so anyway)

By default not stacked over the repeating group like the parameters: the layer stack runs as an unrolled Python
loop (K3Model.layers), and with a stacked cache every step's slice-update-restack became a copy of the whole
stacked cache (measured: 10 cache-sized copies per decode step in the HLO at batch 1, a whole-cache
``concatenate`` with two groups; a 64K cache then decoded 4.9x slower than a 1K one at the same context). Flat,
each layer's buffers are donated and updated in place.

The scanned layout (``stacked=True``): the unstacked layers as above, and the repeating group's caches stacked per
position j of the period, ``"groups": [{leaf: [G, ...]}, ...]`` (``stack_cache`` / ``unstack_cache`` convert). The
group then runs as one ``lax.scan`` that carries them — MLA scatters its new latents into the stack and reads key
blocks straight from it, KDA's state is sliced out and written back — so the compiled program holds one group
instead of every layer: at full size the unrolled decode step did not compile in 24 GB of host memory
(``k3 plan --mode decode`` uses this layout). Values are the same in both layouts (tests/model/test_cache.py).

S is ``max_len`` rounded up to the attention key block (``run.mla_block_size``). AttnRes mixes over depth within one
token (docs/model.md §3.1), so it carries nothing across tokens. Rows are independent: each has its own length, a piece
may give each row a different number of real tokens (right padding is a no-op for the KDA state and is written
nowhere in the latent cache), and a row given 0 tokens is left exactly as it was.

A speculative verify piece may carry records (``k3jax.model.rollback``: ``with_records``, then ``extend``, then
``rollback`` to the accepted prefix): ``rec_*`` leaves in every KDA layer cache and ``"rec_pos"`` [B, T] (the
piece's positions, -1 before it runs) at the top.

``taps``: ``extend`` / ``advance`` can also return the residual stream after chosen layers (a draft model's context
features): (logits, cache, hidden [B, T, len(taps), D]).

A prefill may record ``marks`` (one position per row, anywhere, not only at chunk ends): the piece is then run
as two pieces split at the mark, and the KDA states after the mark are kept in ``cache["marks"]`` for
``k3jax.model.snapshot``. Running a piece in two parts is the same sum as running it whole (what chunked prefill
relies on, and what the tests check), so the state at the mark is the exact chunked-prefill state, not a replay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config, RunConfig, default_run
from k3jax.distributed import host_value
from k3jax.errors import InputError
from k3jax.model.functional import merge
from k3jax.model.layout import layout
from k3jax.ops.norms import acc_dtype


class CacheError(InputError):
    """A cache request that cannot be met (too long, wrong batch, unknown mark); the message names the value."""


# The logical axes of each cache leaf (one table; the sharding rules map them to mesh axes, as for the parameters:
# ``k3jax.sharding.placement.cache_shardings``). Conv tails run over the KDA channels head-major, like the conv
# weights ("heads"); the latent and the shared key slice have no head axis: one copy serves every head.
CACHE_AXES = {
    "state": ("batch", "heads", "head_dim", "head_dim"),
    "conv_q": ("batch", "conv_tap", "heads"), "conv_k": ("batch", "conv_tap", "heads"),
    "conv_v": ("batch", "conv_tap", "heads"),
    "c_kv": ("batch", "seq", "kv_lora"),
    "k_rope": ("batch", "seq", "head_dim"),
    "lengths": ("batch",),
    # Verify records (k3jax.model.rollback): the piece's axis is a handful of positions, like the conv taps: never
    # split. rec_x runs over q|k|v's channels, each head-major like the conv tails.
    "rec_state": ("batch", "conv_tap", "heads", "head_dim", "head_dim"),
    "rec_k": ("batch", "conv_tap", "heads", "head_dim"), "rec_u": ("batch", "conv_tap", "heads", "head_dim"),
    "rec_g": ("batch", "conv_tap", "heads", "head_dim"),
    "rec_x": ("batch", "conv_tap", "heads"),
    "rec_pos": ("batch", "conv_tap"),
}


def cache_leaf_axes(names: tuple, ndim: int) -> tuple:
    """The logical axes of the cache leaf at key path ``names`` with ``ndim`` dims (a leaf stacked over the groups
    leads with "layers")."""
    axes = CACHE_AXES[names[-1]]
    return ("layers", *axes) if ndim == len(axes) + 1 and names[0] == "groups" else axes


def _run(cfg: K3Config, run: RunConfig | None) -> RunConfig:
    return default_run(cfg) if run is None else run


def capacity(cfg: K3Config, max_len: int, run: RunConfig | None = None) -> int:
    """Positions a cache for ``max_len`` tokens holds: max_len rounded up to the attention key block."""
    blk = _run(cfg, run).mla_block_size
    return -(-max(int(max_len), 1) // blk) * blk


def layer_cache_shapes(cfg: K3Config, l: int, batch: int, max_len: int, run: RunConfig | None = None) -> dict:
    """ShapeDtypeStructs of layer l's cache (module docstring)."""
    run = _run(cfg, run)
    cdt = jnp.dtype(run.compute_dtype)
    acc = acc_dtype(cdt)
    if cfg.is_mla(l):
        S = capacity(cfg, max_len, run)
        return {"c_kv": jax.ShapeDtypeStruct((batch, S, cfg.kv_lora_rank), cdt),
                "k_rope": jax.ShapeDtypeStruct((batch, S, cfg.qk_rope_head_dim), cdt)}
    N, K = cfg.kda_num_heads, cfg.kda_head_dim
    tail = jax.ShapeDtypeStruct((batch, cfg.kda_conv_size - 1, N * K), acc)
    return {"state": jax.ShapeDtypeStruct((batch, N, K, K), acc),                  # fp32 (or wider)
            "conv_q": tail, "conv_k": tail, "conv_v": tail}


def cache_shapes(cfg: K3Config, batch: int, max_len: int, run: RunConfig | None = None, *,
                 stacked: bool = False) -> dict:
    """ShapeDtypeStructs of the whole cache (allocates nothing: usable at K3's full size); ``stacked``: the scanned
    layout (module docstring)."""
    flat = {"layers": {l: layer_cache_shapes(cfg, l, batch, max_len, run) for l in range(cfg.num_layers)},
            "lengths": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    if not stacked:
        return flat
    return jax.eval_shape(lambda c: stack_cache(c, cfg), flat)


def init_cache(cfg: K3Config, batch: int, max_len: int, run: RunConfig | None = None, *,
               stacked: bool = False) -> dict:
    """A zero cache for ``batch`` rows of up to ``max_len`` tokens each (``stacked``: the scanned layout)."""
    if batch < 1 or max_len < 1:
        raise CacheError(f"a cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        cache_shapes(cfg, batch, max_len, run, stacked=stacked))


def stack_cache(cache: dict, cfg: K3Config) -> dict:
    """A flat cache in the scanned layout: the repeating group's layers stacked per position of the period (the
    unstacked layers, lengths and marks as they are). A stacked cache is returned unchanged."""
    lay = layout(cfg)
    if "groups" in cache or not lay.groups:
        return cache
    layers = cache["layers"]
    at = lambda g, j: lay.start + g * lay.period + j  # noqa: E731
    groups = [jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[at(g, j)] for g in range(lay.groups)))
              for j in range(lay.period)]
    rest = {l: v for l, v in layers.items() if not lay.start <= l < at(lay.groups, 0)}
    return {**cache, "layers": rest, "groups": groups}


def unstack_cache(cache: dict, cfg: K3Config) -> dict:
    """The flat layout of a cache (a flat one is returned unchanged)."""
    if "groups" not in cache:
        return cache
    lay = layout(cfg)
    layers = dict(cache["layers"])
    for j, stack in enumerate(cache["groups"]):
        for g in range(lay.groups):
            layers[lay.start + g * lay.period + j] = jax.tree.map(lambda x, g=g: x[g], stack)
    out = {k: v for k, v in cache.items() if k != "groups"}
    return {**out, "layers": dict(sorted(layers.items()))}


def cache_bytes(cache) -> int:
    """Bytes of every array in the cache (marks included)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def max_len_of(cache) -> int | None:
    """Positions each row can hold (None for a cache without MLA layers: KDA state has no length limit)."""
    found = [v["c_kv"].shape[-2] for v in (*cache["layers"].values(), *cache.get("groups", ())) if "c_kv" in v]
    return found[0] if found else None


def advance(params, tokens, lengths, cache, *, cfg: K3Config, run: RunConfig, absorbed: bool, last_only: bool,
            dispatch=None, taps: tuple = ()):
    """The pure step under ``extend`` (no checks, not jitted): tokens [B, T] int32 with every padding id already
    0, lengths [B] int32 → (logits, the new cache), in either layout (a stacked cache runs the scanned group);
    with ``taps`` (layer indices) → (logits, cache, hidden [B, T, len(taps), D]). A cache with verify records gets
    the piece's positions in ``rec_pos``. ``k3 plan --mode prefill | decode`` compiles it with the cache's
    shardings (``CACHE_AXES``) and an expert-parallel ``dispatch``."""
    start = cache["lengths"]
    model = merge(params, cfg, run)
    kw = dict(start=start, lengths=lengths, absorbed=absorbed, last_only=last_only, dispatch=dispatch)
    if taps:
        kw["taps"] = tuple(taps)
    top = {"lengths": start + lengths}
    if "rec_pos" in cache:
        T = tokens.shape[1]
        if cache["rec_pos"].shape[1] != T:
            raise ValueError(f"the verify records were made for a piece of {cache['rec_pos'].shape[1]} tokens; "
                             f"this piece has {T}")
        top["rec_pos"] = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    if "groups" in cache:
        out = model.extend(tokens, dict(cache["layers"]), group_caches=cache["groups"], **kw)
        logits, new, groups = out[:3]
        new_cache = {**cache, "layers": new, "groups": list(groups), **top}
    else:
        view = [cache["layers"][l] for l in range(cfg.num_layers)]
        out = model.extend(tokens, view, **kw)
        logits, new = out[:2]
        new_cache = {**cache, "layers": dict(enumerate(new)), **top}
    return (logits, new_cache, out[-1]) if taps else (logits, new_cache)


_STATIC = ("cfg", "run", "absorbed", "last_only", "dispatch", "taps")
_extend = jax.jit(advance, static_argnames=_STATIC)
extend_donated = jax.jit(advance, static_argnames=_STATIC, donate_argnames=("cache",))  # bench/decode.py compiles it


def _check_piece(tokens, lengths, cache, cfg: K3Config):
    """Host-side checks of a piece (shapes, ids, room left) → (tokens int32, lengths int32)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise CacheError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")
    B, T = tokens.shape
    lengths = np.full((B,), T, np.int32) if lengths is None else np.asarray(lengths, np.int64)
    if lengths.shape != (B,):
        raise CacheError(f"lengths must be [B] = [{B}], got shape {lengths.shape}")
    if lengths.min(initial=0) < 0 or lengths.max(initial=0) > T:
        raise CacheError(f"lengths must lie in [0, {T}] (the piece's width), got {lengths.tolist()}")
    n_rows = cache["lengths"].shape[0]
    if n_rows != B:
        raise CacheError(f"the piece has {B} rows but the cache was allocated for {n_rows}")
    real = np.arange(T)[None, :] < lengths[:, None]
    ids = tokens[real]
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)][0]
        raise CacheError(f"token id {int(bad)} is outside the vocabulary [0, {cfg.vocab_size})")
    if "rec_pos" in cache:
        width = cache["rec_pos"].shape[1]
        if T != width:
            raise CacheError(f"the cache's verify records were made for a piece of {width} tokens; this piece has "
                             f"{T} (with_records(cache, cfg, {T}, mode))")
        if (host_value(cache["rec_pos"]) >= 0).any():
            raise CacheError("the cache already holds a recorded verify piece: roll it back (rollback) before "
                             "extending it again")
    cap = max_len_of(cache)
    have = host_value(cache["lengths"])  # rows split over processes: gathered from their holders
    if cap is not None and (have + lengths).max(initial=0) > cap:
        r = int(np.argmax(have + lengths))
        raise CacheError(f"row {r} would hold {int(have[r] + lengths[r])} tokens; the cache holds {cap} per row "
                         "(allocate a larger max_len)")
    return jnp.asarray(np.where(real, tokens, 0), jnp.int32), jnp.asarray(lengths, jnp.int32)


def extend(params, tokens, lengths, cache, cfg: K3Config, run: RunConfig | None = None, *, absorbed: bool = False,
           last_only: bool = False, donate: bool = False, dispatch=None, taps=()):
    """Advance every row by its own number of tokens: tokens [B, T] right-padded, lengths [B] (default all T).

    Returns (logits [B, T, W] — or [B, W] at each row's last real token with ``last_only`` — and the new cache);
    with ``taps`` (0-based layer indices) also hidden [B, T, len(taps), D] float32, the residual stream after each
    tapped layer at every position (also with ``last_only``).
    ``absorbed`` picks the MLA attention form (``ops.latent_attention``); ``donate`` lets XLA update the cache in
    place (the old cache must not be used afterwards); ``dispatch``: an ``ExpertParallel`` and / or a
    ``ContextParallel`` (k3jax.sharding.placement.expert_dispatch): the piece split over a mesh's context axis
    (a context-parallel prefill, whose cache decode then continues with any dispatch)."""
    taps = tuple(int(t) for t in taps)
    bad = [t for t in taps if not 0 <= t < cfg.num_layers]
    if bad:
        raise CacheError(f"taps {bad} are outside the model's layers [0, {cfg.num_layers})")
    tokens, lengths = _check_piece(tokens, lengths, cache, cfg)
    fn = extend_donated if donate else _extend
    return fn(params, tokens, lengths, cache, cfg=cfg, run=_run(cfg, run), absorbed=absorbed, last_only=last_only,
              dispatch=dispatch, taps=taps)


def _kda_only(layers: dict) -> dict:
    """The KDA layer caches of a cache's ``layers``."""
    return {l: v for l, v in layers.items() if "state" in v}


def prefill(params, tokens, lengths, cache, cfg: K3Config, run: RunConfig | None = None, *, marks=None,
            absorbed: bool = False, last_only: bool = False, dispatch=None):
    """Prefill (or continue) every row with its piece; the KDA layers run chunked, MLA attends blockwise.

    marks: None or [B] absolute positions (-1: none) at which to record each row's KDA state for a snapshot;
    a mark must lie within the row's new tokens, start <= mark <= start + length. Returns (logits, cache) as
    ``extend``; with marks the cache carries ``"marks": {"position": [B], "kda": {...}}``. ``dispatch``: as
    ``extend``'s (a context-parallel prefill; not with marks)."""
    if marks is None:
        return extend(params, tokens, lengths, cache, cfg, run, absorbed=absorbed, last_only=last_only,
                      dispatch=dispatch)
    if dispatch is not None:
        raise CacheError("marks (snapshots) run a prefill in two parts on one device: no dispatch")
    if "groups" in cache:
        raise CacheError("marks (snapshots) need the flat cache layout: unstack_cache(cache, cfg) first")
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    lengths = np.full((B,), T, np.int64) if lengths is None else np.asarray(lengths, np.int64)
    start = np.asarray(cache["lengths"], np.int64)
    marks = np.asarray(marks, np.int64)
    if marks.shape != (B,):
        raise CacheError(f"marks must be [B] = [{B}] positions (-1 for none), got shape {marks.shape}")
    for b in range(B):
        if marks[b] != -1 and not start[b] <= marks[b] <= start[b] + lengths[b]:
            raise CacheError(f"mark {int(marks[b])} of row {b} is outside its new tokens "
                             f"[{int(start[b])}, {int(start[b] + lengths[b])}]")
    first = np.where(marks >= 0, marks - start, lengths)                      # tokens before each row's mark
    # Both parts keep the piece's width T (right-padded): one compiled program whatever the marks are.
    logits1, mid = extend(params, tokens, first, cache, cfg, run, absorbed=absorbed)
    old = cache.get("marks")
    pos = np.where(marks >= 0, marks, -1 if old is None else np.asarray(old["position"]))
    kda = _kda_only(mid["layers"])
    if old is not None:                                   # rows without a new mark keep their earlier one
        kda = _select_rows(jnp.asarray(marks >= 0), kda, old["kda"])
    rest = lengths - first
    idx = np.minimum(first[:, None] + np.arange(T)[None, :], T - 1)
    second = np.take_along_axis(tokens, idx, axis=1)
    logits2, new = extend(params, second, rest, mid, cfg, run, absorbed=absorbed, last_only=last_only)
    new = {**new, "marks": {"position": jnp.asarray(pos, jnp.int32), "kda": kda}}
    if last_only:
        return jnp.where(jnp.asarray(rest > 0)[:, None], logits2, _last(logits1, first)), new
    # Row b's logits: its first ``first[b]`` positions from part 1, the rest from part 2, shifted back.
    t = np.arange(T)[None, :]
    i2 = np.clip(t - first[:, None], 0, T - 1)
    l2 = jnp.take_along_axis(logits2, jnp.asarray(i2)[:, :, None], axis=1)
    return jnp.where(jnp.asarray(t < first[:, None])[:, :, None], logits1, l2), new


def _last(logits, n):
    return jnp.take_along_axis(logits, jnp.asarray(np.maximum(n - 1, 0))[:, None, None], axis=1)[:, 0]


def _select_rows(sel, new: dict, old: dict) -> dict:
    """Per-row choice between two caches' layer dicts: ``new`` where sel [B], else ``old``."""
    def pick(a, b):
        return jnp.where(sel.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, new, old)


def decode_step(params, token_ids, cache, cfg: K3Config, run: RunConfig | None = None, *, active=None,
                absorbed: bool = True, donate: bool = False):
    """Advance every active row by one token: token_ids [B] → (logits [B, W], cache). ``active`` [B] bool
    (default all): an inactive row (e.g. one that stopped) is left exactly as it was."""
    ids = np.asarray(token_ids).reshape(-1, 1)
    n = np.ones((ids.shape[0],), np.int32) if active is None else np.asarray(active, np.int32)
    ids = np.where(n[:, None] > 0, ids, 0)
    return extend(params, ids, n, cache, cfg, run, absorbed=absorbed, last_only=True, donate=donate)


__all__ = ["CACHE_AXES", "CacheError", "advance", "cache_bytes", "cache_leaf_axes", "cache_shapes", "capacity",
           "decode_step", "extend", "extend_donated", "init_cache", "layer_cache_shapes", "max_len_of", "prefill",
           "stack_cache", "unstack_cache"]
