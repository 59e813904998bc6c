"""`k3 bench load --quick --json` on k3-tiny: the documented ratios, every payload byte read once, and a float32 load
that materialises exactly 4 bytes per parameter of the closed-form count. Slow: three fresh jax processes."""

import json
import math

import pytest

from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.model import abstract_params, count_params


@pytest.mark.slow
def test_bench_load_tiny_json(capsys):
    assert main(["bench", "--json", "load", "--quick", "--preset", "k3-tiny"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"] == "k3-tiny" and set(out["results"]) == {"k3-tiny"}
    assert set(out["ratios"]) == {"throughput_vs_raw_read", "throughput_vs_raw_read_float32",
                                  "throughput_vs_fresh_buffer_read", "peak_rss_over_largest_tensor"}
    assert all(math.isfinite(v) and v > 0 for v in out["ratios"].values()), out["ratios"]
    r = out["results"]["k3-tiny"]
    assert r["devices"] == 8 and r["bytes_read_per_process"] == r["payload_bytes"] < r["file_bytes"]
    assert r["float32_result_unique_bytes"] == 4 * count_params(abstract_params(get_preset("k3-tiny")))
    assert r["leaves_as_stored"] > r["leaves_float32"]  # packed experts: a _packed and a _scale leaf each
    assert r["fresh_buffer_read_s"] > 0
    for mode in ("as_stored", "float32"):
        assert r[f"{mode}_load_s"] > 0 and r[f"{mode}_largest_leaf_bytes"] > 0
        assert set(r[f"{mode}_breakdown"]) >= {"open_headers", "validate", "read_decode", "make_arrays"}
