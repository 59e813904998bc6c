"""One study over several workers sharing its directory (`k3 ablate --worker I/N`, k3jax/ablate/share.py): the
assignment is a balanced partition that depends on the phase and N only; a bad --worker exits 2 naming it; waiting
polls until the files appear or gives up naming them; two workers running at once and then a report give the
results.json of the whole-study run (a plain grid, and a scaling study whose grids wait for their tuning phases),
with every shared file written once, by its owner; --report-only names the missing runs (exit 1). With stand-ins
for the train loop and the seed init (seconds, no compile); the slow test runs experiments/smoke.toml's real
training as two processes."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_ablate_runner import SPEC, FakeTrain
from test_ablate_scaling import STUDY, LawTrain

import k3jax.ablate.runner as ab
import k3jax.train.loop as loop
from k3jax import ablate
from k3jax.ablate.share import IncompleteError, Share, parse_worker, wait_until
from k3jax.analysis.ablate_report import strip_timing
from k3jax.checkpoint.atomic import staged_file
from k3jax.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLL = dict(poll_s=0.05, timeout_s=120.0)  # a hung worker fails the test instead of hanging it


# ----------------------------------------------------------------------------------------- the assignment, the flag

def test_assignment_is_a_balanced_partition_fixed_by_phase_and_count():
    phases = ["", "tune/b0", "tune/b1", "budgets/b0", "budgets/b1", "budgets/b2", "budgets/b3"]
    for n_workers in range(1, 6):
        for n_runs in range(13):
            for phase in phases:
                jobs = list(range(n_runs))
                shares = [Share(i, n_workers).mine(phase, jobs) for i in range(n_workers)]
                assert sorted(j for s in shares for j in s) == jobs  # every run once
                assert all(s == sorted(s) for s in shares)  # each in the phase's order
                assert max(map(len, shares)) - min(map(len, shares)) <= 1
                if n_runs:
                    assert [Share(i, n_workers).owns_shared(phase) for i in range(n_workers)] == [
                        jobs[0] in s for s in shares]  # the worker of run 0 writes the shared files
    # which worker gets a phase's extra run changes from phase to phase
    extra = {next(i for i in range(4) if len(Share(i, 4).mine(p, list(range(5)))) == 2) for p in phases}
    assert len(extra) > 1
    assert Share(1, 3).mine("tune/b0", list(range(9))) == Share(1, 3).mine("tune/b0", list(range(9)))


@pytest.mark.parametrize("text, needle", [("2/2", "I = 2 must be in [0, 2)"), ("-1/4", "I = -1"),
                                          ("0/0", "N = 0"), ("1", "expected I/N"), ("a/b", "expected I/N"),
                                          ("1/2/3", "expected I/N")])
def test_a_bad_worker_flag_exits_2_naming_it(tmp_path, capsys, text, needle):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    assert main(["ablate", str(spec), "--out", str(out), f"--worker={text}"]) == 2
    err = capsys.readouterr().err
    assert "--worker" in err and needle in err, err
    assert not out.exists()
    assert parse_worker(" 3/4 ") == Share(3, 4)


def test_worker_flags_that_do_not_go_together_exit_2(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    out = str(tmp_path / "out")
    assert main(["ablate", str(spec), "--out", out, "--worker", "0/2", "--report-only"]) == 2
    assert "--worker with --report-only" in capsys.readouterr().err
    assert main(["ablate", str(spec), "--out", out, "--wait-timeout", "5"]) == 2
    assert "--wait-timeout 5: applies to --worker" in capsys.readouterr().err
    assert main(["ablate", str(spec), "--out", out, "--worker", "0/2", "--wait-timeout", "0"]) == 2
    assert "positive number of seconds" in capsys.readouterr().err
    assert main(["ablate", str(spec), "--out", out, "--report-only"]) == 2  # nothing claimed: nothing to report
    assert "holds no ablation.json" in capsys.readouterr().err


def test_wait_polls_until_ready_logs_changes_and_gives_up_naming_what_is_missing():
    states = iter([(None, "a, b missing"), (None, "a, b missing"), (None, "b missing"), ("done", "")])
    naps, logs = [], []
    share = Share(1, 2, poll_s=2.0)
    assert wait_until(lambda: next(states), "tune/b0", share=share, log=logs.append, sleep=naps.append) == "done"
    assert naps == [0.5, 1.0, 2.0]  # doubling, capped at poll_s
    assert len(logs) == 3 and "[worker 1/2] waiting for tune/b0: a, b missing" in logs[0]
    assert "b missing" in logs[1] and "ready" in logs[2]
    with pytest.raises(IncompleteError, match=r"worker 0/3: gave up after \d+ s \(--wait-timeout\) waiting for "
                                              r"the seeds: seeds/seed-1.npz \(written by worker 2\)"):
        wait_until(lambda: (None, "seeds/seed-1.npz (written by worker 2)"), "the seeds",
                   share=Share(0, 3, poll_s=0.01, timeout_s=0.05), log=logs.append)


# ------------------------------------------------------------------------------------------------ two workers

class SharedFiles:
    """Stand-ins for the seed init that still write init_plan.json and seeds/seed-<s>.npz (slowly, so another worker
    has to wait for them), and record which thread wrote which seed checkpoint."""

    def __init__(self, monkeypatch):
        self.writes, self.lock = [], threading.Lock()
        monkeypatch.setattr(ab, "sharing_plan", lambda runs: {rid: {("embed",): "base"} for rid in runs})
        monkeypatch.setattr(ab, "init_summary", lambda runs, plan, arm: {"params": 10, "from_base": 10, "own": 0,
                                                                          "own_leaves": []})
        monkeypatch.setattr(ab, "write_seed_checkpoint", self.write)

    def write(self, path, runs, plan, seed):
        time.sleep(0.05)
        with self.lock:
            self.writes.append((os.path.relpath(path), threading.current_thread().name))
        with staged_file(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, seed=np.int64(seed))


def _losses(params, arm, tuning=False):  # FakeTrain's params hold "base", LawTrain's "loss"
    return params.get("loss", params.get("base")) + np.linspace(-0.02, 0.02, 3 if tuning else 4)


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(ab, "window_losses", _losses)

    def use(train):
        monkeypatch.setattr(loop, "train", train)
        return SharedFiles(monkeypatch)
    return use


def _two_workers(spec, out, first=None):
    """Worker 0 and worker 1 of 2 at once, each in its own thread (``first``: worker 0's call instead)."""
    def worker(i):
        threading.current_thread().name = f"worker-{i}"
        if i == 0 and first is not None:
            return first()
        return ablate.run_share(spec, str(out), Share(i, 2, **POLL), progress=False, log=lambda m: None)
    with ThreadPoolExecutor(2) as pool:
        return [f.result() for f in [pool.submit(worker, i) for i in range(2)]]


def _report(path, out, capsys):
    capsys.readouterr()
    rc = main(["ablate", path, "--out", str(out), "--report-only", "--json", "--no-progress"])
    return rc, capsys.readouterr()


def test_two_workers_then_a_report_equal_the_whole_grid(tmp_path, stand_ins, capsys):
    path = tmp_path / "s.toml"
    path.write_text(SPEC)
    spec = ablate.load(str(path))
    stand_ins(FakeTrain())
    whole = ablate.run(spec, str(tmp_path / "whole"), progress=False, log=lambda m: None)

    out = tmp_path / "w"
    f = stand_ins(FakeTrain())
    argv = ["ablate", str(path), "--out", str(out), "--compile-cache", "off", "--no-progress", "--json",
            "--worker", "0/2"]
    rc0, w1 = _two_workers(spec, out, first=lambda: main(argv))  # worker 0 through the CLI, worker 1 the library
    assert rc0 == 0
    w0 = json.loads(capsys.readouterr().out)
    assert w0["worker"] == "0/2" and w1["worker"] == "1/2"
    labels = [j.label for j in ab.grid(spec)]
    assert sorted(w0["phases"]["."] + w1["phases"]["."]) == sorted(labels)  # every run once, by one worker
    # each seed checkpoint once (the repeat reads seed 0's), by the worker that owns the grid's shared files
    assert sorted(p for p, _ in f.writes) == sorted(os.path.relpath(out / "seeds" / f"seed-{s}.npz")
                                                    for s in (0, 1, 10, 11))
    assert {t for _, t in f.writes} == {f"worker-{next(i for i in range(2) if Share(i, 2).owns_shared(''))}"}
    assert not (out / "results.json").exists()  # a worker reports nothing

    rc, r = _report(str(path), out, capsys)
    assert rc == 0, r.err
    assert strip_timing(json.loads(r.out)) == strip_timing(whole)
    assert strip_timing(json.load(open(out / "results.json"))) == strip_timing(whole)


def test_report_only_names_the_missing_runs(tmp_path, stand_ins, capsys):
    path = tmp_path / "s.toml"
    path.write_text(SPEC)
    stand_ins(FakeTrain(stop_at=3))  # SIGTERM during the 4th run: 3 of 7 finished
    out = tmp_path / "o"
    assert main(["ablate", str(path), "--out", str(out), "--compile-cache", "off", "--no-progress"]) == 0
    rc, r = _report(str(path), out, capsys)
    assert rc == 1 and r.out == ""
    assert "4 of 7 runs missing, so no report: base@1, glu=swiglu@1, base@11, base@0-repeat" in r.err
    assert not (out / "results.json").exists()


@pytest.fixture(scope="module")
def study_whole(tmp_path_factory):
    """The scaling study STUDY (tuning, calibration, A/A) loaded, and run whole with the stand-ins: (its file, the
    Study, the whole run's directory, its results)."""
    d = tmp_path_factory.mktemp("study")
    path = d / "s.toml"
    path.write_text(STUDY)
    st = ablate.load(str(path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ab, "window_losses", _losses)
        mp.setattr(loop, "train", LawTrain())
        SharedFiles(mp)
        whole = ablate.run(st, str(d / "whole"), progress=False, log=lambda m: None)
    return str(path), st, d / "whole", whole


def _same_as_whole(out, study_whole, report):
    _, _, whole_dir, whole = study_whole
    rc, r = report
    assert rc == 0, r.err
    assert strip_timing(json.loads(r.out)) == strip_timing(whole)
    for b in range(4):
        got = json.load(open(out / "budgets" / f"b{b}" / "results.json"))
        assert strip_timing(got) == strip_timing(json.load(open(whole_dir / "budgets" / f"b{b}" / "results.json")))


def test_a_budgets_grid_waits_for_its_tuning_phase(tmp_path, study_whole, stand_ins, capsys):
    """Worker 1 alone, in a directory where worker 0's tuning runs are missing: it trains nothing of a grid and
    waits for budget b0's tuning; worker 0 then runs; both finish, and the report is the whole run's."""
    path, st, whole_dir, _ = study_whole
    out = tmp_path / "w"
    shutil.copytree(whole_dir, out, ignore=shutil.ignore_patterns("budgets", "results.*", "scaling.png"))
    for b in st.budgets:  # the tuning phases' shared files stay: a wait here is for runs, not files
        for job in Share(0, 2).mine(f"tune/{b.name}", list(b.tune_jobs)):
            os.remove(os.path.join(job.dir(str(out / "tune" / b.name)), "result.json"))
    stand_ins(LawTrain())
    logs = []
    with ThreadPoolExecutor(1) as pool:
        w1 = pool.submit(ablate.run_share, st, str(out), Share(1, 2, **POLL), progress=False, log=logs.append)
        deadline = time.time() + 60
        while not any("waiting for tune/b0, which budgets/b0 needs: 3 of 6 runs not finished" in m for m in logs):
            assert not w1.done() and time.time() < deadline, (logs, w1.done() and w1.result())
            time.sleep(0.01)
        assert not (out / "budgets").exists()  # no grid run before its tuning is complete
        w0 = ablate.run_share(st, str(out), Share(0, 2, **POLL), progress=False, log=logs.append)
        w1 = w1.result()
    assert any("tune/b0, which budgets/b0 needs: ready after" in m for m in logs)
    for w, share in ((w0, Share(0, 2)), (w1, Share(1, 2))):  # each worker's runs of each phase, finished or resumed
        assert w["phases"]["tune/b0"] == [j.label for j in share.mine("tune/b0", list(st.budgets[0].tune_jobs))]
    _same_as_whole(out, study_whole, _report(path, out, capsys))


def test_two_workers_of_a_scaling_study_at_once_resume_and_report_the_whole_run(tmp_path, study_whole, stand_ins,
                                                                                   capsys):
    path, st, _, _ = study_whole
    out = tmp_path / "w"
    stand_ins(LawTrain(stop_at=2))  # a whole-study run stopped inside budget b0's tuning
    assert ablate.run(st, str(out), progress=False, log=lambda m: None) is None
    rc, r = _report(path, out, capsys)
    assert rc == 1
    assert "runs missing, so no report: tune/b0: glu=situ~lr=0.01@0-tune, glu=swiglu~lr=0.001@0-tune, " \
           "glu=swiglu~lr=0.003@0-tune, glu=swiglu~lr=0.01@0-tune (and budgets/b0, which they tune); tune/b1: " \
           in r.err, r.err

    f = stand_ins(LawTrain())  # two workers take over the directory at once and resume the stopped run
    done = _two_workers(st, out)
    phases = {p for d in done for p in d["phases"]}
    assert phases == {f"{k}/b{i}" for k in ("tune", "budgets") for i in range(4)}
    for p in phases:  # each run by one worker
        ran = [x for d in done for x in d["phases"].get(p, [])]
        assert len(ran) == len(set(ran))
    written = [p for p, _ in f.writes]
    assert written and len(written) == len(set(written))  # every seed checkpoint once
    assert not (out / "results.json").exists()
    _same_as_whole(out, study_whole, _report(path, out, capsys))


# ---------------------------------------------------------------------------------------------- real training

SMOKE = os.path.join(REPO, "experiments", "smoke.toml")


@pytest.mark.slow
def test_smoke_over_two_worker_processes_equals_the_whole_run(tmp_path):
    """experiments/smoke.toml (2 arms x 2 seeds x 3 steps, shared seed checkpoints) run whole, then as `--worker 0/2`
    and `--worker 1/2` at once in one fresh directory, then `--report-only`: the same results.json but for times and
    the same per-window losses. The workers read the whole run's compile cache (they write nothing to it)."""
    cache = str(tmp_path / "xla")

    def cmd(out, *extra):
        return [sys.executable, "-m", "k3jax.cli.main", "ablate", SMOKE, "--out", str(out), "--compile-cache", cache,
                "--json", "--no-progress", *extra]

    whole = subprocess.run(cmd(tmp_path / "whole"), capture_output=True, text=True, timeout=1200)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "w"
    procs = [subprocess.Popen(cmd(out, "--worker", f"{i}/2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    got = [p.communicate(timeout=1200) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in got]
    ran = [x for o, _ in got for x in json.loads(o)["phases"]["."]]
    assert sorted(ran) == ["base@0", "base@1", "kda_gate=softplus@0", "kda_gate=softplus@1"]
    assert not (out / "results.json").exists()
    rep = subprocess.run(cmd(out, "--report-only"), capture_output=True, text=True, timeout=600)
    assert rep.returncode == 0, rep.stderr
    assert strip_timing(json.loads(rep.stdout)) == strip_timing(json.loads(whole.stdout))
    for r in ("base/seed-0", "kda_gate=softplus/seed-0", "base/seed-1", "kda_gate=softplus/seed-1"):
        a, b = (json.load(open(d / "runs" / r / "result.json")) for d in (tmp_path / "whole", out))
        assert a["window_losses"] == b["window_losses"]
    for s in (0, 1):  # the shared seed checkpoints: one file per seed, the same values as the whole run's
        name = os.path.join("seeds", f"seed-{s}.npz")
        with np.load(tmp_path / "whole" / name) as za, np.load(out / name) as zb:
            assert sorted(za.files) == sorted(zb.files) and all(np.array_equal(za[k], zb[k]) for k in za.files)
