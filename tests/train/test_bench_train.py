"""`k3 bench train --quick` runs the full train step (here with QAT weights+acts and bf16 compute) and reports MFU
against a matmul peak measured in the same run."""

import argparse
import math

from k3jax.bench import train as bench_train


def test_bench_train_quick_reports_mfu():
    p = argparse.ArgumentParser()
    bench_train.add_arguments(p)
    out = bench_train.run(p.parse_args(["--quick", "--qat", "weights+acts", "--compute-dtype", "bfloat16",
                                        "--reps", "1"]))
    assert out["name"] == "train" and out["shape"]["preset"] == "k3-tiny"
    mfu = out["ratios"]["mfu"]
    assert math.isfinite(mfu) and 0 < mfu < 1.5, out
    assert out["ratios"]["tokens_per_s"] > 0 and out["flops"]["matmul_peak"] > 0
