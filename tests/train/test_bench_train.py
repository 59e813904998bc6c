"""`k3 bench train`: the FLOP count behind MFU against its closed form (default suite), and the benchmark itself at a
tiny size with QAT weights+acts and bf16 compute (slow: compiling the full train step takes tens of seconds)."""

import json
import math
from typing import NamedTuple

import numpy as np
import pytest

from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.model import abstract_params, count_params
from k3jax.train.flops import flops_per_token


class _Moe(NamedTuple):
    experts: dict


def test_flops_per_token_counts_six_per_active_matmul_weight():
    """Adding weights to any tree changes flops_per_token by exactly 6 per matmul weight (routed experts: k/E of
    their weights); vectors and the embedding count nothing. Dict, list and attribute key paths alike."""
    cfg = get_preset("k3-tiny")  # top-2 of 8 routed experts
    base = {"embed": np.zeros((97, 64))}
    f0 = flops_per_token(cfg, base, 32)
    leaves = {"w": np.zeros((64, 10)), "norm": np.zeros(64), "stack": [np.zeros((3, 4, 5))]}
    assert flops_per_token(cfg, {**base, "blk": leaves}, 32) - f0 == 6 * (640 + 60)
    experts = {"moe": {"experts": {"w1": np.zeros((8, 64, 32))}}}
    assert flops_per_token(cfg, {**base, **experts}, 32) - f0 == 6 * 64 * 32 * 2  # 2 of 8 experts active
    as_attr = {"moe": _Moe(experts={"w1": np.zeros((8, 64, 32))})}  # GetAttrKey("experts") in the path
    assert flops_per_token(cfg, {**base, **as_attr}, 32) - f0 == 6 * 64 * 32 * 2
    assert flops_per_token(cfg, {**base, "embed2": np.zeros((97, 64))}, 32) - f0 == 6 * 97 * 64  # only "embed" is free
    stacked = {"groups": {"layers": {0: {"norm": np.zeros((3, 64)), "w": np.zeros((3, 64, 10))}}}}  # G = 3 layers
    assert flops_per_token(cfg, {**base, **stacked}, 32) - f0 == 6 * 3 * 640  # a stacked [G, D] norm is a vector
    assert f0 == flops_per_token(cfg, {}, 32) > 0  # the attention terms alone
    assert flops_per_token(cfg, {}, 64) > f0  # MLA's causal QKᵀ and PV grow with T


def test_flops_per_token_of_k3_mini_is_layout_independent():
    """k3-mini stacks layers 4-7 as one group (k3jax/model/layout.py); the count equals the one of the per-layer
    tree from before the stacked layout (same value, computed at commit edda0d4)."""
    cfg = get_preset("k3-mini")
    assert flops_per_token(cfg, abstract_params(cfg), 128) == 93676032.0


@pytest.mark.slow
def test_bench_train_tiny_json(capsys):
    argv = ["bench", "train", "--json", "--quick", "--layers", "2", "--batch", "2", "--seq-len", "16", "--reps", "1",
            "--qat", "weights+acts", "--compute-dtype", "bfloat16"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "train" and out["shape"]["preset"] == "k3-tiny" and out["shape"]["layers"] == 2
    r = out["ratios"]
    assert set(r) == {"mfu", "tokens_per_s"}
    assert all(math.isfinite(v) and v > 0 for v in r.values()), r
    assert r["mfu"] < 1.5, out  # above the same-run matmul peak: a wrong FLOP count or timing
    assert math.isfinite(out["loss"]) and out["loss"] > 0
    cfg = get_preset("k3-tiny", num_layers=2, full_attn_layers=(2,))
    assert out["params"] == count_params(abstract_params(cfg))
    assert r["tokens_per_s"] == 2 * 16 / out["times"]["step_s"]
    assert out["flops"]["achieved"] == out["flops"]["per_token"] * r["tokens_per_s"]
    assert out["flops"]["per_token"] == flops_per_token(cfg, abstract_params(cfg), 16)
