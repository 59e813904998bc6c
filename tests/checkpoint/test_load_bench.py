"""`k3 bench load --quick` runs and reports its ratios."""

import json

from k3jax.cli.main import main


def test_bench_load_quick_runs(capsys):
    assert main(["bench", "--json", "load", "--quick"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["results"]["k3-mini"]
    assert set(out["ratios"]) == {"throughput_vs_raw_read", "throughput_vs_raw_read_float32",
                                  "throughput_vs_fresh_buffer_read", "peak_rss_over_largest_tensor"}
    assert r["fresh_buffer_read_s"] > 0
    assert r["devices"] == 8 and r["bytes_read_per_process"] == r["payload_bytes"]
    assert r["leaves_as_stored"] > r["leaves_float32"]  # packed experts: a _packed and a _scale leaf each
    for mode in ("as_stored", "float32"):
        assert r[f"{mode}_load_s"] > 0 and r[f"{mode}_largest_leaf_bytes"] > 0
        assert set(r[f"{mode}_breakdown"]) >= {"open_headers", "validate", "read_decode", "make_arrays"}
