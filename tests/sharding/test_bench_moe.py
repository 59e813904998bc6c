"""`k3 bench moe --quick` runs and reports the figures the issue names."""

import argparse

from k3jax.bench import moe


def test_bench_moe_quick_runs():
    p = argparse.ArgumentParser()
    moe.add_arguments(p)
    out = moe.run(p.parse_args(["--quick", "--reps", "1"]))
    r = out["ratios"]
    assert out["name"] == "moe" and r["time_E256_over_E16"] > 0 and r["ragged_dot_time_E256_over_E16"] > 0
    assert r["ep_rel_rms"] < 1e-6 and out["ep"]["dropped"] == 0
    assert abs(r["a2a_bytes_over_formula_cf1"] - 1.0) < 1e-9  # cf 1: exactly tokens·k·latent·4 bytes each way
    assert abs(r["a2a_bytes_over_formula_worst"] - 4.0) < 1e-9  # worst case min(X, E/k) = min(4, 16/4) = 4x
    assert max(out["sorted_rel_rms_vs_ragged_dot"].values()) < 1e-5


def test_all_to_all_bytes_parser():
    hlo = ("  %a = (f32[1,128,64]{2,1,0}, f32[1,128,64]{2,1,0}) all-to-all(%x, %y), channel_id=1\n"
           "  %b = s32[4,8]{1,0} all-to-all(%z), channel_id=2\n"
           "  %c = f32[9]{0} add(%p, %q)\n")
    assert moe.all_to_all_bytes(hlo) == {"f32": 2 * 128 * 64 * 4, "s32": 32 * 4}
