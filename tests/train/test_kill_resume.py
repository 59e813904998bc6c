"""Process-level fault tests of `k3 train` on k3-tiny (slow: each run is a fresh process that compiles the step).

* SIGKILL at two random steps (checkpoints every step, async: a kill may land mid-save), then the same command
  again: the final parameters are bit-identical to an uninterrupted run.
* SIGTERM: the run saves a checkpoint, exits 0, and resuming ends bit-identical too.
* SIGKILL on a mesh (``--mesh expert=2``: expert-parallel, sharded state and checkpoints), then resume on the same
  mesh: bit-identical to an uninterrupted run on that mesh.

Every process of this module runs one of two programs (the data-parallel and the expert-parallel k3-tiny run), so
they share one JAX persistent compilation cache: the reference run of each compiles, the kill and resume runs
load its executables instead of compiling them again (a cache hit is the same executable: bit-identity is checked
as before).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from k3jax.plan.hardware import xla_flags
from k3jax.train.ckpt import load_checkpoint_params

pytestmark = pytest.mark.slow

STEPS = 8


def _cmd(ck, metrics, placement=("--devices", "2")):
    return [sys.executable, "-m", "k3jax.cli.main", "train", "--preset", "k3-tiny", "--steps", str(STEPS),
            "--batch", "4", "--micro-batches", "2", "--seq-len", "16", "--max-bytes", "100000", *placement,
            "--ckpt-dir", str(ck), "--ckpt-every", "1", "--keep", "2", "--metrics", str(metrics),
            "--eval-every", "100", "--no-progress"]


_CACHE: list = []  # the module's compilation cache directory (set by the autouse fixture)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    _CACHE[:] = [str(tmp_path_factory.mktemp("jax_cache"))]
    yield
    _CACHE.clear()


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(2)
    env["JAX_COMPILATION_CACHE_DIR"] = _CACHE[0]
    return env


def _last_step(metrics) -> int:
    if not os.path.exists(metrics):
        return 0
    steps = []
    for line in open(metrics):
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:  # a line being written
            pass
    return max(steps, default=0)


def _run_until(cmd, metrics, step, sig):
    """Start ``cmd``, wait until the metrics file reports ``step`` (a finished step), send ``sig``."""
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900
    ck = cmd[cmd.index("--ckpt-dir") + 1]
    # a finished step AND one committed checkpoint (orbax renames "<step>.orbax-checkpoint-tmp*" to "<step>")
    while _last_step(metrics) < step or not any(n.isdigit() for n in (os.listdir(ck) if os.path.isdir(ck) else ())):
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    p.send_signal(sig)
    out, err = p.communicate(timeout=600)
    return p.returncode, err


def _finish(cmd):
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    return r.stderr


def _params(ck):
    step, p = load_checkpoint_params(str(ck))
    assert step == STEPS
    return jax.tree.leaves(p)


def _assert_bit_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    _finish(_cmd(d / "ck", d / "m.jsonl"))
    return _params(d / "ck")


@pytest.mark.parametrize("which", [0, pytest.param(1, marks=pytest.mark.manual)])  # CI budget: one kill point
def test_sigkill_then_resume_is_bit_identical(which, reference, tmp_path):
    kill_at = random.Random(2026).sample(range(2, STEPS - 1), 2)[which]
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    rc, _ = _run_until(_cmd(ck, m), m, kill_at, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    err = _finish(_cmd(ck, m))
    assert "resumed from" in err
    print(f"\nkill point {kill_at}: {[x for x in err.splitlines() if 'resumed from' in x]}")
    _assert_bit_identical(reference, _params(ck))


def test_sigterm_saves_exits_0_and_resumes_bit_identical(reference, tmp_path):
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    rc, err = _run_until(_cmd(ck, m), m, 3, signal.SIGTERM)
    assert rc == 0, err
    ev = [json.loads(x) for x in open(m) if '"sigterm"' in x]
    assert len(ev) == 1 and ev[0]["checkpoint"] == ev[0]["step"] >= 3
    assert load_checkpoint_params(str(ck))[0] == ev[0]["step"]
    _finish(_cmd(ck, m))
    _assert_bit_identical(reference, _params(ck))


EP = ("--mesh", "expert=2")


@pytest.fixture(scope="module")
def reference_ep(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref_ep")
    _finish(_cmd(d / "ck", d / "m.jsonl", EP))
    return _params(d / "ck")


def test_sigkill_on_a_mesh_then_resume_is_bit_identical(reference_ep, tmp_path):
    kill_at = random.Random(2027).randrange(2, STEPS - 1)
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    rc, _ = _run_until(_cmd(ck, m, EP), m, kill_at, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    err = _finish(_cmd(ck, m, EP))
    assert "resumed from" in err and "(ep)" in err
    start = [json.loads(x) for x in open(m) if '"start"' in x]
    assert [r["strategy"] for r in start] == ["ep", "ep"] and start[0]["mesh"]["expert"] == 2
    _assert_bit_identical(reference_ep, _params(ck))
