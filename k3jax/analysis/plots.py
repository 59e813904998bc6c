"""Figures for ``k3 route --plots DIR`` and the routing notebook (matplotlib, Agg backend; nothing is shown).

Each function takes the report dicts that ``collect.collect`` / ``static.static_router_analysis`` return (plus the
kept routing for the token-coloured text) and writes one file, returning its path; a figure function given
``path=None`` returns the open ``matplotlib.figure.Figure`` instead (for inspection; the caller closes it). Every
axis is labelled, every series named in a legend, and every colour map has a labelled colour bar.
"""

from __future__ import annotations

import html
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    fig.tight_layout()
    if path is None:
        return fig
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def load_heatmap(report: dict, path: str | None) -> str | Figure:
    """Layers × experts: each expert's load divided by the layer's mean load (1 = perfectly balanced)."""
    plt = _plt()
    L = np.array([d["load"] for d in report["layers"]], np.float64)
    rel = L / np.maximum(L.mean(axis=1, keepdims=True), 1e-12)
    fig, ax = plt.subplots(figsize=(min(16, 2 + 0.12 * L.shape[1]), 1.5 + 0.35 * L.shape[0]))
    im = ax.imshow(rel, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_yticks(range(L.shape[0]), [str(d["layer"]) for d in report["layers"]])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"load / mean load ({report['tokens']:,} tokens, top-{report['top_k']})")
    fig.colorbar(im, ax=ax, label="expert load / layer's mean load (1 = balanced)")
    return _save(fig, path)


def load_histogram(report: dict, path: str | None) -> str | Figure:
    """Distribution of load / mean over all (layer, expert) pairs, with max/mean per layer in the legend."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in report["layers"]:
        L = np.asarray(d["load"], np.float64)
        ax.hist(L / max(L.mean(), 1e-12), bins=30, histtype="step",
                label=f"layer {d['layer']} (max/mean {d['max_over_mean_load']:.2f})")
    ax.axvline(1.0, color="k", lw=0.8, ls="--", label="balanced (1)")
    ax.set_xlabel("expert load / layer's mean load")
    ax.set_ylabel("experts")
    ax.set_title(f"expert load distribution ({report['tokens']:,} tokens)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def coactivation_heatmap(P: np.ndarray, layer: int, path: str | None) -> str | Figure:
    """P(b | a) for one layer (rows a, columns b), diagonal blanked."""
    plt = _plt()
    P = np.array(P, np.float64)
    np.fill_diagonal(P, np.nan)
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(P, cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert b")
    ax.set_ylabel("expert a (given)")
    ax.set_title(f"layer {layer}: P(b | a) co-activation")
    fig.colorbar(im, ax=ax, label="P(b in top-k | a in top-k)")
    return _save(fig, path)


def specialization_bars(report: dict, path: str | None, baselines: dict | None = None,
                        shuffled: dict | None = None) -> str | Figure:
    """Token and byte-class specialization per layer against k/E and baselines: ``baselines`` {label: report} (such
    as the init checkpoint's routing report) and ``shuffled`` {layer: ``metrics.shuffled_baseline`` dict} (the
    label-shuffled routing of the same tokens); then this model's per-class specialization as a layers × classes
    heatmap."""
    plt = _plt()
    layers = report["layers"]
    lids = [d["layer"] for d in layers]
    classes = list(layers[0].get("byte_class_specialization", {}).get("per_class", {}))
    fig, axes = plt.subplots(1, 3 if classes else 1, figsize=(16, 4.2) if classes else (6, 4), squeeze=False)
    axes = axes[0]
    x = np.arange(len(layers))

    def per_layer(rep, key):  # rep's mean of `key` per layer of this report (NaN where rep lacks the layer)
        by = {d["layer"]: d.get(key, {}).get("mean", np.nan) for d in rep["layers"]}
        return [by.get(l, np.nan) for l in lids]

    series = {"this model": lambda key: per_layer(report, key)}
    for name, rep in (baselines or {}).items():
        series[name] = lambda key, rep=rep: per_layer(rep, key)
    if shuffled:
        names = {"token_specialization": "token", "byte_class_specialization": "byte_class"}
        series["shuffled labels"] = lambda key: [shuffled.get(l, {}).get(names[key], np.nan) for l in lids]
    w = 0.8 / len(series)
    k_over_e = report["top_k"] / report["num_experts"]
    panels = [("token_specialization", "token specialization (ids with >= 10 occurrences)")]
    if classes:
        panels.append(("byte_class_specialization", "byte-class specialization (mean over classes)"))
    for ax, (key, title) in zip(axes, panels):
        for j, (name, values) in enumerate(series.items()):
            ax.bar(x + j * w, values(key), w, label=name)
        ax.axhline(k_over_e, color="k", ls="--", lw=0.8, label="k/E (router ignores the token)")
        ax.set_xticks(x + 0.4 - w / 2, [str(l) for l in lids])
        ax.set_ylim(0, 1.0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel("share routed to the top expert")
        ax.legend(fontsize=7)
    if classes:
        m = np.array([[d["byte_class_specialization"]["per_class"].get(c, np.nan) for c in classes] for d in layers])
        im = axes[2].imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        axes[2].set_xticks(range(len(classes)), classes, rotation=30, fontsize=7)
        axes[2].set_yticks(range(len(layers)), [str(l) for l in lids])
        axes[2].set_xlabel("byte class")
        axes[2].set_ylabel("layer")
        axes[2].set_title("this model: specialization per byte class", fontsize=10)
        fig.colorbar(im, ax=axes[2], label="share of the class routed to its top expert")
    return _save(fig, path)


def drift_per_layer(report: dict, path: str | None) -> str | Figure:
    """Router saturation (top-k overlap) and top-1 agreement per layer between two checkpoints."""
    plt = _plt()
    layers = [d for d in report["layers"] if "drift" in d]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [d["layer"] for d in layers]
    ax.plot(x, [d["drift"]["saturation"] for d in layers], "o-", label="saturation |top-k(A) ∩ top-k(B)| / k")
    ax.plot(x, [d["drift"]["top1"] for d in layers], "s-", label="top-1 agreement")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("layer")
    ax.set_ylabel("agreement (1 = routing unchanged)")
    ax.set_title("routing drift between two checkpoints")
    ax.legend(fontsize=7)
    return _save(fig, path)


def qb_curves(traj: dict, path: str | None, layers=None) -> str | Figure:
    """Per-layer max/mean load and bias range over training steps (``metrics.qb_trajectory``), one line per MoE layer
    (named in the legends); ``layers``: their decoder indices for the legend (default: MoE layer 1, 2, ... in order)."""
    plt = _plt()
    from matplotlib.ticker import FormatStrFormatter

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    s = traj["steps"]
    n = traj["load_max_over_mean"].shape[1]
    names = [f"layer {l}" for l in layers] if layers is not None else [f"MoE layer {j + 1}" for j in range(n)]
    if len(names) != n:
        raise ValueError(f"{len(names)} layer names for {n} MoE layers in the trajectory")
    colors = plt.get_cmap("tab10")(np.arange(n)) if n <= 10 else plt.get_cmap("viridis")(np.linspace(0, 0.9, n))
    for j in range(n):
        axes[0].plot(s, traj["load_max_over_mean"][:, j], lw=0.8, color=colors[j], label=names[j])
        axes[1].plot(s, traj["qb_bias_range"][:, j], lw=0.8, color=colors[j], label=names[j])
    axes[0].axhline(1.2, color="k", ls="--", lw=0.8, label="max/mean = 1.2")
    axes[0].set_yscale("log")
    for axis in (axes[0].yaxis.set_major_formatter, axes[0].yaxis.set_minor_formatter):
        axis(FormatStrFormatter("%g"))  # 1, 2, 3 rather than 10^0, 2x10^0
    axes[0].set_title("max/mean expert load per MoE layer (training batches)")
    axes[0].set_ylabel("max / mean expert load (log scale)")
    axes[1].set_title("bias range (max - min) per MoE layer")
    axes[1].set_ylabel("e_score_correction_bias max - min")
    for a in axes:
        a.set_xlabel("training step")
        a.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def colored_text_html(tokens, top1, num_experts: int, path: str, *, layer: int, decode=None,
                      max_tokens: int = 4000) -> str:
    """The text with each token's background coloured by its top-1 expert in ``layer`` (hover: expert id).
    ``decode(token id) -> str`` (default: the byte as Latin-1)."""
    plt = _plt()
    cmap = plt.get_cmap("tab20" if num_experts <= 20 else "hsv")
    decode = decode or (lambda t: bytes([t]).decode("latin-1") if t < 256 else f"<{t}>")
    parts = [f"<html><head><meta charset='utf-8'><title>layer {layer} top-1 experts</title></head>"
             f"<body style='font-family:monospace;white-space:pre-wrap'><h3>layer {layer}: token background = "
             f"top-1 expert (of {num_experts})</h3>"]
    for t, e in zip(np.asarray(tokens)[:max_tokens].tolist(), np.asarray(top1)[:max_tokens].tolist()):
        r, g, b, _ = cmap((e % 20) / 20 if num_experts <= 20 else e / num_experts)
        parts.append(f"<span title='expert {e}' style='background:rgba({int(r * 255)},{int(g * 255)},"
                     f"{int(b * 255)},0.45)'>{html.escape(decode(t))}</span>")
    parts.append("</body></html>")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(parts))
    return path


def static_norms(static: dict, path: str | None) -> str | Figure:
    """Router row norms and bias ranges per layer from ``static_router_analysis``."""
    plt = _plt()
    layers = static["layers"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [d["layer"] for d in layers]
    axes[0].errorbar(x, [d["router_norm"]["mean"] for d in layers], yerr=[d["router_norm"]["std"] for d in layers],
                     fmt="o")
    axes[0].set_title("router row norm (mean ± std over experts)")
    axes[0].set_ylabel("L2 norm of an expert's router row")
    axes[1].plot(x, [d["bias"]["min"] for d in layers], "v", label="min")
    axes[1].plot(x, [d["bias"]["max"] for d in layers], "^", label="max")
    axes[1].set_title("e_score_correction_bias (min and max over experts)")
    axes[1].set_ylabel("bias")
    axes[1].legend(fontsize=7)
    for a in axes:
        a.set_xlabel("layer")
    return _save(fig, path)


__all__ = ["coactivation_heatmap", "colored_text_html", "drift_per_layer", "load_heatmap", "load_histogram",
           "qb_curves", "specialization_bars", "static_norms"]
