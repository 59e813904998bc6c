"""A trained LoRA adapter merged into its base and written as one checkpoint, then checked against the base +
adapter it came from (`k3 export OUT --from BASE --merge-adapter DIR`).

    result = export_merged("base/", "adapter/", "merged/", heldout="experiments/sft/chat_heldout.jsonl")
    result.summary["logits_rel_rms_merged_vs_adapter"], result.tensors        # what the MXFP4 grid kept, per stack

The base is loaded with its experts dequantized (exact), the adapter (PEFT's layout) checked against it and merged,
W + (alpha / r) A B, with the routed experts re-quantized as the base stores them (``checkpoint.merge``: how much of
each delta the grid keeps); the merged checkpoint is written in the official layout, read back, and compared with
the base + adapter: logits on ``tokens`` (a token file, ``checkpoint.source.load_token_file``; default 4 rows of 64
random ids) and, with ``heldout`` chat data, the loss on the assistant's tokens (``train.chat_eval.answer_loss``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from k3jax.checkpoint.load import load
from k3jax.checkpoint.merge import merge_adapter
from k3jax.checkpoint.peft import load_adapter
from k3jax.checkpoint.save import save
from k3jax.checkpoint.source import load_token_file
from k3jax.config import default_run
from k3jax.layers.experts import merge_trees
from k3jax.model import forward
from k3jax.testing import rel_rms
from k3jax.train.chat_eval import answer_loss


class MergedExport(NamedTuple):
    """What ``export_merged`` wrote and measured.

    summary: the checkpoint (``dir``), the adapter (``adapter``, ``rank``, ``alpha``, ``targets``), the
        re-quantization summary (``requantization``), the logits' rel-RMS of the merged checkpoint and of the
        base, each against base + adapter; with ``heldout``, ``heldout_answer_nats`` (base, adapter, merged) and
        ``adapter_gain_kept`` (None when the adapter gained nothing).
    tensors: per layer and expert stack, what the grid kept (``checkpoint.merge.merge_adapter``'s report).
    files: the shards written."""

    summary: dict
    tensors: dict
    files: list


def export_merged(base: str, adapter: str, out: str, *, tokens: str | None = None, heldout: str | None = None,
                  overwrite: bool = False, manifest: bool = False, strict_config: bool = False) -> MergedExport:
    """Merge ``adapter`` into the checkpoint ``base``, write it to ``out`` (``checkpoint.save``; ``overwrite``,
    ``manifest`` as there) and compare what was written with base + adapter (module docstring)."""
    cfg, base_params = load(base, strict_config=strict_config)          # experts dequantized (exact)
    run = default_run(cfg)
    lora, leaves = load_adapter(adapter, cfg, run)
    adapted = merge_trees(base_params, leaves)
    merged, report = merge_adapter(adapted, cfg, lora)
    r = save(merged, cfg, out, overwrite=overwrite, manifest=manifest, progress=False)
    _, reloaded = load(out)
    run_l = run.replace(lora=lora)
    if tokens:
        rows = load_token_file(tokens, cfg.vocab_size)
        ids = np.where(rows.mask, rows.tokens, 0)           # padding ids are scored too, identically on both sides
    else:
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 64))
    want = np.asarray(forward(adapted, ids, cfg, run_l))
    got = np.asarray(forward(reloaded, ids, cfg, run))
    summary = {"dir": r["dir"], "adapter": adapter, "rank": lora.rank, "alpha": lora.alpha,
               "targets": list(lora.targets), "requantization": report["summary"],
               "logits_rel_rms_merged_vs_adapter": rel_rms(got, want),
               "logits_rel_rms_base_vs_adapter": rel_rms(np.asarray(forward(base_params, ids, cfg, run)), want)}
    if heldout:
        summary["heldout_answer_nats"] = h = {"adapter": answer_loss(adapted, cfg, run_l, heldout)[0],
                                              "merged": answer_loss(reloaded, cfg, run, heldout)[0],
                                              "base": answer_loss(base_params, cfg, run, heldout)[0]}
        gain = h["base"] - h["adapter"]
        summary["adapter_gain_kept"] = (h["base"] - h["merged"]) / gain if gain and math.isfinite(gain) else None
    return MergedExport(summary, report["tensors"], r["files"])


__all__ = ["MergedExport", "export_merged"]
