"""`k3 bench moe --json` at a tiny size: the documented ratios, EP and ragged_dot agreeing with their references,
and all-to-all bytes read from the compiled HLO equal to their closed form (no timing assertions). Slow: nine
compiled programs (six layer forwards, EP at two capacity factors, the 1-device path) whatever the size."""

import json
import math

import pytest

from k3jax.bench import moe
from k3jax.cli.main import main
from k3jax.testing import TOL


@pytest.mark.slow
def test_bench_moe_tiny_json(capsys):
    assert main(["bench", "moe", "--json", "--quick", "--tokens", "64", "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["ratios"]
    assert out["name"] == "moe" and out["devices"] == 8
    assert set(r) == {"time_E256_over_E16", "time_E64_over_E16", "ragged_dot_time_E256_over_E16",
                      "ep_8dev_over_1dev", "ep_rel_rms", "a2a_bytes_over_formula_worst", "a2a_bytes_over_formula_cf1"}
    assert all(math.isfinite(v) and v > 0 for k, v in r.items() if k != "ep_rel_rms"), r
    assert r["ep_rel_rms"] <= TOL["fp32_shallow"] and out["ep"]["dropped"] == 0
    assert max(out["sorted_rel_rms_vs_ragged_dot"].values()) <= TOL["fp32_vs_fp64"]
    # EP over X = 4 expert shards of E = 16: per token and direction a bucket row per destination shard, f32 latent
    k, P, X, E = out["shape"]["k"], out["shape"]["P"], 4, 16
    a2a = out["all_to_all"]
    assert a2a["formula_bytes_per_token"] == k * P * 4
    assert a2a["cf1"]["latent_bytes_per_token_each_way"] == k * P * 4  # cf 1: exactly what a ragged a2a moves
    assert a2a["cf-1"]["latent_bytes_per_token_each_way"] == X * min(k, E // X) * P * 4  # worst case: 4x
    assert r["a2a_bytes_over_formula_cf1"] == 1.0 and r["a2a_bytes_over_formula_worst"] == min(X, E // k)


def test_all_to_all_bytes_parser():
    hlo = ("  %a = (f32[1,128,64]{2,1,0}, f32[1,128,64]{2,1,0}) all-to-all(%x, %y), channel_id=1\n"
           "  %b = s32[4,8]{1,0} all-to-all(%z), channel_id=2\n"
           "  %c = f32[9]{0} add(%p, %q)\n")
    assert moe.all_to_all_bytes(hlo) == {"f32": 2 * 128 * 64 * 4, "s32": 32 * 4}
