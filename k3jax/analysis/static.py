"""Static router analysis from the router tensors alone: no forward pass, no expert weights.

    report = static_router_analysis("Kimi-K3/", layers=[1, 46, 92])

For each chosen MoE layer it reads exactly two tensors — the router ``block_sparse_moe.gate.weight`` [E, d] and
the bias ``block_sparse_moe.gate.e_score_correction_bias`` [E] — and the headers of the shards holding them (found
through the index, so no other shard is opened). On the official K3 layout that is 12,845,056 + 3,584 bytes per
layer out of ~17 GB. Per layer:

- ``router_norm``: the L2 norm of each expert's router row w_e (its logit scale: s_e = σ(x · w_e));
- ``cosine``: cos(w_a, w_b) over expert pairs a != b — mean, max, and the most similar pairs (experts whose routers
  point the same way compete for the same tokens);
- ``bias``: the e_score_correction_bias b (selection-only, docs/model.md §7.1) — min, max, mean, std, range, histogram.
"""

from __future__ import annotations

import json
import os

import numpy as np

from k3jax.analysis.collect import check_layers
from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.container import INDEX_NAME, check_file_name, read_header
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.io import Checkpoint
from k3jax.checkpoint.plan import FLOAT_DTYPES
from k3jax.config import from_hf

ROUTER = "block_sparse_moe.gate.weight"
BIAS = "block_sparse_moe.gate.e_score_correction_bias"


def _router_names(cfg, layer: int) -> tuple[str, str]:
    pre = f"{nm.LAYOUTS[nm.default_layout(cfg)][0]}model.layers.{layer}."
    return pre + ROUTER, pre + BIAS


def open_router_tensors(path: str, names: list[str]) -> tuple[Checkpoint, int]:
    """A ``Checkpoint`` holding only ``names``, opened from the index and the headers of the shards that hold them
    (every shard's header when there is no index). Returns it and the header bytes read (8-byte prefix + JSON)."""
    path = os.fspath(path)
    idx_path = os.path.join(path, INDEX_NAME)
    if os.path.exists(idx_path):
        with open(idx_path, encoding="utf-8") as f:
            try:
                wm = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"not a valid index ({e})", file=INDEX_NAME) from None
        missing = [n for n in names if n not in wm]
        if missing:
            raise CheckpointError(f"no router tensors: the index lacks {missing[0]!r}"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""), file=INDEX_NAME)
        files = sorted({wm[n] for n in names})
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no {INDEX_NAME} and no .safetensors files", file=path)
    headers, tensors, header_bytes = {}, {}, 0
    for fname in files:
        check_file_name(fname, names[0], path)
        h = read_header(os.path.join(path, fname), fname)
        headers[fname] = h
        header_bytes += 8 + h.header_len
        for n, e in h.entries.items():
            if n in names:
                tensors[n] = e
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CheckpointError(f"no router tensors: {missing[0]!r} is in no shard header"
                              + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""), file=path)
    return Checkpoint(path, headers, {n: tensors[n] for n in names}), header_bytes


def _cosine_summary(W: np.ndarray, top: int) -> dict:
    n = np.linalg.norm(W, axis=1)
    U = W / np.where(n > 0, n, 1.0)[:, None]
    G = U @ U.T
    E = G.shape[0]
    off = ~np.eye(E, dtype=bool)
    vals = G[off]
    iu = np.triu_indices(E, 1)
    order = np.argsort(G[iu])[::-1][:top]
    return {"mean": float(vals.mean()) if vals.size else float("nan"),
            "max": float(vals.max()) if vals.size else float("nan"),
            "min": float(vals.min()) if vals.size else float("nan"),
            "top_pairs": [{"a": int(iu[0][i]), "b": int(iu[1][i]), "cos": float(G[iu][i])} for i in order]}


def static_router_analysis(path, layers=None, *, cfg=None, bins: int = 20, top_pairs: int = 5,
                           keep_arrays: bool = False) -> dict:
    """Router/bias statistics of MoE ``layers`` (0-based; default all) of the checkpoint at ``path``.

    Returns {"layers": [...], "bytes_read": payload bytes read, "header_bytes": header bytes read,
    "shards_touched": n, "config": name}. ``keep_arrays`` adds each layer's ``router_norms`` and ``bias`` arrays
    (lists) and the full cosine matrix under ``cosine_matrix`` (E × E floats: small presets only)."""
    path = os.fspath(path)
    if cfg is None:
        cfg_file = os.path.join(path, "config.json")
        if not os.path.exists(cfg_file):
            raise CheckpointError("no config.json", file=path)
        cfg = from_hf(cfg_file)
    layers = check_layers(cfg, layers)
    names = [n for l in layers for n in _router_names(cfg, l)]
    ck, header_bytes = open_router_tensors(path, names)
    out = []
    for l in layers:
        rn, bn = _router_names(cfg, l)
        er, eb = ck.tensors[rn], ck.tensors[bn]
        for e, want in ((er, (cfg.num_experts, cfg.hidden_size)), (eb, (cfg.num_experts,))):
            if e.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"dtype {e.dtype}, expected a float dtype", file=e.file, tensor=e.name)
            if e.shape != want:
                raise CheckpointError(f"shape {list(e.shape)}, expected {list(want)} for config {cfg.name!r}",
                                      file=e.file, tensor=e.name)
        W = ck.read_entry(er).astype(np.float64)
        b = ck.read_entry(eb).astype(np.float64)
        norms = np.linalg.norm(W, axis=1)
        hist, edges = np.histogram(b, bins=bins)
        d = {"layer": l,
             "router_norm": {"mean": float(norms.mean()), "std": float(norms.std()), "min": float(norms.min()),
                             "max": float(norms.max()), "argmax": int(norms.argmax()), "argmin": int(norms.argmin())},
             "cosine": _cosine_summary(W, top_pairs),
             "bias": {"min": float(b.min()), "max": float(b.max()), "mean": float(b.mean()), "std": float(b.std()),
                      "range": float(b.max() - b.min()), "histogram": hist.tolist(), "bin_edges": edges.tolist()}}
        if keep_arrays:
            d["router_norms"] = norms.tolist()
            d["bias_values"] = b.tolist()
            n = np.where(norms > 0, norms, 1.0)
            d["cosine_matrix"] = ((W / n[:, None]) @ (W / n[:, None]).T).tolist()
        out.append(d)
    ck.close()
    return {"config": cfg.name, "layers": out, "bytes_read": ck.bytes_read, "header_bytes": header_bytes,
            "shards_touched": len(ck.headers)}


__all__ = ["BIAS", "ROUTER", "open_router_tensors", "static_router_analysis"]
