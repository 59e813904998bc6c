"""Exact rollback of a speculative verify piece in the hybrid cache (``k3jax.model.cache``).

    cache = with_records(cache, cfg, T, "replay")              # record leaves for a verify piece of width T
    logits, cache = extend(params, piece, lengths, cache, cfg)  # the piece; KDA runs it token by token, recording
    cache = rollback(cache, cfg, keep)                          # as if row b had extended only its first keep[b]

Why records: an MLA layer's cache is positional (dropping a token zeroes its latent and shortens the row), but a KDA
layer folds every token into its state and conv tails, which cannot be un-run. The recorded extend leaves a KDA
layer's ``state`` and ``conv_*`` as they were at the piece's start (k3jax/layers/kda.py) and records what rebuilding
them after any prefix needs:

    copy    ``rec_state`` [B, T, N, K, V]: the state after each token; rollback picks one.
    replay  ``rec_k`` [B, T, N, K] (the written keys), ``rec_u`` [B, T, N, V] (the delta rule's update vectors
            u_j = beta_j (v_j - (Diag(exp g_j) S_{j-1})^T k_j)), ``rec_g`` [B, T, N, K] (G_j = g_1 + ... + g_j);
            rollback sums S_n = Diag(exp G_n) S_0 + sum_{j<=n} Diag(exp(G_n - G_j)) k_j u_j^T
            (``k3jax.ops.kda.recurrent.kda_replay``): 2K + V numbers per token and head instead of K V.
    both    ``rec_x`` [B, T, 3 N K]: the piece's pre-conv q|k|v projections; the conv tails after n tokens are the
            last Wc-1 inputs of (the tails at the start ++ rec_x[:, :n]).
    top     ``rec_pos`` [B, T] int32: the piece's positions (``advance`` writes them; -1 until a piece runs).

S_0 and the tails at the start are the cache's own leaves, not copies: a ``rec_s0`` would add a whole state per
layer (6 MiB per row at K3's full size), and keeping the pre-piece cache beside the new one would keep a second copy
of the MLA latents (gigabytes) whenever the extend cannot update them in place. The price is that a recorded cache is
pending between its extend and its rollback: ``cache.extend`` refuses to extend it again.

Memory per KDA layer and row at K3's full size (N = 96, K = V = 128, fp32) for T = 8: copy 51.5 MB (48 MiB of
states), replay 2.4 MB; ``record_bytes`` counts a whole cache. The MLA latents at the dropped positions
[start + keep, start + T) are zeroed (a scatter of those T positions per row, no pass over the cache), lengths become
start + keep, and the records are removed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config, RunConfig
from k3jax.distributed import host_value
from k3jax.errors import InputError
from k3jax.layers.kda import RECORDS
from k3jax.model.cache import CacheError, cache_bytes, cache_shapes
from k3jax.model.layout import layer_kind, layout
from k3jax.ops.kda.recurrent import kda_replay

MODES = ("copy", "replay", "both")  # "both": a cache that can roll back either way (tests compare the two)
_TAILS = ("conv_q", "conv_k", "conv_v")


def record_names(mode: str) -> tuple[str, ...]:
    """The record leaves of a KDA layer cache in ``mode`` ("copy" | "replay" | "both")."""
    if mode not in MODES:
        raise InputError(f"rollback mode must be one of {MODES}, got {mode!r}")
    picked = RECORDS["copy"] * (mode != "replay") + RECORDS["replay"] * (mode != "copy")
    return tuple(sorted(set(picked)))


def _is_record(name) -> bool:
    return isinstance(name, str) and name.startswith("rec_")


def _records_for(layer: dict, names, T: int) -> dict:
    """Zero records for one KDA layer cache (flat [B, ...] or stacked [G, B, ...] leaves)."""
    S = layer["state"]
    *lead, N, K, V = S.shape
    X = sum(layer[t].shape[-1] for t in _TAILS)
    shapes = {"rec_state": ((*lead, T, N, K, V), S.dtype), "rec_k": ((*lead, T, N, K), S.dtype),
              "rec_u": ((*lead, T, N, V), S.dtype), "rec_g": ((*lead, T, N, K), S.dtype),
              "rec_x": ((*lead, T, X), layer["conv_q"].dtype)}
    return {n: jnp.zeros(*shapes[n]) for n in names}


def with_records(cache: dict, cfg: K3Config, T: int, mode: str) -> dict:
    """``cache`` (either layout) with zero verify records for a piece of width T added to every KDA layer cache, and
    ``rec_pos`` [B, T] = -1 (module docstring). mode: "copy" | "replay" | "both". A cache that already has records
    is an error (roll it back first)."""
    names = record_names(mode)
    if int(T) < 1:
        raise InputError(f"a verify piece has at least one token, got T={T}")
    if "rec_pos" in cache:
        raise CacheError("the cache already carries verify records: roll it back (rollback) first")
    T = int(T)
    N, K = cfg.kda_num_heads, cfg.kda_head_dim

    def add(layer):
        if "state" not in layer:
            return layer
        if layer["state"].shape[-3:-1] != (N, K):
            raise CacheError(f"a KDA layer cache's state {tuple(layer['state'].shape)} does not match the config's "
                             f"{N} heads of {K} channels")
        return {**layer, **_records_for(layer, names, T)}

    out = {**cache, "layers": {l: add(v) for l, v in cache["layers"].items()},
           "rec_pos": jnp.full((cache["lengths"].shape[0], T), -1, jnp.int32)}
    if "groups" in cache:
        out["groups"] = [add(g) for g in cache["groups"]]
    return out


def _mode_of(cache: dict, mode: str | None) -> str:
    """The rollback mode: the one the cache's records allow (``mode`` must name it when they allow both)."""
    have = {n for layer in (*cache["layers"].values(), *cache.get("groups", ())) for n in layer if _is_record(n)}
    can = [m for m in ("copy", "replay") if have and set(RECORDS[m]) <= have]
    if mode is None:
        if len(can) > 1:
            raise InputError("the cache holds both copy and replay records: pass mode='copy' or mode='replay'")
        return can[0] if can else "copy"                # no KDA layer: only the MLA positions and lengths change
    if mode not in ("copy", "replay"):
        raise InputError(f"rollback mode must be 'copy' or 'replay', got {mode!r}")
    if have and mode not in can:
        raise InputError(f"the cache holds {sorted(have)}: not the records of a {mode} rollback")
    return mode


def _commit_kda(layer: dict, n, mode: str) -> dict:
    """One flat KDA layer cache after its first n [B] recorded tokens (records removed)."""
    tails = [layer[t] for t in _TAILS]
    W = tails[0].shape[1]                                                  # Wc - 1 inputs per tail
    x = jnp.concatenate([jnp.concatenate(tails, axis=-1), layer["rec_x"].astype(tails[0].dtype)], axis=1)
    idx = n[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]             # [B, Wc-1]: rows of (tails ++ rec_x)
    tail = jnp.take_along_axis(x, idx[:, :, None], axis=1)
    cuts = np.cumsum([t.shape[-1] for t in tails])[:-1].tolist()
    S0 = layer["state"]
    if mode == "copy":
        last = jnp.maximum(n - 1, 0)[:, None, None, None, None]
        picked = jnp.take_along_axis(layer["rec_state"], last, axis=1)[:, 0]
        S = jnp.where((n > 0)[:, None, None, None], picked.astype(S0.dtype), S0)
    else:
        S = kda_replay(S0, layer["rec_k"], layer["rec_u"], layer["rec_g"], n).astype(S0.dtype)
    kept = {k: v for k, v in layer.items() if not _is_record(k)}
    return {**kept, "state": S, **dict(zip(_TAILS, jnp.split(tail, cuts, axis=-1), strict=True))}


def _zero_dropped(layer: dict, drop, pos) -> dict:
    """One flat MLA layer cache with its latents at the dropped positions zeroed: drop, pos [B, T] (a position
    past the cache's capacity was never written and is skipped)."""
    B = pos.shape[0]
    rows = jnp.arange(B)[:, None]

    def zero(a):                                                            # [B, S, X]
        at = jnp.where(drop, pos, a.shape[1])                               # kept positions point past the end
        return a.at[rows, at].set(jnp.zeros((), a.dtype), mode="drop")

    return {k: zero(v) for k, v in layer.items()}


def rolled_back(cache: dict, cfg: K3Config, keep, *, start=None, mode: str | None = None) -> dict:
    """The pure rollback under ``rollback`` (no host checks; jit it with ``cfg`` and ``mode`` static).

    keep [B] int: tokens of the piece to keep per row, clipped to the row's real tokens (lengths - start);
    start [B] int: tokens in the cache before the piece (default: ``rec_pos[:, 0]``, what the extend wrote);
    mode: "copy" | "replay" (None: the one the records allow). Returns the cache as if row b had extended only its
    first keep[b] tokens: KDA states and conv tails rebuilt, MLA latents at [start + keep, start + T) zeroed,
    lengths = start + keep, every record removed. Either layout."""
    if "rec_pos" not in cache:
        raise CacheError("the cache carries no verify records (with_records before the verify extend)")
    mode = _mode_of(cache, mode)
    T = cache["rec_pos"].shape[1]
    start = cache["rec_pos"][:, 0] if start is None else jnp.asarray(start, jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    pos = start[:, None] + t
    n = jnp.clip(jnp.asarray(keep, jnp.int32), 0, cache["lengths"] - start)
    drop = t >= n[:, None]

    def commit(kind: str, layer: dict) -> dict:
        return _zero_dropped(layer, drop, pos) if kind == "mla" else _commit_kda(layer, n, mode)

    out = {k: v for k, v in cache.items() if k != "rec_pos"}
    out["layers"] = {l: commit(layer_kind(cfg, l)[0], v) for l, v in cache["layers"].items()}
    if "groups" in cache:
        lay = layout(cfg)
        out["groups"] = [jax.vmap(lambda v, j=j: commit(layer_kind(cfg, lay.start + j)[0], v))(g)
                         for j, g in enumerate(cache["groups"])]
    out["lengths"] = start + n
    return out


def _split(cache: dict) -> tuple[dict, dict]:
    """(the cache without its records, the records alone): only the first is donated (the records end here)."""
    def part(layer, records):
        return {k: v for k, v in layer.items() if _is_record(k) == records}

    base = {k: v for k, v in cache.items() if k != "rec_pos"}
    recs = {"rec_pos": cache["rec_pos"]}
    for key, parts in (("layers", lambda d, r: {l: part(v, r) for l, v in d.items()}),
                       ("groups", lambda d, r: [part(v, r) for v in d])):
        if key in cache:
            base[key], recs[key] = parts(cache[key], False), parts(cache[key], True)
    return base, recs


def _joined(base: dict, recs: dict, cfg: K3Config, keep, start, mode):
    cache = {**base, "rec_pos": recs["rec_pos"],
             "layers": {l: {**v, **recs["layers"][l]} for l, v in base["layers"].items()}}
    if "groups" in base:
        cache["groups"] = [{**v, **r} for v, r in zip(base["groups"], recs["groups"], strict=True)]
    return rolled_back(cache, cfg, keep, start=start, mode=mode)


_rollback = jax.jit(rolled_back, static_argnames=("cfg", "mode"))
_rollback_donated = jax.jit(_joined, static_argnames=("cfg", "mode"), donate_argnames=("base",))


def rollback(cache: dict, cfg: K3Config, keep, *, start=None, mode: str | None = None, donate: bool = False) -> dict:
    """Keep the first keep[b] tokens of the recorded verify piece in row b and undo the rest (``rolled_back``,
    jitted, after host checks: keep [B] in [0, T]; a piece has run). ``donate``: update the cache in place (the old
    cache must not be used afterwards). Rows kept whole end exactly as a plain extend of the piece would have left
    them, up to fp rounding (replay sums instead of stepping)."""
    if "rec_pos" not in cache:
        raise CacheError("the cache carries no verify records (with_records before the verify extend)")
    B, T = cache["rec_pos"].shape
    keep = np.asarray(keep)
    if keep.shape != (B,) or not np.issubdtype(keep.dtype, np.integer):
        raise CacheError(f"keep must be [B] = [{B}] integers, got {keep.dtype} of shape {keep.shape}")
    if keep.min(initial=0) < 0 or keep.max(initial=0) > T:
        raise CacheError(f"keep must lie in [0, {T}] (the verify piece's width), got {keep.tolist()}")
    _mode_of(cache, mode)                                                   # its errors before any compile
    if start is None and (host_value(cache["rec_pos"][:, 0]) < 0).any():
        raise CacheError("no verify piece has run on this cache since with_records: nothing to roll back")
    keep = jnp.asarray(keep, jnp.int32)
    start = None if start is None else jnp.asarray(start, jnp.int32)
    if donate:
        return _rollback_donated(*_split(cache), cfg, keep, start, mode)
    return _rollback(cache, cfg, keep, start=start, mode=mode)


def record_bytes(cfg: K3Config, batch: int, T: int, mode: str, run: RunConfig | None = None) -> int:
    """Bytes the verify records of a piece of width T add to a ``batch``-row cache (``with_records``; for plans)."""
    base = cache_shapes(cfg, batch, 1, run)
    rec = jax.eval_shape(lambda c: with_records(c, cfg, T, mode), base)
    return cache_bytes(rec) - cache_bytes(base)


__all__ = ["MODES", "record_bytes", "record_names", "rollback", "rolled_back", "with_records"]
