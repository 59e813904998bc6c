"""`k3 bench mxfp4 --json --quick`: one JSON object with the documented ratios, storage bytes of real packed arrays
equal to their closed form, and a dequant-fused matmul that agrees with float64 (no timing assertions)."""

import json
import math

from k3jax.cli.main import main
from k3jax.testing import TOL


def test_bench_mxfp4_quick_json(capsys):
    assert main(["bench", "mxfp4", "--json", "--quick", "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "mxfp4"
    K, N = out["shape"]["K"], out["shape"]["N"]
    assert (K, N, out["shape"]["prefill_M"]) == (512, 384, 64)
    r = out["ratios"]
    assert set(r) == {"bits_per_weight", "bits_per_weight_bf16", "time_mxfp4_over_bf16_M1",
                      "time_mxfp4_over_bf16_M16", "time_mxfp4_over_bf16_M64"}
    assert all(math.isfinite(v) and v > 0 for v in r.values()), r
    assert r["bits_per_weight"] == 4.25 and r["bits_per_weight_bf16"] == 16.0
    # one uint8 per two FP4 codes, one E8M0 byte per 32 weights, two bytes per bf16 weight
    assert out["bytes"] == {"packed": N * K // 2, "scale": N * K // 32, "bf16": 2 * N * K}
    for m, t in out["times"].items():
        assert t["mxfp4_rel_rms_vs_f64"] <= TOL["fp32_vs_fp64"], (m, t)
