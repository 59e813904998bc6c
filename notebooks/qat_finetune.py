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
# # QAT fine-tuning: does MXFP4/MXFP8 fake-quant cost loss, and what does the MXFP4 export save?
#
# Question: starting from an exported checkpoint, how far apart do a QAT-off and a QAT-on (`weights+acts`, SPEC
# §10.7) fine-tune end, and how large is the packed MXFP4 export next to the bf16 one? Feeds the
# experiments/LOG.md entry "2026-11-29 QAT fine-tuning loop". Runs at k3-tiny in CI (`K3_NB_PRESET=k3-mini` and
# `K3_NB_STEPS=...` for a real run); outputs go to `$K3_NB_OUT` (default: a temp dir).
#
#     python notebooks/qat_finetune.py                  # or open it with jupytext

# %%
import json
import os
import tempfile

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from k3jax.train.loop import TrainConfig, train  # noqa: E402

PRESET = os.environ.get("K3_NB_PRESET", "k3-tiny")
STEPS = int(os.environ.get("K3_NB_STEPS", "12"))
OUT = os.environ.get("K3_NB_OUT") or tempfile.mkdtemp(prefix="qat_nb_")
os.makedirs(OUT, exist_ok=True)
# The base run and the QAT-off fine-tune compile the same step program: a persistent cache makes the second free.
jax.config.update("jax_compilation_cache_dir", os.path.join(OUT, "jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
common = dict(steps=STEPS, batch=4, seq_len=32, lr=3e-3, max_bytes=300_000, eval_every=STEPS, eval_windows=8,
              devices=1, progress=False, peak_flops=1e9)
print(f"preset {PRESET}, {STEPS} steps per run, outputs in {OUT}")

# %% [markdown]
# ## 1. A base model: a short pre-training run, exported in the official layout (bf16 experts)

# %%
base = train(TrainConfig(preset=PRESET, export=os.path.join(OUT, "base"), **common))
print(f"base: loss {base['final_loss']:.3f}, held-out {base['final_eval_loss']:.3f} "
      f"(unigram entropy {base['heldout_unigram_entropy']:.3f} nats)")

# %% [markdown]
# ## 2. Fine-tune from the exported checkpoint with QAT off and on (same data order: batches depend on (seed, step))

# %%
runs = {}
for qat in ("off", "weights+acts"):
    tag = qat.replace("+", "_")
    runs[qat] = train(TrainConfig(preset=PRESET, init=os.path.join(OUT, "base"), qat=qat, seed=1,
                                  export=os.path.join(OUT, f"ft_{tag}"), **common))
    print(f"QAT {qat:13s}: final loss {runs[qat]['final_loss']:.4f}, held-out {runs[qat]['final_eval_loss']:.4f}")
gap = runs["weights+acts"]["final_eval_loss"] - runs["off"]["final_eval_loss"]
print(f"held-out gap (QAT on − off): {gap:+.4f} nats")

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for qat, r in runs.items():
    ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"QAT {qat}")
ax.set_xlabel("fine-tune step")
ax.set_ylabel("train loss (nats/byte)")
ax.set_title(f"{PRESET}: QAT off vs weights+acts")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(OUT, "qat_loss.png"), dpi=100)

# %% [markdown]
# ## 3. Export sizes: packed MXFP4 experts (QAT on) vs bf16 experts (QAT off)

# %%
size_bf16 = runs["off"]["export"]["total_size"]
size_mx = runs["weights+acts"]["export"]["total_size"]
print(f"bf16-expert export {size_bf16:,} B; MXFP4-expert export {size_mx:,} B ({size_mx / size_bf16:.3f}×)")
summary = {"preset": PRESET, "steps": STEPS, "gap_eval": gap,
           "eval": {q: r["final_eval_loss"] for q, r in runs.items()},
           "base_eval": base["final_eval_loss"], "unigram_entropy": base["heldout_unigram_entropy"],
           "export_bytes": {"bf16": size_bf16, "mxfp4": size_mx},
           "losses": {q: r["losses"] for q, r in runs.items()}}
with open(os.path.join(OUT, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
