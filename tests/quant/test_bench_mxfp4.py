"""`k3 bench mxfp4 --quick` runs and reports the storage cost of real packed arrays."""

import argparse

from k3jax.bench import mxfp4


def test_bench_mxfp4_quick_runs():
    p = argparse.ArgumentParser()
    mxfp4.add_arguments(p)
    out = mxfp4.run(p.parse_args(["--quick"]))
    assert out["name"] == "mxfp4"
    assert out["ratios"]["bits_per_weight"] == 4.25 and out["ratios"]["bits_per_weight_bf16"] == 16.0
    assert out["ratios"]["time_mxfp4_over_bf16_M1"] > 0
