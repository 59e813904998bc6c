"""`k3 ablate experiments/smoke.toml` through the real train loop, as fresh processes:

* (slow, 234 s in session 9; the later invocations read the first one's compile cache) each run of the grid is
  checked: the results' schema, arms, paired statistics, shared seed init and output files; run twice into two
  directories: identical results.json apart from ``timing`` (bit-for-bit losses, per-window losses included);
  SIGKILL in the middle of the grid (inside the second run), then the same command: the results of the
  uninterrupted run, and the runs that had finished are not redone.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from k3jax.analysis.ablate_report import strip_timing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(REPO, "experiments", "smoke.toml")
RUNS = ["base/seed-0", "kda_gate=softplus/seed-0", "base/seed-1", "kda_gate=softplus/seed-1"]


def _cmd(out, cache):
    return [sys.executable, "-m", "k3jax.cli.main", "ablate", SMOKE, "--out", str(out), "--compile-cache",
            str(cache), "--json", "--no-progress"]


def _results(out):
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _windows(out):
    return {r: json.load(open(os.path.join(out, "runs", r, "result.json")))["window_losses"] for r in RUNS}


def _steps_done(metrics):
    if not os.path.exists(metrics):
        return 0
    n = 0
    for line in open(metrics):
        try:
            n = max(n, json.loads(line).get("step", 0))
        except json.JSONDecodeError:  # a line being written
            pass
    return n


def _run_and_check(out, cache):
    r = subprocess.run(_cmd(out, cache), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["schema"] == "k3jax.ablate/1" and res == _results(out)
    assert set(res["arms"]) == {"base", "kda_gate=softplus"} and res["arms"]["base"]["seeds"] == [0, 1]
    lv = res["factors"]["kda_gate"]["levels"]["softplus"]
    assert lv["paired"]["n"] == 2 and lv["verdict"] in ("better", "worse", "within noise")
    assert res["arms"]["kda_gate=softplus"]["init"]["own_leaves"] == ["layers/0/kda/A_log"]
    for name in ("results.md", "curves.png", "seeds/seed-0.npz", "seeds/seed-1.npz"):
        assert (out / name).exists()
    return res


@pytest.mark.slow
def test_smoke_is_deterministic_and_resumes_after_a_kill(tmp_path):
    cache = tmp_path / "xla"
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    ra = _run_and_check(a, cache)
    assert strip_timing(ra) == strip_timing(_run_and_check(b, cache))
    assert _windows(a) == _windows(b)

    p = subprocess.Popen(_cmd(c, cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    second = c / "runs" / RUNS[1] / "metrics.jsonl"
    deadline = time.time() + 900
    while _steps_done(second) < 1:  # the first run finished, the second one is training
        assert p.poll() is None, p.communicate()[1]
        assert time.time() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert not (c / "results.json").exists()
    first_result = (c / "runs" / RUNS[0] / "result.json").stat().st_mtime_ns
    r = subprocess.run(_cmd(c, cache), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    assert (c / "runs" / RUNS[0] / "result.json").stat().st_mtime_ns == first_result  # not redone
    assert strip_timing(_results(c)) == strip_timing(ra)
    assert _windows(c) == _windows(a)
