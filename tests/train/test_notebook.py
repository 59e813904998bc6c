"""notebooks/qat_finetune.py runs end to end at k3-tiny (a fresh process, as CI would run the notebook)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NB = Path(__file__).resolve().parents[2] / "notebooks" / "qat_finetune.py"


@pytest.mark.slow  # 291 s (CI's budget, session 9)
def test_qat_finetune_notebook_runs(tmp_path):
    env = dict(os.environ, K3_NB_OUT=str(tmp_path), K3_NB_STEPS="8", MPLBACKEND="Agg")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    r = subprocess.run([sys.executable, str(NB)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "qat_loss.png").stat().st_size > 1000
    assert s["export_bytes"]["mxfp4"] < s["export_bytes"]["bf16"]
    assert all(len(v) == 8 for v in s["losses"].values())
    assert abs(s["gap_eval"]) < 0.5, s  # a few steps of fine-tuning: QAT on and off stay close
    assert "held-out gap" in r.stdout
