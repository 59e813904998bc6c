"""`k3 bench kda --json` at a tiny size: one JSON object with the documented ratios, the FLOP count of the formula,
and timed paths that agree with each other (no timing assertions)."""

import json
import math

from k3jax.cli.main import main
from k3jax.testing import TOL

TINY = ["--quick", "--seq", "64", "--heads", "1", "--head-dim", "16", "--chunk", "16", "--repeats", "1"]


def test_kda_bench_tiny_json(capsys):
    assert main(["bench", "kda", "--json", *TINY]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "kda" and out["config"]["seqs"] == [64]
    assert set(out["ratios"]) == {"chunked_speedup_vs_recurrent_T64", "chunked_fraction_of_matmul_peak_T64",
                                  "speedup_3x_needs_over_batched_matmul_rate_T64"}
    assert all(math.isfinite(v) and v > 0 for v in out["ratios"].values()), out["ratios"]
    r = out["results"]["T64"]
    # FLOP_FORMULA at T = 64, H = 1, K = V = C = 16: 64 · (4·16·16 + 16·32 + 6·16·16 + 2·16·16) = 64 · 3584
    assert r["chunked_flops"] == 229376.0
    assert r["chunked_rel_rms_vs_recurrent"] <= TOL["fp32_vs_fp64"], r
    assert r["pallas_rel_rms_vs_chunked"] <= TOL["fp32_vs_fp64"], r
    assert all(r[k] > 0 for k in ("recurrent_s", "chunked_s", "pallas_interpret_s"))
    assert out["batched_matmul_shape"] == [16, 16, 16, 16] and out["batched_matmul_gflops_per_s"] > 0
