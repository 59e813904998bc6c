"""`k3 train` as one jax.distributed job of 2 local CPU processes × 4 devices (scripts/multiprocess.sh, gloo
collectives) against 1 process × 8 devices: the same losses, parameters and export.

Gloo's cross-process sums and XLA's in-process ones add in different orders, so the two runs agree to float32
rounding, not bit for bit: every step's loss within 1e-6 relative; every float32 parameter of the final checkpoint
within 1e-6 rel-RMS (``TOL["fp32_shallow"]``) or 1e-7 absolute (the zero-initialised AttnRes queries are a few
AdamW steps from 0, where one rounding of their tiny gradient is more than 1e-6 of their size); and the export
within one BF16 rounding (a float32 difference of 1e-7 can round a BF16 value the other way), byte-identical for
the tensors whose float32 values agree exactly. The default suite runs the expert-parallel case on in-memory data;
the others (QAT, frozen packed experts, QLoRA, a context axis, streamed shards, SIGKILL and SIGTERM, k3-mini) are
``manual``, their figures in experiments/LOG.md.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from k3jax.testing import TOL, assert_close, free_port, job_env
from k3jax.train.ckpt import load_checkpoint_params

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "multiprocess.sh"
K3 = [sys.executable, "-m", "k3jax.cli.main"]
TINY = ["--preset", "k3-tiny", "--steps", "8", "--batch", "8", "--seq-len", "32", "--max-bytes", "200000",
        "--eval-every", "100", "--ckpt-every", "4", "--no-progress", "--log-every", "0"]


def _env(cache: Path) -> dict:
    return job_env(cache, ROOT)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


def _train(processes: int, out: Path, args: list, cache: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """`k3 train ARGS` writing out/ck, out/metrics.jsonl, out/export, as ``processes`` processes."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*K3, "train", *args, "--ckpt-dir", str(out / "ck"), "--metrics", str(out / "metrics.jsonl"),
           "--export", str(out / "export")]
    if processes > 1:
        cmd = ["bash", str(LAUNCH), str(processes), *cmd]
    r = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{processes} process(es) failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    return r


def _losses(out: Path) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _export(out: Path) -> dict:
    from safetensors import safe_open

    vals = {}
    for f in sorted(glob.glob(str(out / "export" / "*.safetensors"))):
        with safe_open(f, "np") as h:
            vals.update({k: h.get_tensor(k) for k in h.keys()})
    return vals


def compare_runs(one: Path, two: Path, param_tol: float = TOL["fp32_shallow"], *, loss_tol: float = 1e-6,
                 close_steps: int | None = None) -> dict:
    """Assert the bounds of the module docstring between a one-process run (``one``) and a two-process one; returns
    the figures (worst loss difference, worst parameter rel-RMS, exported tensors byte-identical / all, packed
    MXFP4 bytes that differ). ``param_tol``: the parameters' rel-RMS bound; ``loss_tol``: the losses' after the
    first ``close_steps`` (None: every step within 1e-6)."""
    l1, l2 = _losses(one), _losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, len(l1) + 1)), (l1, l2)
    rel = {s: abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1}
    loss_rel = max(rel.values())
    for s, r in rel.items():
        bound = 1e-6 if close_steps is None or s <= close_steps else loss_tol
        assert r <= bound, f"step {s}: losses differ by {r:.2e} relative (> {bound:.0e}): {l1} vs {l2}"
    (s1, p1), (s2, p2) = load_checkpoint_params(str(one / "ck")), load_checkpoint_params(str(two / "ck"))
    assert s1 == s2
    flat1 = jax.tree_util.tree_flatten_with_path(p1)[0]
    flat2 = jax.tree.leaves(p2)
    assert len(flat1) == len(flat2)
    worst = 0.0
    for (path, a), b in zip(flat1, flat2, strict=True):
        worst = max(worst, assert_close(b, a, param_tol, atol_floor=1e-7, name=jax.tree_util.keystr(path)))
    e1, e2 = _export(one), _export(two)
    assert sorted(e1) == sorted(e2)
    same = sum(np.array_equal(e1[k].view(np.uint8), e2[k].view(np.uint8)) for k in e1)
    packed_diff = 0
    for k in e1:
        if e1[k].dtype == np.uint8:  # MXFP4 nibbles / E8M0 scales: a value near a rounding boundary may flip
            packed_diff += int((e1[k] != e2[k]).sum())
            continue
        assert_close(e2[k].astype(np.float32), e1[k].astype(np.float32), max(TOL["bf16"], param_tol),
                     name=f"export {k}")
    for f in ("config.json", "model.safetensors.index.json", "adapter_config.json"):
        if (one / "export" / f).exists():
            assert (one / "export" / f).read_bytes() == (two / "export" / f).read_bytes(), f
    return {"loss_rel": loss_rel, "param_rel_rms": worst, "export_identical": f"{same}/{len(e1)}",
            "packed_bytes_differing": packed_diff}


def test_two_processes_train_and_export_like_one(tmp_path, cache):
    """--mesh data=2,expert=4 (expert-parallel) on the in-memory corpus, 8 steps, a checkpoint at 4 and 8, export."""
    args = [*TINY, "--mesh", "data=2,expert=4"]
    _train(1, tmp_path / "one", args, cache)
    r = _train(2, tmp_path / "two", args, cache)
    print(compare_runs(tmp_path / "one", tmp_path / "two"))
    summary = [line for line in r.stdout.splitlines() if line.startswith("step 8:")]
    assert len(summary) == 1, r.stdout  # process 0 alone speaks on stdout


@pytest.fixture(scope="module")
def packed_base(tmp_path_factory):
    """A k3-tiny checkpoint with packed MXFP4 experts (k3-tiny's format): the base of the frozen and QLoRA runs."""
    from k3jax.checkpoint import save
    from k3jax.config import get_preset
    from k3jax.model import init_params

    d = tmp_path_factory.mktemp("base")
    tiny = get_preset("k3-tiny")
    save(init_params(tiny, jax.random.key(0)), tiny, d, overwrite=True)
    return str(d)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The first 200 kB of the stdlib corpus as `k3 tokenize` shards of 33-token rows (the streamed-data case)."""
    from k3jax.data import stdlib_documents

    d = tmp_path_factory.mktemp("shards")
    (d / "corpus.txt").write_bytes(b"\n".join(stdlib_documents(200_000)))
    r = subprocess.run([*K3, "tokenize", "--data", str(d / "corpus.txt"), "--out", str(d / "out"), "--preset",
                        "k3-tiny", "--seq-len", "32"], env=_env(d), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return str(d / "out")


MANUAL_CASES = {
    "qat": ["--mesh", "data=2,expert=4", "--qat", "weights+acts"],
    "context": ["--mesh", "data=2,expert=2,context=2"],
    "frozen": ["--mesh", "data=2,expert=4", "--frozen-experts"],
    "lora": ["--mesh", "data=2,expert=4", "--lora", "rank=4,targets=attn+shared+experts"],
    "shards": ["--mesh", "data=2,expert=4"],  # + --data: the streamed shards
    "k3-mini": ["--mesh", "data=2,expert=4", "--preset", "k3-mini"],
}


@pytest.mark.manual
@pytest.mark.parametrize("case", list(MANUAL_CASES))
def test_two_processes_like_one_manual(case, tmp_path, cache, request):
    tiny = [a for a in TINY if a not in ("--preset", "k3-tiny")] if case in ("frozen", "lora", "k3-mini") else TINY
    args = [*tiny, *MANUAL_CASES[case]]
    if case in ("frozen", "lora"):
        args += ["--init", request.getfixturevalue("packed_base")]
    if case == "shards":
        args += ["--data", request.getfixturevalue("shards")]
    t0 = time.perf_counter()
    _train(1, tmp_path / "one", args, cache)
    t1 = time.perf_counter()
    _train(2, tmp_path / "two", args, cache)
    # QAT: fake quantization is discontinuous (a float32 difference that crosses an FP4 / FP8 rounding boundary
    # moves a value a whole grid step) and Quantile Balancing's bias step is a comparison, so the two runs drift
    # apart by more than rounding: the losses keep the 1e-6 bound over 8 steps, the parameters a looser one (measured
    # worst 2.4e-2 rel-RMS, one layer's router bias; the expert stacks <= 1.5e-4; experiments/LOG.md)
    # LoRA: B starts at 0, so A's first gradients are ~0 and AdamW's normalisation turns their rounding into
    # relative differences above 1e-6 (measured worst 2.7e-6 rel-RMS, a shared expert's A factor)
    # k3-mini: top-k routing is a choice, and among its tokens some expert scores are near-ties that a 1e-7
    # difference flips (measured: the runs part at step 7 with its default QB, 6.1e-5 in the loss at step 8; at step
    # 5 with --balance off, 2.9e-3); from then on they are two nearby trajectories, not one. The bound holds for the
    # first 4 steps; after, the loss within 1e-2 and the parameters 0.2 rel-RMS (measured 4.2e-2, router biases).
    tol = {"qat": 5e-2, "lora": 1e-5, "k3-mini": 0.2}.get(case, TOL["fp32_shallow"])
    loose = {"loss_tol": 1e-2, "close_steps": 4} if case == "k3-mini" else {}
    print(case, compare_runs(tmp_path / "one", tmp_path / "two", tol, **loose), f"one {t1 - t0:.0f} s, two "
          f"{time.perf_counter() - t1:.0f} s")


def _spawn(args: list, port: int, cache: Path, logs: Path) -> list[subprocess.Popen]:
    procs = []
    for i in range(2):
        f = open(logs / f"p{i}.log", "w")  # noqa: SIM115 (closed by the OS with the process)
        procs.append(subprocess.Popen([*K3, "train", *args, "--coordinator", f"localhost:{port}", "--num-processes",
                                       "2", "--process-id", str(i)], env=_env(cache), stdout=f,
                                      stderr=subprocess.STDOUT))
    return procs


def _wait_all(procs, timeout: float) -> list[int | None]:
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]


@pytest.mark.manual
def test_sigkill_one_process_then_resume(tmp_path, cache):
    """SIGKILL process 1 after the step-4 checkpoint: both exit non-zero within 120 s; the same command again ends
    like the uninterrupted run; so does resuming on one process × 8 devices."""
    args = [*TINY, "--mesh", "data=2,expert=4"]
    _train(2, tmp_path / "ref", args, cache)
    run = tmp_path / "killed"
    run.mkdir()
    full = [*args, "--ckpt-dir", str(run / "ck"), "--metrics", str(run / "metrics.jsonl")]
    procs = _spawn(full, free_port(), cache, run)
    try:
        while not (run / "ck" / "4").is_dir():
            assert all(p.poll() is None for p in procs), "a process ended before the step-4 checkpoint"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rcs = _wait_all(procs, 150)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert rcs[1] == -signal.SIGKILL and rcs[0] not in (None, 0), (rcs, (run / "p0.log").read_text()[-3000:])
    assert took <= 120, f"process 0 took {took:.0f} s to exit"
    print(f"process 0 exited rc {rcs[0]} {took:.1f} s after process 1 was killed")
    for where, n in (("again", 2), ("one", 1)):
        dst = tmp_path / where
        subprocess.run(["cp", "-r", str(run), str(dst)], check=True)
        os.remove(dst / "metrics.jsonl")
        _train(n, dst, args, cache)
        _, a = load_checkpoint_params(str(tmp_path / "ref" / "ck"))
        _, b = load_checkpoint_params(str(dst / "ck"))
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
            assert_close(y, x, TOL["fp32_shallow"], atol_floor=1e-7, name=f"{where}: {jax.tree_util.keystr(path)}")


@pytest.mark.manual
def test_sigterm_one_process_stops_both(tmp_path, cache):
    """SIGTERM to process 1 only: both finish the same step, save one checkpoint and exit 0."""
    run = tmp_path / "run"
    run.mkdir()
    args = [*TINY, "--steps", "40", "--mesh", "data=2,expert=4", "--ckpt-dir", str(run / "ck"), "--ckpt-every", "100",
            "--metrics", str(run / "metrics.jsonl")]
    procs = _spawn(args, free_port(), cache, run)
    try:
        while not (run / "metrics.jsonl").exists() or '"step": 2,' not in (run / "metrics.jsonl").read_text():
            assert all(p.poll() is None for p in procs), (run / "p0.log").read_text()[-3000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)
        rcs = _wait_all(procs, 300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert rcs == [0, 0], (rcs, (run / "p0.log").read_text()[-3000:], (run / "p1.log").read_text()[-3000:])
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stop = [r for r in recs if r.get("event") == "sigterm"]
    assert len(stop) == 1 and stop[0]["checkpoint"] == stop[0]["step"] < 40, stop
    assert sorted(int(d) for d in os.listdir(run / "ck") if d.isdigit()) == [stop[0]["step"]]
