"""`k3 bench kda --quick` runs and reports the figures the issue names (no timing assertions)."""

import argparse
import math

from k3jax.bench import kda as bench


def test_kda_bench_quick_runs():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = bench.run(p.parse_args(["--quick"]))
    assert out["name"] == "kda"
    assert set(out["ratios"]) == {"chunked_speedup_vs_recurrent_T256", "chunked_fraction_of_matmul_peak_T256",
                                  "speedup_3x_needs_over_batched_matmul_rate_T256"}
    r = out["results"]["T256"]
    assert {"recurrent_s", "chunked_s", "pallas_interpret_s", "chunked_gflops_per_s"} <= set(r)
    assert all(math.isfinite(v) and v > 0 for v in out["ratios"].values())
    assert "per token per head" in out["flop_formula"]
    assert out["batched_matmul_gflops_per_s"] > 0 and len(out["batched_matmul_shape"]) == 4
