"""Collect routing from forward passes over a token stream or token rows, in bounded memory.

    fn = routing_fn(cfg, layers=[1, 2], fields=("ids",))            # jitted: (params, tokens [B, T]) -> {l: {...}}
    stats = RoutingStats(cfg, layers=[1, 2], vocab=cfg.vocab_size)
    for win, mask in windows(stream, seq_len=128, batch=8):
        stats.update(win, fn(params, win), mask)
    report = stats.result()

The stream is cut into windows of ``seq_len`` tokens (each window is an independent sequence: the model sees no
context across windows); [B, T] rows right-padded with -1 are B sequences, each cut into windows only where it is
longer than ``seq_len``; ``batch`` windows go through one compiled forward, the last batch padded with masked
windows. Only the requested fields of the requested MoE layers leave the device, so memory is
O(batch · seq_len · k · layers) per step plus the fixed-size accumulators of ``RoutingStats`` — flat in the number
of tokens. On a mesh the windows are split over the mesh's first axis; the routing of a window does not depend on
which device ran it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.analysis import metrics as am
from k3jax.config import default_run
from k3jax.distributed import host_value
from k3jax.errors import InputError
from k3jax.model import forward, layer_view
from k3jax.sharding.context_parallel import ContextParallel

FIELDS = ("ids", "weights", "scores", "biased", "cutoff")
DENSE_SPEC_LIMIT = 1 << 24  # V · E above this: the token-specialization table is kept sparse


def moe_layers(cfg) -> list[int]:
    return [l for l in range(cfg.num_layers) if cfg.is_moe(l)]


def check_layers(cfg, layers: Sequence[int] | None) -> list[int]:
    """The requested 0-based decoder layers (default: every MoE layer); a non-MoE layer is an InputError."""
    all_moe = moe_layers(cfg)
    if layers is None:
        return all_moe
    bad = [l for l in layers if l not in all_moe]
    if bad:
        raise InputError(f"layer(s) {bad} are not MoE layers of {cfg.name!r}; its MoE layers are "
                         f"{all_moe[0]}..{all_moe[-1]} (0-based decoder layers)")
    return sorted(set(int(l) for l in layers))


def routing_fn(cfg, layers: Sequence[int] | None = None, fields: Sequence[str] = ("ids",), run=None, dispatch=None):
    """A jitted ``(params, tokens [B, T]) -> {layer: {field: array}}`` over ``forward(..., return_aux=True)``.

    Fields: ``ids`` [B, T, k] int32 (best first), ``weights`` [B, T, k] combine weights, ``scores`` [B, T, E]
    unbiased sigmoid scores, ``biased`` [B, T, E] scores + bias (what selects), ``cutoff`` [B, T] the (k+1)-th
    biased score. Unrequested outputs (logits, other layers' routing) are dead code and not computed past the
    last requested layer. One function per (config, layers, fields, run settings, dispatch) in a process, so its
    compiles are reused by every later call with the same shapes. ``dispatch``: the model's (e.g. a
    ``ContextParallel``: each window's sequence split over a context axis)."""
    layers = check_layers(cfg, layers)
    bad = [f for f in fields if f not in FIELDS]
    if bad:
        raise ValueError(f"unknown routing field(s) {bad}; known: {FIELDS}")

    return _routing_fn(cfg, tuple(layers), tuple(fields), default_run(cfg) if run is None else run, dispatch)


@functools.cache
def _routing_fn(cfg, layers: tuple[int, ...], fields: tuple[str, ...], run, dispatch):
    order = moe_layers(cfg)

    def route(params, tokens):
        _, aux = forward(params, tokens, cfg, run, return_aux=True, dispatch=dispatch)
        out = {}
        for l in layers:
            r = aux["routing"][order.index(l)]
            d = {}
            for f in fields:
                if f == "biased":
                    d[f] = r.scores + layer_view(params, cfg, l)["moe"]["bias"].astype(r.scores.dtype)
                else:
                    d[f] = getattr(r, f)
            out[l] = d
        return out

    return jax.jit(route)


def _rows(tokens) -> tuple[np.ndarray, np.ndarray]:
    """([B, T] rows, [B] lengths): a 1-D stream is one row of only real ids; a 2-D array's rows are right-padded
    with -1 (any negative id ends the real part of its row)."""
    t = np.asarray(tokens)
    if t.ndim == 1:
        return t[None], np.array([t.size], np.int64)
    if t.ndim != 2:
        raise ValueError(f"tokens must be a [T] stream or [B, T] rows, got shape {list(t.shape)}")
    real = t >= 0
    n = real.sum(axis=1)
    if (real != (np.arange(t.shape[1]) < n[:, None])).any():
        raise ValueError("token rows must be right-padded with -1 (padding only at the end of a row)")
    return t, n


def row_lengths(tokens, max_tokens: int | None = None) -> np.ndarray:
    """[B] tokens routed from each row of ``tokens`` (see ``windows``): the row lengths, cut so that the rows taken
    in order hold at most ``max_tokens`` in all."""
    n = _rows(tokens)[1]
    if max_tokens is not None:
        n = np.clip(max_tokens - (np.cumsum(n) - n), 0, n)
    return n


def _plan(tokens, seq_len: int, max_tokens: int | None, width_multiple_of: int = 1):
    """(rows, window row ids, starts, lengths, width) of every window, rows in order, each row's windows in order."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    t = _rows(tokens)[0]
    n = row_lengths(tokens, max_tokens)
    if n.sum() == 0:
        raise ValueError("the token stream is empty")
    per = -(-n // seq_len)                                  # windows per row
    row = np.repeat(np.arange(n.size), per)
    start = (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)) * seq_len
    length = np.minimum(seq_len, n[row] - start)
    width = seq_len if np.ndim(tokens) == 1 else int(min(seq_len, n.max()))
    return t, row, start, length, -(-width // width_multiple_of) * width_multiple_of


def num_batches(tokens, seq_len: int, batch: int, *, max_tokens: int | None = None, multiple_of: int = 1) -> int:
    """How many (tokens, mask) pairs ``windows`` yields."""
    batch = -(-batch // multiple_of) * multiple_of
    return -(-_plan(tokens, seq_len, max_tokens)[1].size // batch)


def windows(tokens, seq_len: int, batch: int, *, max_tokens: int | None = None, multiple_of: int = 1,
            width_multiple_of: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Cut token sequences into windows of at most ``seq_len`` → [batch, W] int32 (tokens, mask) pairs; each window
    is an independent sequence, padded with token 0 under ``mask == False``, and the last batch is filled with
    empty windows. ``batch`` is rounded up to ``multiple_of``, W to ``width_multiple_of`` (masked padding: the model
    is causal, so a real position never sees it).

    ``tokens`` [T]: one stream, cut into consecutive windows of ``seq_len`` (W = seq_len). ``tokens`` [B, T]: B
    independent sequences right-padded with -1; each row starts its own window, a row longer than ``seq_len`` is cut
    into windows of ``seq_len``, and W = min(seq_len, longest row), so a row that fits is routed as the
    model's forward over the [B, T] rows routes it. ``max_tokens``: only the first ``max_tokens`` real ids, rows in
    order (``row_lengths``)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    t, row, start, length, width = _plan(tokens, seq_len, max_tokens, width_multiple_of)
    batch = -(-batch // multiple_of) * multiple_of
    for i in range(0, row.size, batch):
        tok = np.zeros((batch, width), np.int32)
        mask = np.zeros((batch, width), bool)
        for j, (r, s, m) in enumerate(zip(row[i:i + batch], start[i:i + batch], length[i:i + batch])):
            tok[j, :m] = t[r, s:s + m]
            mask[j, :m] = True
        yield tok, mask


class RoutingStats:
    """Fixed-size accumulators over routed windows, per MoE layer: exact loads, co-activation counts (all pairs and
    rank-adjacent), token and byte-class specialization counts, stickiness and cross-layer agreement sums.

    Memory: [L, E] + 2 [L, E, E] + [L, V, E] (sparse when V·E > ``DENSE_SPEC_LIMIT``) + [L, 6, E] integers,
    independent of the number of tokens (except the sparse table, bounded by distinct (token, expert) pairs).
    """

    def __init__(self, cfg, layers: Sequence[int] | None = None, *, vocab: int | None = None,
                 byte_classes: bool | None = None):
        self.layers = check_layers(cfg, layers)
        self.E, self.k = cfg.num_experts, cfg.num_experts_per_token
        self.V = vocab or cfg.vocab_size
        self.byte_classes = self.V <= 256 if byte_classes is None else byte_classes
        L = len(self.layers)
        self.tokens = 0
        self.occ = np.zeros(self.V, np.int64)
        self.class_occ = np.zeros(len(am.BYTE_CLASSES), np.int64)
        self.load = np.zeros((L, self.E), np.int64)
        self.coact = np.zeros((L, self.E, self.E), np.int64)
        self.coact_adj = np.zeros((L, self.E, self.E), np.int64)
        self.dense_spec = self.V * self.E <= DENSE_SPEC_LIMIT
        self.tok_spec = np.zeros((L, self.V, self.E), np.int64) if self.dense_spec else [dict() for _ in range(L)]
        self.class_spec = np.zeros((L, len(am.BYTE_CLASSES), self.E), np.int64)
        self.stick = np.zeros((L, 3))  # sum of set overlap, sum of top-1 repeats, number of pairs
        self.agree = np.zeros((max(L - 1, 0), 2))  # sum of overlap, tokens

    def update(self, tokens, routed: dict, mask=None) -> None:
        """``tokens`` [B, T], ``routed`` {layer: {"ids": [B, T, k], ...}} (from ``routing_fn``), ``mask`` [B, T]."""
        tok = np.asarray(tokens)
        m = np.ones(tok.shape, bool) if mask is None else np.asarray(mask, bool)
        flat_tok = tok[m].astype(np.int64)
        self.tokens += int(m.sum())
        self.occ += np.bincount(flat_tok, minlength=self.V)[:self.V]
        classes = am.byte_class(flat_tok) if self.byte_classes else None
        if classes is not None:
            self.class_occ += np.bincount(classes, minlength=len(am.BYTE_CLASSES))
        prev = None
        for i, l in enumerate(self.layers):
            ids = np.asarray(routed[l]["ids"])
            sel = ids[m]  # [N, k]
            self.load[i] += am.expert_load(sel, self.E)
            self.coact[i] += am.coactivation_counts(sel, self.E, "all")
            self.coact_adj[i] += am.coactivation_counts(sel, self.E, "rank_adjacent")
            if self.dense_spec:
                self.tok_spec[i] += am.specialization_counts(flat_tok, sel, self.V, self.E)
            else:
                codes, cnt = np.unique((flat_tok[:, None] * self.E + sel).reshape(-1), return_counts=True)
                d = self.tok_spec[i]
                for c, n in zip(codes.tolist(), cnt.tolist()):
                    d[c] = d.get(c, 0) + n
            if classes is not None:
                self.class_spec[i] += am.specialization_counts(classes, sel, len(am.BYTE_CLASSES), self.E)
            pair = m[:, :-1] & m[:, 1:]
            if pair.any():
                ov = am.set_overlap(ids[:, :-1], ids[:, 1:])
                self.stick[i] += (ov[pair].sum(), (ids[:, :-1, 0] == ids[:, 1:, 0])[pair].sum(), pair.sum())
            if prev is not None:
                self.agree[i - 1] += (am.set_overlap(prev, sel).sum(), sel.shape[0])
            prev = sel

    def _token_spec_table(self, i) -> tuple[np.ndarray, np.ndarray]:
        """(counts [V', E], occurrences [V']) for layer index i; the sparse form keeps only seen tokens."""
        if self.dense_spec:
            return self.tok_spec[i], self.occ
        seen = np.nonzero(self.occ)[0]
        pos = {int(v): j for j, v in enumerate(seen)}
        N = np.zeros((seen.size, self.E), np.int64)
        for c, n in self.tok_spec[i].items():
            N[pos[c // self.E], c % self.E] = n
        return N, self.occ[seen]

    def result(self, *, min_count: int = 10, top_pairs: int = 5) -> dict:
        """The report: {"tokens", "layers": [per layer: load + metrics], "cross_layer_agreement": [...]}.

        Per layer: ``layer`` (0-based decoder index), ``load`` (exact ints), the ``metrics.load_stats`` keys,
        ``coactivation_top`` (largest P(b | a), all pairs), ``coactivation_rank_adjacent_top``,
        ``token_specialization`` and (byte vocabularies) ``byte_class_specialization`` (``metrics.specialization``
        without the per-key tables), ``stickiness`` {set, top1}."""
        out_layers = []
        for i, l in enumerate(self.layers):
            load = self.load[i]
            d = {"layer": l, "load": load.tolist(), **am.load_stats(load)}
            d["coactivation_top"] = am.top_coactivated_pairs(am.coactivation(self.coact[i], load), top_pairs)
            d["coactivation_rank_adjacent_top"] = am.top_coactivated_pairs(
                am.coactivation(self.coact_adj[i], load), top_pairs)
            N, occ = self._token_spec_table(i)
            ts = am.specialization(N, occ, self.k, min_count)
            d["token_specialization"] = {k: v for k, v in ts.items() if k not in ("per_key", "top_expert")}
            if self.byte_classes:
                cs = am.specialization(self.class_spec[i], self.class_occ, self.k, min_count)
                d["byte_class_specialization"] = {
                    "mean": cs["mean"], "random_baseline": cs["random_baseline"],
                    "per_class": {am.BYTE_CLASSES[c]: v for c, v in cs["per_key"].items()},
                    "top_expert": {am.BYTE_CLASSES[c]: v for c, v in cs["top_expert"].items()}}
            s = self.stick[i]
            d["stickiness"] = {"set": float(s[0] / s[2]) if s[2] else float("nan"),
                               "top1": float(s[1] / s[2]) if s[2] else float("nan")}
            out_layers.append(d)
        agree = [{"layers": [self.layers[i], self.layers[i + 1]], "agreement": float(a[0] / a[1]) if a[1] else
                  float("nan")} for i, a in enumerate(self.agree)]
        return {"tokens": self.tokens, "num_experts": self.E, "top_k": self.k, "layers": out_layers,
                "cross_layer_agreement": agree}


def collect(params, cfg, tokens, *, layers=None, seq_len: int = 128, batch: int = 8, max_tokens: int | None = None,
            mesh=None, fields: Sequence[str] = ("ids",), keep: bool = False, run=None, compare_params=None,
            progress=None):
    """Route ``tokens`` through the model and accumulate ``RoutingStats``: a 1-D stream cut into windows of
    ``seq_len``, or [B, T] independent sequences right-padded with -1 (padding is in no statistic); see ``windows``.

    Returns (report, stats, kept): ``report`` = ``stats.result()`` (plus ``drift``), ``stats`` the accumulators
    (full co-activation and specialization tables), ``kept`` None unless ``keep`` — then {"tokens": [N] int,
    "mask": [N] bool, layer: {field: [N, ...]}} of every routed window (only for small runs: it grows with the tokens).
    ``compare_params``: a second parameter tree of the same config (e.g. after a QAT fine-tune); the report then
    has ``drift`` per layer ({saturation, top1}, ``metrics.drift``) on the same windows.
    ``mesh``: windows are sharded over its first axis (params replicated), batch rounded up to its size; with a
    ``context`` axis each window's sequence is split over it too (``ContextParallel``: the window width is rounded
    up to a multiple of its ways, with masked padding; a stream's ``seq_len`` must be one).
    """
    from jax.sharding import NamedSharding, PartitionSpec

    layers = check_layers(cfg, layers)
    fields = tuple(dict.fromkeys(("ids", *fields)))
    dispatch, mult, wmult = None, 1, 1
    put = jnp.asarray
    if mesh is not None:
        ax = mesh.axis_names[0]
        mult = mesh.shape[ax]
        if mesh.shape.get("context", 1) > 1:
            dispatch = ContextParallel(mesh, "fsdp", batch=-(-batch // mult) * mult)
            wmult = dispatch.n
            if np.ndim(tokens) == 1:
                dispatch.check(seq_len, "--seq-len")
        sh = NamedSharding(mesh, PartitionSpec(ax))
        put = lambda t: jax.device_put(t, sh)  # noqa: E731
        rep = NamedSharding(mesh, PartitionSpec())
        params = jax.device_put(params, rep)
        if compare_params is not None:
            compare_params = jax.device_put(compare_params, rep)
    fn = routing_fn(cfg, layers, fields, run, dispatch)
    stats = RoutingStats(cfg, layers)
    kept = {"tokens": [], "mask": [], **{l: {f: [] for f in fields} for l in layers}} if keep else None
    drift = np.zeros((len(layers), 3))
    it = windows(tokens, seq_len, batch, max_tokens=max_tokens, multiple_of=mult, width_multiple_of=wmult)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, total=num_batches(tokens, seq_len, batch, max_tokens=max_tokens, multiple_of=mult),
                  desc="route", unit="batch")
    for tok, mask in it:
        routed = jax.tree.map(host_value, fn(params, put(tok)))  # from every process holding a share
        stats.update(tok, routed, mask)
        if compare_params is not None:
            other = jax.tree.map(host_value, fn(compare_params, put(tok)))
            for i, l in enumerate(layers):
                a, b = routed[l]["ids"][mask], other[l]["ids"][mask]
                drift[i] += (am.set_overlap(a, b).sum(), (a[:, 0] == b[:, 0]).sum(), a.shape[0])
        if keep:
            kept["tokens"].append(tok.reshape(-1))
            kept["mask"].append(mask.reshape(-1))
            for l in layers:
                for f in fields:
                    v = np.asarray(routed[l][f])
                    kept[l][f].append(v.reshape(-1, *v.shape[2:]))
    report = stats.result()
    if compare_params is not None:
        for i, d in enumerate(report["layers"]):
            d["drift"] = {"saturation": float(drift[i, 0] / drift[i, 2]), "top1": float(drift[i, 1] / drift[i, 2])}
    if keep:
        kept = {k: (np.concatenate(v) if isinstance(v, list) else {f: np.concatenate(x) for f, x in v.items()})
                for k, v in kept.items()}
    return report, stats, kept


__all__ = ["DENSE_SPEC_LIMIT", "FIELDS", "RoutingStats", "check_layers", "collect", "moe_layers", "num_batches",
           "routing_fn", "row_lengths", "windows"]
