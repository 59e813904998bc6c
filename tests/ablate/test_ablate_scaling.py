"""Scaling studies (`k3 ablate` with [scaling]): the fit and the multiplier against hand-computed values on synthetic
losses, the bootstrap's resampling, every bad input exit 2 before any training, and the whole study flow — tuning on
its own windows, per-budget grids, calibration, A/A, kill and resume — with a stand-in for the train loop whose
losses follow a known law (seconds, no compile). The real loop runs the shipped scaling_smoke.toml (LOG, manual)."""

import json
import math
import os

import numpy as np
import pytest

import k3jax.ablate.runner as ab
import k3jax.train.loop as loop
from k3jax.ablate.parse import FIT_FORMS
from k3jax.ablate.resolve import eval_windows
from k3jax.ablate.study import load_study
from k3jax.analysis.ablate_report import strip_timing
from k3jax.analysis.scaling_fit import (
    FORMS,
    bootstrap_weights,
    compute_for,
    fit_curve,
    identified,
    multiplier,
)
from k3jax.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------------ the fit itself

def test_fit_recovers_a_known_saturating_law_and_the_multiplier_by_hand():
    E, A, alpha = 1.5, 40.0, 0.3
    C = np.array([1e3, 2e3, 4e3, 8e3, 16e3])
    f = fit_curve(C, E + A * C ** -alpha)
    assert f["form"] == "saturating"
    assert (f["E"], f["A"], f["alpha"]) == pytest.approx((E, A, alpha), rel=1e-7)
    # by hand: the compute reaching loss 2.0 is (A / (2.0 - E))^(1 / alpha) = 80^(10/3) = 2,210,216.6...
    assert float(compute_for(f, 2.0)) == pytest.approx(80.0 ** (10.0 / 3.0), rel=1e-6)
    assert float(compute_for(f, E - 0.1)) == math.inf  # below the asymptote: never reached
    # an arm whose loss at C is the base's at k·C is worth k times its compute, at every C
    k = 1.5
    assert multiplier(f, E + A * (k * C) ** -alpha, C) == pytest.approx(np.full(C.size, k), rel=1e-6)
    # an arm at 2 x 10^3 FLOPs with loss 3.0: the base needs (40 / 1.5)^(1 / 0.3) FLOPs for that
    assert float(multiplier(f, 3.0, 2e3)) == pytest.approx((40.0 / 1.5) ** (1 / 0.3) / 2e3, rel=1e-6)


def test_power_form_when_E_is_not_identified():
    C = np.array([1e3, 2e3, 4e3, 8e3])
    L = 7.0 * C ** -0.1  # a straight line in log-log: the saturating fit's best E is 0 or below
    ok, why = identified(C, L)
    assert not ok and "E" in why
    f = fit_curve(C, L)
    assert f["form"] == "power" and f["E"] == 0.0
    assert (f["A"], f["alpha"]) == pytest.approx((7.0, 0.1), rel=1e-9)
    assert fit_curve(C, L, "saturating")["form"] == "saturating"
    assert FIT_FORMS == FORMS


def test_weights_keep_a_noisy_budget_from_setting_the_slope():
    C = np.array([1e3, 2e3, 4e3, 8e3])
    L = 5.0 * C ** -0.2
    noisy = L.copy()
    noisy[0] += 0.4  # the smallest budget's seeds disagree (its variance is 1e4 x the others')
    w = np.array([1e-4, 1.0, 1.0, 1.0])
    assert fit_curve(C, noisy, "power", weights=w)["alpha"] == pytest.approx(0.2, rel=2e-3)
    assert fit_curve(C, noisy, "power")["alpha"] > 0.3  # unweighted, the outlier steepens it
    s = fit_curve(C, 1.0 + 4.0 * C ** -0.3, "saturating", weights=np.array([1.0, 2.0, 3.0, 4.0]))
    assert (s["E"], s["A"], s["alpha"]) == pytest.approx((1.0, 4.0, 0.3), rel=1e-6)  # exact points: any weights


def test_auto_form_is_the_power_law_at_four_budgets():
    from k3jax.analysis.scaling_report import choose_form

    C = np.array([1e3, 2e3, 4e3, 8e3])
    L = 1.5 + 40.0 * C ** -0.3
    form, why = choose_form("auto", {"base": C}, {"base": L}, {"base": np.ones(4)})
    assert form == "power" and "4 budgets" in why
    C5 = np.append(C, 16e3)
    assert choose_form("auto", {"base": C5}, {"base": 1.5 + 40.0 * C5 ** -0.3}, {"base": np.ones(5)})[0] == "saturating"


def test_local_fits_recover_a_known_multiplier_where_one_power_law_does_not():
    """A base that is not one power law over its budgets (a flat first budget, as warmup makes it, then slope 0.3)
    and a calibration arm at the base's loss of k x its compute: the report's multiplier, read on the 3 budgets
    nearest the compared compute (``scaling_report.LOCAL_WINDOW``), is k; read on one power law over all four
    budgets it is not (the shipped study's failure, LOG session 16); the A/A arm (the base itself) reads 1."""
    from k3jax.analysis import scaling_report

    C = np.array([1e3, 2e3, 4e3, 8e3])
    k = 1.5

    def base(c):  # slope 0.3 above 2e3, flatter (0.1) below it; continuous at 2e3
        c = np.asarray(c, np.float64)
        return np.where(c >= 2e3, 30.0 * c ** -0.3, 30.0 * 2e3 ** -0.3 * (c / 2e3) ** -0.1)

    rng = np.random.default_rng(0)
    noise = 1.0 + 1e-4 * rng.standard_normal((4, 2, 8))          # [budgets, seeds, windows], tiny and positive

    def series(run, f):
        return [{"budget": f"b{j}", "run": run, "tokens": int(c), "flops": float(c), "reported_flops": float(c),
                 "settings": {}, "window_losses": (f(c) * noise[j]).tolist()} for j, c in enumerate(C)]

    pts = {"series": {"base": series("base", base), "base~aa": series("base", base),
                      "calibration=x1_5": series("cal", lambda c: base(k * c))},
           "factors": {"calibration": {"reference": "base", "levels": {"x1_5": "calibration=x1_5"}, "true": k}}}
    meta = {"name": "t", "budgets": [{"name": f"b{j}"} for j in range(4)]}
    local = scaling_report.assemble(meta, pts, {}, form="auto", reps=50)
    every = scaling_report.assemble(meta, pts, {}, form="auto", reps=50, window=4)
    assert local["scaling"]["window"] == 3 and every["scaling"]["window"] == 4
    assert local["scaling"]["multipliers"]["calibration"]["x1_5"]["estimate"] == pytest.approx(k, rel=2e-3)
    assert local["scaling"]["aa"]["estimate"] == pytest.approx(1.0, rel=1e-3)
    assert abs(every["scaling"]["multipliers"]["calibration"]["x1_5"]["estimate"] - k) > 0.05
    assert local["series"]["base"]["fit_top"]["alpha"] == pytest.approx(0.3, rel=1e-2)
    assert local["series"]["base"]["fit_top"]["budgets"] == ["b1", "b2", "b3"]


def test_bootstrap_weights_are_index_resampling():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 5))  # [seeds, windows]
    ws, ww = bootstrap_weights(3, 5, reps=4, seed=7)
    r = np.random.default_rng(7)
    s, w = r.integers(0, 3, size=(4, 3)), r.integers(0, 5, size=(4, 5))
    for b in range(4):
        assert ws[b] @ x @ ww[b] == pytest.approx(x[s[b]][:, w[b]].mean())


# ------------------------------------------------------------------------------------------------ the file

HEAD = """
seeds = 2
[base]
preset = "k3-tiny"
model = { num_layers = 2, full_attn_layers = [2], attn_res_block_size = 1 }
train = { batch = 4, seq_len = 32 }
[data]
max_bytes = 100000
[eval]
windows = 4
"""
BUDGETS = """
[scaling]
budgets = [{ steps = 2 }, { steps = 4 }, { steps = 8 }, { steps = 16 }]
bootstrap = 200
fit = "saturating"
"""
STUDY = HEAD + BUDGETS + """
[aa]
seed_offset = 10
[[factor]]
name = "glu"
tune = { lr = [1e-3, 3e-3, 1e-2] }
[[factor]]
name = "calibration"
k = 1.5
"""


def _write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, needles", [
    (HEAD + '[scaling]\nbudgets = [{ steps = 2 }, { steps = 4 }, { steps = 8 }]\n[[factor]]\nname = "glu"\n',
     ["[scaling] budgets", "3 budget(s)", "at least 4"]),
    (HEAD + '[scaling]\nbudgets = [{ steps = 2 }, { steps = 8 }, { steps = 4 }, { steps = 16 }]\n'
            '[[factor]]\nname = "glu"\n', ["budgets[2]", "must increase in compute"]),
    (HEAD + '[scaling]\nbudgets = [{ steps = 4 }, { steps = 5 }, { steps = 6 }, { steps = 8 }]\n'
            '[[factor]]\nname = "glu"\n', ["[scaling] budgets", "span 2.00x", ">= 8x"]),
    (HEAD + BUDGETS + '[[factor]]\nname = "glu"\ntune = { lr = [1e-3, 1e-2] }\n[[factor]]\nname = "lr"\n'
                      'keys = ["train.lr"]\n[factor.levels]\na = {}\nb = { train = { lr = 1e-2 } }\n',
     ["('glu').tune.lr", "train.lr is a key of factor 'lr'"]),
    (HEAD + BUDGETS + '[[factor]]\nname = "calibration"\nk = 1.5\nkeys = ["train.lr"]\n',
     ["factor #1.keys", "takes `k` only"]),
    (HEAD + BUDGETS + '[[factor]]\nname = "calibration"\nk = 1.3\n', ["calibration", ".k", "whole number of steps"]),
    (HEAD + BUDGETS + '[[factor]]\nname = "calibration"\nk = 2\n', [".k", "budget 'b1'", "base run exactly"]),
    (HEAD + BUDGETS + '[[factor]]\nname = "calibration"\nk = 1\n', [".k", "other than 1"]),
    (HEAD + '[budget]\nsteps = 2\n[[factor]]\nname = "glu"\ntune = { lr = [1e-3, 1e-2] }\n',
     ["tune", "belongs to a scaling study"]),
    (HEAD + '[budget]\nsteps = 2\n' + BUDGETS + '[[factor]]\nname = "glu"\n', ["[budget]", "[scaling] budgets"]),
    (HEAD + BUDGETS + '[[factor]]\nname = "glu"\ntune = { lr = [1e-3] }\n', ["tune.lr", "at least 2"]),
    (HEAD + BUDGETS.replace('fit = "saturating"', 'fit = "cubic"') + '[[factor]]\nname = "glu"\n', ["fit", "cubic"]),
    (HEAD + BUDGETS + 'window = 2\n[[factor]]\nname = "glu"\n', ["[scaling] window", "[3, 4]", "got 2"]),
])
def test_bad_scaling_input_exits_2_naming_the_field(tmp_path, capsys, text, needles):
    out = tmp_path / "out"
    assert main(["ablate", _write(tmp_path, text), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, (n, err)
    assert not out.exists()  # nothing run, nothing written


def test_tuning_windows_share_no_token_with_the_evaluation_windows(tmp_path):
    st = load_study(_write(tmp_path, STUDY))
    arm = st.budgets[0].spec.base
    ev, tu = eval_windows(arm).tokens, eval_windows(arm, tuning=True).tokens
    assert len(tu) == len(ev) - 1
    from k3jax.ablate.resolve import corpus
    from k3jax.train.evaluate import spaced_windows

    held = corpus(arm.train["data"], arm.train["max_bytes"], arm.train["heldout_frac"])[1]
    n = len(held) - arm.train["seq_len"] - 1
    starts = np.linspace(0, n, len(ev)).astype(np.int64)
    mids = (starts[:-1] + starts[1:]) // 2
    used = {i for s in starts for i in range(s, s + arm.train["seq_len"] + 1)}
    assert not used & {i for s in mids for i in range(s, s + arm.train["seq_len"] + 1)}
    assert (spaced_windows(held, num=len(ev), seq_len=arm.train["seq_len"], vocab=arm.cfg.vocab_size,
                          between=True).tokens == tu).all()


# ------------------------------------------------------------------------------------------------ the flow

E0, A0, ALPHA = 2.0, 6.0, 0.5
BEST_LR = {"situ": 3e-3, "silu": 1e-2}


class LawTrain:
    """The train loop's stand-in: final loss E0 + A0·(tokens_eff / 128)^(−α) + a seed offset, where SwiGLU (silu)
    at its best learning rate sees twice its tokens (a multiplier of 2 by construction) and a learning rate off the
    level's best costs 0.05 per factor of 10 (so tuning must find it)."""

    def __init__(self, stop_at=None):
        self.calls, self.stop_at = [], stop_at

    def __call__(self, tc, log=None):
        self.calls.append((tc.model.hidden_act, tc.lr, tc.seed, tc.steps))
        tokens = tc.steps * tc.batch * tc.seq_len * (2.0 if tc.model.hidden_act == "silu" else 1.0)
        loss = E0 + A0 * (tokens / 128) ** -ALPHA + 0.01 * (tc.seed % 10) + 0.001 * (tc.seed >= 10)
        loss += 0.05 * abs(math.log10(tc.lr / BEST_LR[tc.model.hidden_act]))
        with open(tc.metrics, "a") as f:
            f.write(json.dumps({"event": "start", "step": 0}) + "\n")
            for s in range(1, tc.steps + 1):
                rec = {"step": s, "loss": loss, "finite": True, "tokens_per_s": 1000.0}
                if s % tc.eval_every == 0 or s == tc.steps:
                    rec["eval_loss"] = loss
                f.write(json.dumps(rec) + "\n")
        stopped = "sigterm" if len(self.calls) - 1 == self.stop_at else None
        return {"stopped": stopped, "params": {"loss": loss}, "final_eval_loss": loss, "start_step": 0}


@pytest.fixture
def law(monkeypatch):
    def losses(params, arm, tuning=False):  # per-window spread shared by every arm (the windows are shared)
        n = 3 if tuning else 4
        return params["loss"] + np.linspace(-0.02, 0.02, n)

    monkeypatch.setattr(ab, "window_losses", losses)
    monkeypatch.setattr(ab, "init_plan", lambda spec, out: ({}, {rid: {"params": 10, "from_base": 10, "own_leaves": []}
                                                             for rid in spec.runs}))
    monkeypatch.setattr(ab, "seed_checkpoint", lambda spec, out, plan, seed: None)

    def use(f):
        monkeypatch.setattr(loop, "train", f)
        return f
    return use


def _run(path, out):
    rc = main(["ablate", path, "--out", str(out), "--compile-cache", "off", "--no-progress", "--json"])
    return rc, (json.load(open(out / "results.json")) if (out / "results.json").exists() else None)


def test_study_tunes_fits_recovers_known_multipliers_and_resumes(tmp_path, law):
    path = _write(tmp_path, STUDY)
    f = law(LawTrain())
    rc, r = _run(path, tmp_path / "a")
    assert rc == 0
    # tuning: 2 levels x 3 learning rates at the first seed, per budget; situ's best is the base's own 3e-3
    tune = r["tuning"]["glu"]
    assert {b: t["chosen"] for b, t in tune["swiglu"].items()} == {f"b{i}": {"lr": 1e-2} for i in range(4)}
    assert {b: t["chosen"] for b, t in tune["situ"].items()} == {f"b{i}": {"lr": 3e-3} for i in range(4)}
    # every budget: 6 tuning runs (situ at 3e-3 is the base config), then base, swiglu, calibration at 2 seeds + 2 A/A
    assert len(f.calls) == 4 * (6 + 8)
    assert [p["settings"]["lr"] for p in r["series"]["glu=swiglu"]["points"]] == [1e-2] * 4
    m = r["scaling"]["multipliers"]
    assert r["scaling"]["form"] == "saturating"
    assert m["glu"]["swiglu"]["reference"] == "glu=situ"
    assert m["glu"]["swiglu"]["estimate"] == pytest.approx(2.0, rel=1e-5)
    assert m["calibration"]["x1_5"]["estimate"] == pytest.approx(1.5, rel=1e-5)
    assert m["calibration"]["x1_5"]["true"] == 1.5
    lo, hi = m["calibration"]["x1_5"]["ci95"]
    assert lo <= 1.5 <= hi
    assert all(x == pytest.approx(1.5, rel=1e-4) for x in m["calibration"]["x1_5"]["curve"]["estimate"])
    assert 0.9 < r["scaling"]["aa"]["estimate"] < 1.0  # the A/A seeds sit 0.001 nats above the base by construction
    # the calibration level reports the base's compute while training 1.5 x its tokens
    cal, base = r["series"]["calibration=x1_5"]["points"], r["series"]["base"]["points"]
    assert [p["reported_flops"] for p in cal] == [p["flops"] for p in base]
    assert [p["tokens"] for p in cal] == [int(1.5 * p["tokens"]) for p in base]
    for name in ("results.md", "scaling.png", "study.json", "budgets/b3/results.json", "budgets/b3/curves.png"):
        assert (tmp_path / "a" / name).exists()
    md = (tmp_path / "a" / "results.md").read_text()
    assert "| calibration | x1_5 | base | 1.5 |" in md and "*lr 0.01" in md

    f = law(LawTrain(stop_at=20))  # SIGTERM inside budget b1's grid
    rc, part = _run(path, tmp_path / "b")
    assert rc == 0 and part is None and len(f.calls) == 21
    f = law(LawTrain())
    rc, resumed = _run(path, tmp_path / "b")
    assert rc == 0 and len(f.calls) == 4 * 14 - 20  # finished runs are not redone; the stopped one continues
    assert strip_timing(resumed) == strip_timing(r)
    f = law(LawTrain())
    rc, again = _run(path, tmp_path / "b")
    assert rc == 0 and f.calls == [] and strip_timing(again) == strip_timing(r)


def test_study_check_prints_budgets_and_refuses_another_files_directory(tmp_path, capsys, law):
    path = _write(tmp_path, STUDY)
    assert main(["ablate", path, "--check"]) == 0
    out = capsys.readouterr().out
    assert "4 budgets" in out and "budget b3: 2,048 tokens" in out and "(6 tuning)" in out
    law(LawTrain())
    assert _run(path, tmp_path / "o")[0] == 0
    other = _write(tmp_path, STUDY.replace("k = 1.5", "k = 2.5"), name="t.toml")
    assert main(["ablate", other, "--out", str(tmp_path / "o"), "--compile-cache", "off"]) == 2
    assert "different scaling study" in capsys.readouterr().err


def test_shipped_scaling_studies_resolve():
    for name in ("scaling_smoke", "scaling"):
        p = os.path.join(REPO, "experiments", "ablations", f"{name}.toml")
        if name == "scaling" and not os.path.exists(p):
            pytest.fail("experiments/ablations/scaling.toml (the shipped study) is missing")
        st = load_study(p)
        flops = [b.spec.base.derived["tokens"] for b in st.budgets]
        assert len(st.budgets) >= 4 and flops == sorted(flops) and flops[-1] >= 8 * flops[0]


def test_width_budgets_scale_the_preset_and_its_compute(tmp_path):
    from k3jax.ablate.study import widen
    from k3jax.config import get_preset

    w = widen(get_preset("k3-micro"), 1.5, "here")
    assert (w.hidden_size, w.kda_num_heads, w.mla_num_heads, w.intermediate_size, w.moe_intermediate_size,
            w.routed_expert_hidden_size, w.q_lora_rank, w.kv_lora_rank) == (192, 3, 3, 576, 96, 96, 96, 96)
    assert (w.kda_head_dim, w.num_layers, w.num_experts, w.num_experts_per_token) == (64, 9, 16, 2)
    text = HEAD + """
[scaling]
budgets = [{ steps = 4, width = 0.5 }, { steps = 4 }, { steps = 4, width = 2 }, { steps = 8, width = 2 }]
[[factor]]
name = "glu"
"""
    st = load_study(_write(tmp_path, text))
    assert [b.spec.base.cfg.hidden_size for b in st.budgets] == [32, 64, 128, 128]
    assert [b.spec.arms["glu=swiglu"].cfg.hidden_size for b in st.budgets] == [32, 64, 128, 128]


def test_recorded_smoke_study_tables_come_from_its_results_json():
    from k3jax.analysis.scaling_report import markdown

    d = os.path.join(REPO, "experiments", "runs", "scaling-smoke")
    r = json.load(open(os.path.join(d, "results.json")))
    assert markdown(r) == open(os.path.join(d, "results.md")).read()
    cal = r["scaling"]["multipliers"]["calibration"]["x1_5"]
    assert cal["true"] == 1.5 and cal["ci95"][0] <= 1.5 <= cal["ci95"][1] and cal["ci95"][0] > 1.0
    lo, hi = r["scaling"]["aa"]["ci95"]
    assert lo <= 1.0 <= hi


def test_shipped_study_tables_come_from_its_runs():
    """The shipped study (experiments/runs/scaling, 144 runs): results.md is ``markdown(results.json)``, and every
    point's per-seed losses are the final held-out losses of that run's own records (budgets/<b>/runs/<run>/seed-<s>:
    seeds 0-2, the A/A series the base at its seeds 1000-1002, experiments/ablations/scaling.toml)."""
    from k3jax.analysis.scaling_report import markdown

    d = os.path.join(REPO, "experiments", "runs", "scaling")
    r = json.load(open(os.path.join(d, "results.json")))
    assert markdown(r) == open(os.path.join(d, "results.md")).read()
    assert r["timing"]["runs"] == 144
    checked = 0
    for key, series in r["series"].items():
        seeds = [s + (1000 if key == "base~aa" else 0) for s in r["spec"]["seeds"]]
        for p in series["points"]:
            runs = os.path.join(d, "budgets", p["budget"], "runs", p["run"])
            got = [json.load(open(os.path.join(runs, f"seed-{s}", "result.json")))["final_eval_loss"] for s in seeds]
            assert p["loss"]["per_seed"] == pytest.approx(got, rel=1e-12), (key, p["budget"])
            checked += 1
    assert checked == len(r["series"]) * len(r["spec"]["budgets"]) == 40
