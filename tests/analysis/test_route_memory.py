"""`k3 route` in counts-only mode streams: its peak RSS stays flat (within 10%) from 50K to 500K tokens."""

import json
import os
import subprocess
import sys

import pytest

from k3jax.data import stdlib_bytes

pytestmark = pytest.mark.manual  # ~17 CPU-minutes (500k tokens through k3-mini): CI's budget, session 9


def test_peak_rss_flat_from_50k_to_500k_tokens(tmp_path):
    text = tmp_path / "stdlib.txt"
    text.write_bytes(stdlib_bytes(500_000).tobytes())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user runs it
    rss = {}
    for n in (50_000, 500_000):
        out = subprocess.run([sys.executable, "-m", "k3jax.cli.main", "route", "--preset", "k3-mini", "--text",
                              str(text), "--max-tokens", str(n), "--seq-len", "256", "--batch", "8", "--json"],
                             capture_output=True, text=True, env=env, timeout=1800, check=True)
        r = json.loads(out.stdout)
        assert r["tokens"] == n
        rss[n] = r["peak_rss_bytes"]
    print(f"peak RSS: 50K tokens {rss[50_000] / 2**20:.0f} MiB, 500K tokens {rss[500_000] / 2**20:.0f} MiB")
    assert rss[500_000] <= 1.10 * rss[50_000]
