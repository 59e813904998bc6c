# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # How does a trained k3-mini route? Every metric of `k3jax.analysis`, on the shipped model
#
# The shipped model (`k3jax/assets/k3-mini-stdlib`, trained on the standard-library corpus, finished with a QAT
# phase, stored with MXFP4 experts) routes held-out text it never saw. We measure load balance, co-activation,
# token and byte-class specialization (against the init checkpoint and a label-shuffled baseline), locality, the
# Quantile Balancing trajectory of its training run, its router tensors, and the drift a short QAT fine-tune causes.
# Every definition is in the docstrings of `k3jax/analysis/metrics.py`. Outputs go to `$K3_NB_OUT`; `$K3_NB_CKPT`
# points at another checkpoint; `$K3_NB_TOKENS` sets the held-out tokens routed (default 16384).
#
#     python notebooks/routing_analysis.py              # or open it with jupytext

# %%
import json
import os
import tempfile

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")

from k3jax.analysis import collect as ac  # noqa: E402
from k3jax.analysis import metrics as am  # noqa: E402
from k3jax.analysis import plots as ap  # noqa: E402
from k3jax.analysis.static import static_router_analysis  # noqa: E402
from k3jax.checkpoint.load import load  # noqa: E402
from k3jax.cli.source import default_ckpt  # noqa: E402
from k3jax.train import data as tdata  # noqa: E402
from k3jax.train.evaluate import windowed_loss  # noqa: E402

CKPT = os.environ.get("K3_NB_CKPT") or default_ckpt()
OUT = os.environ.get("K3_NB_OUT") or tempfile.mkdtemp(prefix="route_nb_")
N_TOK = int(os.environ.get("K3_NB_TOKENS", "16384"))
SEQ = 64  # the training context of the shipped model: held-out windows are scored (and routed) at that length
os.makedirs(OUT, exist_ok=True)
assert CKPT is not None, "no shipped model in this install: set K3_NB_CKPT"
cfg, params = load(CKPT, progress=False)
_, held = tdata.split(tdata.load_corpus(None, max_bytes=4 << 20), 0.05)  # the run's held-out tail
text = held[:N_TOK].astype(np.int32)
nats, n_scored = windowed_loss(params, cfg, text, seq_len=SEQ)
print(f"{CKPT}: {cfg.name}, {cfg.num_experts} experts top-{cfg.num_experts_per_token}; held-out loss "
      f"{nats:.3f} nats/byte on {n_scored:,} bytes (unigram entropy {tdata.unigram_entropy(held):.3f})")
summary = {"heldout_nats_per_byte": nats, "tokens_scored": n_scored}

# %% [markdown]
# ## 1. Load balance per layer
# Exact assignment counts per expert; max/mean (MaxVio = max/mean − 1), coefficient of variation, entropy and unused
# experts. Quantile Balancing trained the biases towards equal loads on *training* batches of 32k tokens; on 16k
# held-out tokens the batch-composition noise alone keeps max/mean above 1 (experiments/LOG.md, QB floor).

# %%
report, stats, kept = ac.collect(params, cfg, text, seq_len=SEQ, batch=16, keep=True)
for d in report["layers"]:
    print(f"layer {d['layer']}: max/mean {d['max_over_mean_load']:.2f}  MaxVio {d['maxvio']:.2f}  CV "
          f"{d['load_cv']:.3f}  entropy {d['load_entropy_bits']:.2f}/{d['max_entropy_bits']:.2f} bits  unused "
          f"{d['experts_unused']}")
print(ap.load_heatmap(report, os.path.join(OUT, "load_heatmap.png")))
print(ap.load_histogram(report, os.path.join(OUT, "load_histogram.png")))
summary["max_over_mean_load"] = [d["max_over_mean_load"] for d in report["layers"]]

# %% [markdown]
# ## 2. Co-activation
# P(b | a) over every pair in a token's top-k (OLMoE's definition); a uniform router gives (k−1)/(E−1) everywhere.
# The rank-adjacent variant counts only experts adjacent in the ranking.

# %%
l0 = report["layers"][0]["layer"]
Pab = am.coactivation(stats.coact[0], stats.load[0])
uniform = (cfg.num_experts_per_token - 1) / (cfg.num_experts - 1)
print(f"layer {l0}: largest P(b|a) {Pab.max():.3f} vs uniform {uniform:.3f}; top pairs "
      f"{am.top_coactivated_pairs(Pab, 3)}")
print("rank-adjacent top pairs:", am.top_coactivated_pairs(am.coactivation(stats.coact_adj[0], stats.load[0]), 3))
print(ap.coactivation_heatmap(Pab, l0, os.path.join(OUT, f"coactivation_layer{l0}.png")))
summary["coactivation_max"] = float(Pab.max())

# %% [markdown]
# ## 3. Specialization: is it learned?
# spec(v) = the fraction of id v's occurrences routed to v's most frequent expert (ids with ≥ 10 occurrences). A
# random init already beats k/E (its router is a fixed random function of the token), so the trained model is
# compared with (a) the same metric on its init checkpoint, shipped beside it (`init_routing.json`, the same
# held-out tokens), and (b) the label-shuffled baseline: each token's expert ids permuted independently.

# %%
ids_by_layer = {l: kept[l]["ids"][kept["mask"]] for l in ac.check_layers(cfg, None)}
toks = kept["tokens"][kept["mask"]]
init_path = os.path.join(CKPT, "init_routing.json")
init = json.load(open(init_path)) if os.path.exists(init_path) else None
rows = []
for d in report["layers"]:
    l = d["layer"]
    base = am.shuffled_baseline(toks, ids_by_layer[l], cfg.num_experts, cfg.num_experts_per_token, seed=l)
    shuf, shuf_c = base["token"], base["byte_class"]
    init_l = next((x for x in init["layers"] if x["layer"] == l), None) if init else None
    rows.append({"layer": l, "token": d["token_specialization"]["mean"], "token_shuffled": shuf,
                 "token_init": init_l["token_specialization"]["mean"] if init_l else None,
                 "class": d["byte_class_specialization"]["mean"], "class_shuffled": shuf_c,
                 "class_init": init_l["byte_class_specialization"]["mean"] if init_l else None})
for r in rows:
    print(f"layer {r['layer']}: token spec {r['token']:.3f} (init {r['token_init']}, shuffled "
          f"{r['token_shuffled']:.3f}); byte-class spec {r['class']:.3f} (init {r['class_init']}, shuffled "
          f"{r['class_shuffled']:.3f})")
print(ap.specialization_bars(report, os.path.join(OUT, "specialization.png"),
                            baselines={"init": init} if init else None))
summary["specialization"] = rows

# %% [markdown]
# ## 4. Locality and depth
# Stickiness (Mixtral's syntactic locality): how much of the top-k set consecutive bytes share. Cross-layer
# agreement: how often adjacent MoE layers pick the same expert *labels* for a token (labels are arbitrary per
# layer, so ≈ k/E means no alignment, as expected).

# %%
for d in report["layers"]:
    print(f"layer {d['layer']}: stickiness set {d['stickiness']['set']:.3f} top-1 {d['stickiness']['top1']:.3f}")
for a in report["cross_layer_agreement"]:
    print(f"agreement {a['layers']}: {a['agreement']:.3f} (k/E = {cfg.num_experts_per_token / cfg.num_experts:.3f})")
print(ap.colored_text_html(toks[:3000], ids_by_layer[l0][:3000, 0], cfg.num_experts,
                          os.path.join(OUT, f"top1_layer{l0}.html"), layer=l0))

# %% [markdown]
# ## 5. Quantile Balancing during training (the shipped metrics file)

# %%
mpath = os.path.join(CKPT, "metrics.jsonl")
if os.path.exists(mpath):
    traj = am.qb_trajectory(mpath)
    worst = traj["load_max_over_mean"].max(axis=1)
    first = next((int(s) for s, w in zip(traj["steps"], worst) if w <= 1.2), None)
    print(f"{len(traj['steps'])} logged steps; worst layer max/mean at the first step {worst[0]:.2f}, last "
          f"{worst[-1]:.2f}; first step with every layer <= 1.2: {first}")
    print(ap.qb_curves(traj, os.path.join(OUT, "qb_curves.png")))
    summary["qb_worst_last"] = float(worst[-1])

# %% [markdown]
# ## 6. The router tensors alone (static analysis: reads only router and bias bytes)

# %%
st = static_router_analysis(CKPT)
print(f"read {st['bytes_read']:,} tensor bytes + {st['header_bytes']:,} header bytes from {st['shards_touched']} "
      "shards")
for d in st["layers"]:
    print(f"layer {d['layer']}: router norm {d['router_norm']['mean']:.3f}±{d['router_norm']['std']:.3f}, "
          f"cos mean {d['cosine']['mean']:+.3f} max {d['cosine']['max']:+.3f}, bias range {d['bias']['range']:.3f}")
print(ap.static_norms(st, os.path.join(OUT, "static_router.png")))

# %% [markdown]
# ## 7. Drift under a short QAT fine-tune
# A few steps of `weights+acts` QAT from the shipped weights, then the same held-out tokens through both models:
# router saturation = mean |top-k(before) ∩ top-k(after)| / k per layer (1 = routing unchanged).

# %%
from k3jax.train.loop import TrainConfig, train  # noqa: E402

ft_dir = os.path.join(OUT, "qat_ft")
train(TrainConfig(preset=None, init=CKPT, qat="weights+acts", steps=int(os.environ.get("K3_NB_FT_STEPS", "3")),
                  batch=8, seq_len=64, lr=3e-4, eval_every=10**6, devices=1, progress=False, peak_flops=1e9,
                  export=ft_dir))
_, after = load(ft_dir, cfg=cfg, progress=False)
drift_rep, _, _ = ac.collect(params, cfg, text, seq_len=SEQ, batch=16, compare_params=after)
for d in drift_rep["layers"]:
    print(f"layer {d['layer']}: saturation {d['drift']['saturation']:.3f}, top-1 agreement {d['drift']['top1']:.3f}")
print(ap.drift_per_layer(drift_rep, os.path.join(OUT, "drift.png")))
summary["drift_saturation"] = [d["drift"]["saturation"] for d in drift_rep["layers"]]
with open(os.path.join(OUT, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print("summary:", os.path.join(OUT, "summary.json"))
jax.clear_caches()
