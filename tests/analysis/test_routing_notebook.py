"""notebooks/routing_analysis.py runs end to end on the shipped k3-mini (a fresh process, as CI runs it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3jax.cli.source import default_ckpt

NB = Path(__file__).resolve().parents[2] / "notebooks" / "routing_analysis.py"


@pytest.mark.slow  # 176 s (CI's budget, session 9)
@pytest.mark.skipif(default_ckpt() is None, reason="the shipped k3-mini is not in this checkout")
def test_routing_notebook_runs(tmp_path):
    env = dict(os.environ, K3_NB_OUT=str(tmp_path), K3_NB_TOKENS="8192", K3_NB_FT_STEPS="2", MPLBACKEND="Agg")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    r = subprocess.run([sys.executable, str(NB)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["heldout_nats_per_byte"] < 1.6
    for row in s["specialization"]:  # learned specialization beats the init and the label-shuffled baseline
        assert row["token"] > row["token_shuffled"] and row["token"] > row["token_init"]
    assert all(0 < x <= 1 for x in s["drift_saturation"])
    for f in ("load_heatmap.png", "coactivation_layer1.png", "specialization.png", "qb_curves.png", "drift.png",
              "static_router.png", "top1_layer1.html"):
        assert (tmp_path / f).stat().st_size > 500, f
