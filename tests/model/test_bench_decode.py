"""`k3 bench decode --json` at a tiny size (k3-tiny, contexts 4 and 5 in one 8-position cache, so every figure comes
from two compiled programs): the JSON schema, finite positive ratios, the target checks and their exit code (no
timing assertion); and the HLO counter that flags a cache copied every step."""

import json
import math

import jax
import pytest

from k3jax.bench.decode import TARGETS, cache_sized_ops, weight_bytes_touched
from k3jax.cli.main import main

TINY = ["bench", "decode", "--json", "--preset", "k3-tiny", "--contexts", "4,5", "--batches", "1", "--prefill", "1",
        "--rounds", "1", "--steps", "1"]


@pytest.mark.slow
def test_bench_decode_tiny_json(capsys):
    rc = main(TINY)
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "decode" and out["config"]["cache_fill"] == "synthetic"
    r = out["ratios"]
    for k in ("decode_time_16k_over_1k", "decode_time_1k_in_64k_cache_over_1k_cache", "absorbed_over_materialized_16k",
              "decode_time_16k_over_1k_b1", "decode_time_64k_over_1k_b1"):
        assert math.isfinite(r[k]) and r[k] > 0, (k, r)
    assert out["config"]["ratio_contexts"] == {"1k": 4, "16k": 5, "64k": 5}
    assert set(out["checks"]) == set(TARGETS)
    assert out["ok"] == (all(c["ok"] for c in out["checks"].values()) and out["logits_finite"])
    assert rc == (0 if out["ok"] else 1)  # docs/cli.md: a missed bench threshold exits 1, figures printed anyway
    assert out["logits_finite"]
    assert set(out["decode"]) == {"B1_ctx4", "B1_ctx5", "B1_ctx4_in_8_cache", "B1_ctx5_materialized"}
    assert all(d["steps"] == 1 and d["median_s"] > 0 for d in out["decode"].values())
    assert out["prefill"]["T1"]["tokens_per_s"] > 0
    assert set(out["profile"]["compiled"]) == {"B1_S8_absorbed", "B1_S8_materialized"}  # the two programs
    per = out["profile"]["per_batch"]["B1"]
    assert per["ctx5"]["mla_cache_bytes_read"] == 5 * 2 * (16 + 8) * 4  # 2 MLA layers
    W, m = out["profile"]["param_bytes"], 2 * (16 + 8) * 4
    assert per["bytes_floor_16k_over_1k"]["all_weights"] == pytest.approx((W + 5 * m) / (W + 4 * m))
    c = out["checks"]["decode_time_16k_over_1k"]
    assert c["bytes_floor"] == per["bytes_floor_16k_over_1k"]["all_weights"]
    assert c["target_below_bytes_floor"] == (c["bytes_floor"] > c["target_max"])


def test_bench_decode_bad_contexts_exit_2(capsys):
    assert main(["bench", "decode", "--contexts", "1024"]) == 2
    assert "--contexts" in capsys.readouterr().err


def test_weight_bytes_touched_counts_the_expected_distinct_experts():
    from k3jax.config import get_preset
    from k3jax.model.functional import init_params

    cfg = get_preset("k3-tiny")                                               # 8 experts, top-2
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    routed = sum(x.size * 4 for p, x in leaves if "'experts'" in jax.tree_util.keystr(p))
    rest = sum(x.size * 4 for _, x in leaves) - routed
    assert routed > 0
    assert weight_bytes_touched(params, cfg, 1) == pytest.approx(rest + routed * 2 / 8, abs=1)   # k of E at B = 1
    assert weight_bytes_touched(params, cfg, 8) == pytest.approx(rest + routed * (1 - (6 / 8) ** 8), abs=1)


def test_cache_sized_ops_counts_only_latent_shaped_copies():
    hlo = ("  %copy.1 = f32[1,1,4096,128]{3,2,1,0} copy(%p)\n"
           "  %c = f32[2,8,4096,32]{3,2,1,0} concatenate(%a, %b), dimensions={0}\n"
           "  %copy.2 = f32[4096,64]{1,0} copy(%q)\n"          # S but not a latent width
           "  %d = f32[1,4096,128]{2,1,0} dynamic-update-slice(%x, %y, %i)\n")
    assert cache_sized_ops(hlo, 4096, (128, 32)) == {"copy": 1, "concatenate": 1}
