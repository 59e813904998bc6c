"""Exact prefix snapshots of one row of the hybrid cache, at any token position, with a provenance key.

    key = provenance(cfg, params_fp, prompt[:p], run)                  # params_fp = params_fingerprint(params)
    logits, cache = prefill(params, prompt[None], None, cache, cfg, marks=[p])   # p anywhere inside the prompt
    snap = snapshot(cache, row=0, position=p, key=key)                 # host arrays: KDA state + latents [0, p)
    cache = restore(other_cache, row=3, snap=snap, key=provenance(cfg, params_fp, new_prompt[:p], run))

A snapshot holds, for every layer, what the cache holds for the row after its first ``position`` tokens: the KDA
recurrent state and conv tails (from the cache when the row's length is ``position``, else from the marks an
earlier ``prefill(..., marks=...)`` recorded there — the exact chunked-prefill state at that token, not only at a
chunk end) and the MLA latents of positions [0, position). ``restore`` zeroes the target row in every layer first,
so a recycled slot (stale values, NaNs) leaves nothing behind, then writes the snapshot and sets the row's length.

The provenance key names the model and the prompt the state belongs to: a config hash, a parameter fingerprint,
the hash of the token prefix and the dtypes. ``restore`` refuses a snapshot whose key differs from the one given
for the model and prompt it is used with, naming the field that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config, RunConfig, default_run
from k3jax.model.cache import CacheError


class SnapshotMismatchError(CacheError):
    """A snapshot used with another model, parameter set, prompt or dtype; the message names the field."""


@dataclass(frozen=True)
class ProvenanceKey:
    config: str  # sha256 of the architecture (K3Config fields, the name excluded)
    params: str  # parameter fingerprint (``params_fingerprint``)
    dtype: str  # compute dtype (which fixes the cache dtypes)
    length: int  # tokens in the prefix
    prefix: str  # sha256 of the int32 token prefix


@dataclass(frozen=True)
class Snapshot:
    key: ProvenanceKey
    position: int
    layers: tuple  # per layer (layer order): {name: np.ndarray} without the batch axis


def config_hash(cfg: K3Config) -> str:
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def params_fingerprint(params) -> str:
    """sha256 over every parameter leaf's path, shape, dtype and bytes (computed once per loaded model; it reads
    every byte, e.g. ~0.1 s for k3-mini's 120 MB)."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(x)
        h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def prefix_hash(tokens) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int32).reshape(-1).astype("<i4").tobytes()).hexdigest()


def provenance(cfg: K3Config, params_fp: str, prefix_tokens, run: RunConfig | None = None) -> ProvenanceKey:
    run = default_run(cfg) if run is None else run
    prefix = np.asarray(prefix_tokens).reshape(-1)
    return ProvenanceKey(config_hash(cfg), params_fp, f"compute={jnp.dtype(run.compute_dtype).name}",
                         int(prefix.size), prefix_hash(prefix))


def _check_key(have: ProvenanceKey, want: ProvenanceKey) -> None:
    names = {"config": "the model config", "params": "the parameters", "prefix": "the prompt's token prefix",
             "length": "the prefix length", "dtype": "the dtypes"}
    for f in dataclasses.fields(ProvenanceKey):
        a, b = getattr(have, f.name), getattr(want, f.name)
        if a != b:
            raise SnapshotMismatchError(f"snapshot refused: {names[f.name]} differ ({f.name}: snapshot {str(a)[:16]}, "
                                   f"here {str(b)[:16]})")


def _layers_view(cache, cfg: K3Config) -> list:
    return [cache["layers"][l] for l in range(cfg.num_layers)]


def snapshot(cache, row: int, position: int, *, cfg: K3Config, key: ProvenanceKey) -> Snapshot:
    """Row ``row``'s cache after its first ``position`` tokens (module docstring) → a host ``Snapshot``."""
    lengths = np.asarray(cache["lengths"])
    if not 0 <= row < lengths.shape[0]:
        raise CacheError(f"row {row} is outside the cache's {lengths.shape[0]} rows")
    if key.length != position:
        raise CacheError(f"the key describes a {key.length}-token prefix but the snapshot is at position {position}")
    if position == int(lengths[row]):
        kda_src = None
    else:
        marks = cache.get("marks")
        mark = -1 if marks is None else int(np.asarray(marks["position"])[row])
        if mark != position:
            raise CacheError(f"row {row} holds {int(lengths[row])} tokens and no KDA state was recorded at position "
                             f"{position} (recorded: {mark if mark >= 0 else 'none'}); prefill with marks=[..., "
                             f"{position}, ...] to snapshot there")
        kda_src = marks["kda"]
    out = []
    for l, d in enumerate(_layers_view(cache, cfg)):
        if "c_kv" in d:
            out.append({k: np.asarray(v[row])[:position] for k, v in d.items()})
        else:
            src = d if kda_src is None else kda_src[l]
            out.append({k: np.asarray(v[row]) for k, v in src.items()})
    return Snapshot(key, int(position), tuple(out))


def restore(cache, row: int, snap: Snapshot, *, cfg: K3Config, key: ProvenanceKey):
    """A copy of ``cache`` whose row ``row`` is the snapshot's state (zeroed first); refuses a mismatched key."""
    _check_key(snap.key, key)
    lengths = np.asarray(cache["lengths"])
    if not 0 <= row < lengths.shape[0]:
        raise CacheError(f"row {row} is outside the cache's {lengths.shape[0]} rows")
    view = _layers_view(cache, cfg)
    if len(view) != len(snap.layers):
        raise SnapshotMismatchError(f"snapshot has {len(snap.layers)} layers, the cache {len(view)}")
    new = []
    for l, (d, s) in enumerate(zip(view, snap.layers, strict=True)):
        if set(d) != set(s):
            raise SnapshotMismatchError(f"layer {l}: snapshot entries {sorted(s)} do not fit the cache's {sorted(d)}")
        if "c_kv" in d and snap.position > d["c_kv"].shape[1]:
            raise CacheError(f"the snapshot holds {snap.position} tokens; the cache rows hold {d['c_kv'].shape[1]}")
        nd = {}
        for k, v in d.items():
            want = v.shape[2:] if "c_kv" in d else v.shape[1:]
            if s[k].shape[1 if "c_kv" in d else 0:] != want:
                raise SnapshotMismatchError(f"layer {l} {k}: snapshot shape {s[k].shape} does not fit the cache's "
                                       f"{tuple(v.shape)}")
            full = np.zeros(v.shape[1:], v.dtype)       # the whole row is written: a recycled slot starts clean
            full[: s[k].shape[0]] = s[k]
            nd[k] = v.at[row].set(full)
        new.append(nd)
    out = {**cache, "layers": dict(enumerate(new)),
           "lengths": jnp.asarray(cache["lengths"]).at[row].set(snap.position)}
    if "marks" in out:
        out["marks"] = {**out["marks"], "position": jnp.asarray(out["marks"]["position"]).at[row].set(-1)}
    return out


__all__ = ["ProvenanceKey", "Snapshot", "SnapshotMismatchError", "config_hash", "params_fingerprint", "prefix_hash",
           "provenance", "restore", "snapshot"]
