"""The routing figures (k3jax.analysis.plots) read on their own: every axis labelled, every series of a panel named in
its legend, every colour map with a labelled colour bar, and the label-shuffled baseline drawn with the values given.
The figures are built on hand-made reports and inspected as matplotlib Figure objects (Agg; path=None)."""

import numpy as np
import pytest

from k3jax.analysis import metrics as am
from k3jax.analysis import plots as ap

E, K, LAYERS = 8, 2, [1, 2, 3]


def report(scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    layers = []
    for l in LAYERS:
        load = rng.integers(50, 150, E)
        layers.append({"layer": l, "load": load.tolist(), **am.load_stats(load),
                       "token_specialization": {"mean": 0.6 * scale},
                       "byte_class_specialization": {"mean": 0.4 * scale,
                                                     "per_class": {c: 0.3 + 0.1 * i for i, c in
                                                                   enumerate(am.BYTE_CLASSES)}},
                       "drift": {"saturation": 0.9, "top1": 0.8}})
    return {"tokens": 1000, "num_experts": E, "top_k": K, "layers": layers}


def colorbar_axes(fig):
    return {im.colorbar.ax for ax in fig.axes for im in ax.images if im.colorbar is not None}


def check_labelled(fig):
    """Each plotting panel has a title and both axis labels; each image has a colour bar with a label; a panel with
    more than one named series has a legend naming all of them."""
    cbars = colorbar_axes(fig)
    panels = [ax for ax in fig.axes if ax not in cbars]
    assert panels
    for ax in panels:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), (ax.get_title(), ax.get_xlabel(),
                                                                        ax.get_ylabel())
        for im in ax.images:
            assert im.colorbar is not None and im.colorbar.ax.get_ylabel(), ax.get_title()
        named = [a.get_label() for a in (*ax.lines, *ax.containers, *ax.patches)
                 if not a.get_label().startswith("_")]
        if len(set(named)) > 1:
            assert ax.get_legend() is not None, ax.get_title()
            shown = {t.get_text() for t in ax.get_legend().get_texts()}
            assert set(named) <= shown, (ax.get_title(), set(named) - shown)
    return panels


@pytest.fixture(autouse=True)
def close_figures():
    yield
    ap._plt().close("all")


def test_every_figure_is_labelled():
    r = report()
    P = np.full((E, E), 1 / E)
    static = {"layers": [{"layer": l, "router_norm": {"mean": 0.5, "std": 0.1}, "bias": {"min": -0.2, "max": 0.3}}
                         for l in LAYERS]}
    figs = [ap.load_heatmap(r, None), ap.load_histogram(r, None), ap.coactivation_heatmap(P, 1, None),
            ap.specialization_bars(r, None), ap.drift_per_layer(r, None), ap.static_norms(static, None)]
    for fig in figs:
        check_labelled(fig)
    for fig in (figs[0], figs[2], figs[3]):  # the heatmaps: one labelled colour bar each
        assert len(colorbar_axes(fig)) == 1


def test_specialization_shows_the_shuffled_baseline_and_init():
    shuffled = {l: {"token": 0.2 + 0.01 * l, "byte_class": 0.15} for l in LAYERS}
    fig = ap.specialization_bars(report(), None, baselines={"init": report(0.5, seed=1)}, shuffled=shuffled)
    token, byte_class, heat = check_labelled(fig)
    for ax, key in ((token, "token"), (byte_class, "byte_class")):
        bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
        assert list(bars) == ["this model", "init", "shuffled labels"]
        assert bars["shuffled labels"] == pytest.approx([shuffled[l][key] for l in LAYERS])
        assert bars["init"] == pytest.approx([0.3 if key == "token" else 0.2] * len(LAYERS))
        assert any(line.get_ydata()[0] == K / E for line in ax.lines)  # the k/E line
    assert heat.get_xlabel() == "byte class" and heat.get_ylabel() == "layer"
    assert [t.get_text() for t in heat.get_yticklabels()] == [str(l) for l in LAYERS]


def test_qb_curves_name_every_layer():
    n = len(LAYERS)
    traj = {"steps": np.arange(1, 6), "load_max_over_mean": np.linspace(2, 1.1, 5 * n).reshape(5, n),
            "qb_bias_range": np.linspace(0, 0.5, 5 * n).reshape(5, n)}
    fig = ap.qb_curves(traj, None, layers=LAYERS)
    for ax in check_labelled(fig):
        assert [t.get_text() for t in ax.get_legend().get_texts()][:n] == [f"layer {l}" for l in LAYERS]
    fig = ap.qb_curves(traj, None)  # without layer ids: MoE layers in order
    assert fig.axes[1].get_legend().get_texts()[0].get_text() == "MoE layer 1"
    with pytest.raises(ValueError, match="2 layer names for 3"):
        ap.qb_curves(traj, None, layers=LAYERS[:2])


def test_a_path_writes_the_file_and_returns_it(tmp_path):
    path = ap.load_heatmap(report(), str(tmp_path / "sub" / "h.png"))
    assert path == str(tmp_path / "sub" / "h.png") and (tmp_path / "sub" / "h.png").stat().st_size > 1000
