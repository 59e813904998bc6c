"""The grid runner with a stand-in for the train loop (seconds, no compile): seed-major order, finished runs are not
redone, a grid stopped by SIGTERM and re-run gives the results of an uninterrupted one, identical arms run once, and
a determinism repeat that differs exits 1. The real loop runs in test_ablate_smoke.py (slow)."""

import json
import os

import numpy as np
import pytest

import k3jax.ablate.runner as ab
import k3jax.train.loop as loop
from k3jax.ablate.resolve import load_spec
from k3jax.analysis.ablate_report import strip_timing
from k3jax.cli.main import main

SPEC = """
seeds = 2
[base]
preset = "k3-tiny"
model = { num_layers = 2, full_attn_layers = [2], attn_res_block_size = 1 }
train = { batch = 4, seq_len = 32 }
[budget]
steps = 4
[data]
max_bytes = 100000
[eval]
windows = 4
every = 2
[aa]
seed_offset = 10
repeat = true
[[factor]]
name = "glu"
[[factor]]
name = "act"
keys = ["model.hidden_act"]
[factor.levels]
base = {}
silu = { model = { hidden_act = "silu" } }
"""


class FakeTrain:
    """Writes a metrics file like the loop's; the loss depends on the arm and the seed only (deterministic).
    ``stop_at``: the call index that returns stopped="sigterm" (as the loop does after saving a checkpoint)."""

    def __init__(self, stop_at=None, noisy_repeat=False):
        self.calls, self.stop_at, self.noisy_repeat = [], stop_at, noisy_repeat

    def __call__(self, tc, log=None):
        self.calls.append((tc.model.hidden_act, tc.seed, tc.ckpt_dir))
        base = 3.0 + 0.1 * (tc.model.hidden_act == "silu") + 0.01 * (tc.seed % 10) + 0.001 * (tc.seed >= 10)
        if self.noisy_repeat and tc.ckpt_dir.endswith(os.path.join("seed-0-repeat", "ckpt")):
            base += 1e-9
        with open(tc.metrics, "a") as f:
            f.write(json.dumps({"event": "start", "step": 0}) + "\n")
            for s in range(1, tc.steps + 1):
                rec = {"step": s, "loss": base + 1 / s, "finite": True, "tokens_per_s": 1000.0 + s}
                if s % tc.eval_every == 0 or s == tc.steps:
                    rec["eval_loss"] = base + 0.5 / s
                f.write(json.dumps(rec) + "\n")
        stopped = "sigterm" if len(self.calls) - 1 == self.stop_at else None
        return {"stopped": stopped, "params": {"base": base}, "final_eval_loss": base, "start_step": 0}


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(ab, "window_losses", lambda params, arm: params["base"] + np.linspace(-0.01, 0.01, 4))
    monkeypatch.setattr(ab, "init_plan", lambda spec, out: ({}, {rid: {"params": 10, "from_base": 10, "own_leaves": []}
                                                             for rid in spec.runs}))
    monkeypatch.setattr(ab, "seed_checkpoint", lambda spec, out, plan, seed: None)

    def use(f):
        monkeypatch.setattr(loop, "train", f)
        return f
    return use


def _spec(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(SPEC)
    return str(p)


def _run(path, out):
    rc = main(["ablate", path, "--out", str(out), "--compile-cache", "off", "--no-progress", "--json"])
    return rc, (json.load(open(out / "results.json")) if (out / "results.json").exists() else None)


def test_grid_order_and_identical_arms_run_once(tmp_path):
    spec = load_spec(_spec(tmp_path))
    assert list(spec.runs) == ["base", "glu=swiglu"]  # act=silu resolves like glu=swiglu
    assert [j.label for j in ab.grid(spec)] == ["base@0", "glu=swiglu@0", "base@10", "base@1", "glu=swiglu@1",
                                                "base@11", "base@0-repeat"]


def test_stopped_grid_resumes_to_the_uninterrupted_results(tmp_path, fake, capsys):
    path = _spec(tmp_path)
    f = fake(FakeTrain())
    rc, whole = _run(path, tmp_path / "a")
    assert rc == 0 and len(f.calls) == 7
    assert whole["factors"]["glu"]["levels"]["swiglu"]["paired"]["mean"] == pytest.approx(0.1)
    assert whole["aa"]["repeat"]["identical"] and whole["aa"]["paired"]["mean"] == pytest.approx(0.001)
    assert whole["arms"]["act=silu"]["run"] == "glu=swiglu"
    assert whole["arms"]["base"]["curve"]["step"] == [2, 4]
    for name in ("results.md", "curves.png", "ablation.json"):
        assert (tmp_path / "a" / name).exists()

    f = fake(FakeTrain(stop_at=3))  # SIGTERM during the 4th run
    rc, part = _run(path, tmp_path / "b")
    assert rc == 0 and part is None and len(f.calls) == 4
    assert "stopped by SIGTERM" in capsys.readouterr().err
    f = fake(FakeTrain())
    rc, resumed = _run(path, tmp_path / "b")
    assert rc == 0 and len(f.calls) == 4  # the 3 finished runs are not redone; the stopped one continues
    assert strip_timing(resumed) == strip_timing(whole)
    assert resumed["timing"].keys() == {"this_invocation_s", "runs_wall_s"}

    f = fake(FakeTrain())
    rc, again = _run(path, tmp_path / "b")
    assert rc == 0 and f.calls == [] and strip_timing(again) == strip_timing(whole)


def test_a_differing_determinism_repeat_exits_1(tmp_path, fake, capsys):
    fake(FakeTrain(noisy_repeat=True))
    rc, r = _run(_spec(tmp_path), tmp_path / "o")
    assert rc == 1 and r["aa"]["repeat"]["identical"] is False
    assert "run twice differs" in capsys.readouterr().err


def test_read_metrics_dedupes_resumed_steps_and_skips_compile_steps(tmp_path):
    p = tmp_path / "m.jsonl"
    recs = [{"event": "start"}, {"step": 1, "loss": 1, "finite": True, "tokens_per_s": 1.0},
            {"step": 2, "loss": 1, "finite": False, "tokens_per_s": 10.0, "eval_loss": 5.0},
            {"event": "start"}, {"step": 2, "loss": 1, "finite": False, "tokens_per_s": 2.0, "eval_loss": 5.0},
            {"step": 3, "loss": 1, "finite": True, "tokens_per_s": 30.0, "eval_loss": 4.0}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = ab.read_metrics(str(p))
    assert m["curve"] == {"step": [2, 3], "eval_loss": [5.0, 4.0]}
    assert m["skipped_steps"] == [2] and m["tokens_per_s"] == 20.0  # median of steps 2 and 3 (each first step out)
