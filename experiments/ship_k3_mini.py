"""Finish the shipped k3-mini: its init checkpoint's routing statistics, and the numbers for the LOG.

    python experiments/ship_k3_mini.py k3jax/assets/k3-mini-stdlib --metrics /work/runs/k3mini/metrics.jsonl

1. Copies the training metrics JSONL beside the model (QB bias and load trajectories).
2. Builds the init parameters exactly as `k3 train` does (jit of init_params at --seed), routes the first
   --tokens held-out bytes through them and writes ``init_routing.json`` (the baseline the notebook compares with).
3. Measures the shipped model as loaded from its MXFP4 export: held-out loss over the whole held-out tail at the
   training context (64), and token / byte-class specialization against the init and a label-shuffled baseline.
Prints one JSON object (the LOG entry's figures).
"""

import argparse
import json
import os
import shutil

import jax
import numpy as np

from k3jax.analysis import collect as ac
from k3jax.analysis import metrics as am
from k3jax.checkpoint.load import load
from k3jax.model import init_params
from k3jax.train import data as tdata
from k3jax.train.evaluate import windowed_loss


def spec_vs_shuffled(cfg, kept, layer, seed):
    m = kept["mask"]
    b = am.shuffled_baseline(kept["tokens"][m], kept[layer]["ids"][m], cfg.num_experts, cfg.num_experts_per_token,
                             seed=seed)
    return {"token_shuffled": b["token"], "class_shuffled": b["byte_class"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    shutil.copyfile(a.metrics, os.path.join(a.ckpt, "metrics.jsonl"))
    cfg, params = load(a.ckpt, progress=False)
    _, held = tdata.split(tdata.load_corpus(None, max_bytes=4 << 20), 0.05)
    nats, scored = windowed_loss(params, cfg, held.astype(np.int32), seq_len=64, batch=32)
    text = held[:a.tokens].astype(np.int32)
    init = jax.jit(lambda k: init_params(cfg, k))(jax.random.key(a.seed))
    init_rep, _, init_kept = ac.collect(init, cfg, text, seq_len=64, batch=16, keep=True)
    init_rep["source"] = f"init of k3-mini, seed {a.seed} (as k3 train draws it)"
    init_rep["heldout_tokens"] = a.tokens
    with open(os.path.join(a.ckpt, "init_routing.json"), "w") as f:
        json.dump(init_rep, f)
    rep, _, kept = ac.collect(params, cfg, text, seq_len=64, batch=16, keep=True)
    rows = []
    for d, di in zip(rep["layers"], init_rep["layers"]):
        l = d["layer"]
        rows.append({"layer": l, "token": d["token_specialization"]["mean"],
                     "token_init": di["token_specialization"]["mean"],
                     "class": d["byte_class_specialization"]["mean"],
                     "class_init": di["byte_class_specialization"]["mean"], **spec_vs_shuffled(cfg, kept, l, l),
                     "max_over_mean_load": d["max_over_mean_load"]})
    print(json.dumps({"heldout_nats_per_byte": nats, "heldout_tokens_scored": scored,
                      "unigram_entropy": tdata.unigram_entropy(held), "specialization": rows}, indent=1))


if __name__ == "__main__":
    main()
