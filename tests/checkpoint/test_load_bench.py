"""`k3 bench load --quick` runs and reports its ratios."""

import json

from k3jax.cli.main import main


def test_bench_load_quick_runs(capsys):
    assert main(["bench", "--json", "load", "--quick"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["results"]["k3-mini"]
    assert set(out["ratios"]) == {"throughput_vs_raw_read", "peak_rss_over_largest_tensor"}
    assert r["devices"] == 8 and r["bytes_read_per_process"] == r["payload_bytes"]
