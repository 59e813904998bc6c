"""`k3 ablate`'s statistics against hand-computed values: Student-t quantiles, paired intervals (a zero-variance case
included), the window bootstrap, the A/A floor and the verdicts; and results.json assembled from synthetic records
(known paired differences, the A/A arm, the determinism repeat)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from k3jax.ablate.runner import Job
from k3jax.analysis.ablate_report import assemble, markdown, strip_timing
from k3jax.analysis.paired import aa_floor, bootstrap_ci, paired_t, t_quantile, verdict

# Student-t 0.975 quantiles (two-sided 95%) from the standard tables, and closed forms for df = 1, 2
T975 = {1: 12.706204736174698, 2: 4.302652729749464, 4: 2.7764451051977934, 9: 2.2621571628540993,
        30: 2.0422724563012373}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_tables(df):
    assert t_quantile(0.975, df) == pytest.approx(T975[df], rel=1e-10)


@pytest.mark.parametrize("p", [0.6, 0.9, 0.995, 0.2])
def test_t_quantile_closed_forms(p):
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)


def test_paired_t_hand_computed():
    s = paired_t([0.1, 0.2, 0.3])  # mean 0.2, std 0.1, sem 0.1 / sqrt(3), t(0.975, 2) = 4.30265
    half = T975[2] * 0.1 / math.sqrt(3)
    assert (s["n"], s["mean"], s["std"]) == (3, pytest.approx(0.2), pytest.approx(0.1))
    assert s["half_width"] == pytest.approx(half)
    assert s["ci95"] == pytest.approx([0.2 - half, 0.2 + half])


def test_paired_t_zero_variance_and_one_seed():
    s = paired_t([0.25, 0.25, 0.25, 0.25])
    assert (s["mean"], s["std"], s["half_width"], s["ci95"]) == (0.25, 0.0, 0.0, [0.25, 0.25])
    one = paired_t([0.5])
    assert one["std"] is None and one["ci95"] is None
    assert verdict(one, None, None)[0] == "undetermined"


def test_bootstrap_hand_computed():
    assert bootstrap_ci(np.full(16, 0.25)) == [0.25, 0.25]
    # two windows: resampled means are 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4 -> the 2.5% / 97.5% points 0 and 1
    assert bootstrap_ci([0.0, 1.0], reps=4000) == [0.0, 1.0]
    a = bootstrap_ci(np.linspace(-1, 2, 50), reps=500, seed=3)
    assert a == bootstrap_ci(np.linspace(-1, 2, 50), reps=500, seed=3)  # a fixed seed: deterministic
    with pytest.raises(ValueError, match="non-empty 1-D"):
        bootstrap_ci([])


def test_floor_and_verdicts():
    aa = paired_t([0.01, -0.01, 0.02, 0.0])
    assert aa_floor(aa) == pytest.approx(abs(aa["mean"]) + aa["half_width"])
    assert aa_floor(paired_t([0.1])) is None and aa_floor(None) is None
    tight = paired_t([0.02, 0.021, 0.019, 0.02])  # clearly above zero
    assert verdict(tight, [0.01, 0.03], None)[0] == "worse"
    assert verdict(paired_t([-0.02, -0.021, -0.019]), [-0.03, -0.01], None)[0] == "better"
    word, why = verdict(tight, [0.01, 0.03], floor=0.05)
    assert word == "within noise" and "A/A floor 0.0500" in why
    word, why = verdict(paired_t([0.01, -0.01, 0.02]), [0.001, 0.02], None)
    assert word == "within noise" and "covers 0" in why
    assert verdict(tight, [-0.001, 0.03], None)[0] == "within noise"  # the window bootstrap covers zero


# ------------------------------------------------------------------------------------------- assemble


def _arm(name, run_id, factor=None, level=None):
    derived = {"params": 100, "active_params": 50, "tokens": 64}
    return SimpleNamespace(name=name, run_id=run_id, factor=factor, level=level, derived=derived, cfg=SimpleNamespace(
        name="k3-tiny"), train={"steps": 2, "batch": 4, "seq_len": 8})


def _rec(loss_w, *, tps=100.0):
    return {"final_eval_loss": float(np.mean(loss_w)), "window_losses": [float(x) for x in loss_w],
            "curve": {"step": [1, 2], "eval_loss": [float(np.mean(loss_w)) + 1, float(np.mean(loss_w))]},
            "skipped_steps": [], "timing": {"tokens_per_s": tps, "wall_s": 1.0}}


def _spec(aa_seed_offset=None, repeat=False):
    base, b = _arm("base", "base"), _arm("f=b", "f=b", "f", "b")
    same = _arm("g=b", "f=b", "g", "b")  # resolves like f=b: runs once, under f=b
    factors = [SimpleNamespace(name="f", keys=("model.x",), varies=(), holds=(), tolerance=0.01,
                               levels={"a": "base", "b": "f=b"}, base_level="a"),
               SimpleNamespace(name="g", keys=("model.x",), varies=(), holds=(), tolerance=0.01,
                               levels={"a": "base", "b": "g=b"}, base_level="a")]
    seeds = (0, 1, 2)
    aa = {"seed_offset": aa_seed_offset, "repeat": repeat}
    return SimpleNamespace(name="t", description="", path="t.toml", fingerprint="0" * 64, seeds=seeds, base=base,
                           arms={"base": base, "f=b": b, "g=b": same}, factors=factors, aa=aa, bootstrap=200,
                           aa_seeds=tuple(s + aa_seed_offset for s in seeds) if aa_seed_offset else ())


def _records(spec, deltas, aa_deltas=None, repeat_delta=0.0):
    rng = np.random.default_rng(0)
    jobs = []
    for s, d in zip(spec.seeds, deltas):
        w = 3.0 + 0.1 * rng.standard_normal(8)
        jobs += [(Job("base", s), _rec(w)), (Job("f=b", s), _rec(w + d))]
        if aa_deltas is not None:
            jobs.append((Job("base", s + spec.aa["seed_offset"]), _rec(w + aa_deltas[s])))
    if spec.aa["repeat"]:
        w0 = jobs[0][1]["window_losses"]
        jobs.append((Job("base", spec.seeds[0], "repeat"), _rec(np.add(w0, repeat_delta))))
    return dict(jobs)


def _init():
    return {rid: {"params": 100, "from_base": 100 if rid == "base" else 90, "own_leaves": []}
            for rid in ("base", "f=b")}


def test_assemble_known_paired_differences():
    spec = _spec(aa_seed_offset=10, repeat=True)
    r = assemble(spec, _records(spec, deltas=[0.1, 0.2, 0.3], aa_deltas=[0.01, -0.01, 0.0]), _init())
    lv = r["factors"]["f"]["levels"]["b"]
    assert lv["paired"]["per_seed"] == pytest.approx([0.1, 0.2, 0.3])
    assert lv["paired"]["ci95"] == pytest.approx(paired_t([0.1, 0.2, 0.3])["ci95"])
    assert lv["bootstrap_ci95"] == pytest.approx([0.2, 0.2])  # every window moved by the seed's delta
    assert lv["delta_bits_per_byte"]["mean"] == pytest.approx(0.2 / math.log(2))
    assert r["factors"]["g"]["levels"]["b"]["paired"] == lv["paired"]  # the identical arm: same runs, same stats
    assert r["arms"]["g=b"]["run"] == "f=b"
    assert r["aa"]["paired"]["per_seed"] == pytest.approx([0.01, -0.01, 0.0])
    assert r["aa"]["floor"] == pytest.approx(aa_floor(paired_t([0.01, -0.01, 0.0])))
    assert r["aa"]["repeat"]["identical"] is True
    assert lv["verdict"] == "within noise"  # t(0.975, 2) is wide: [-0.048, 0.448] covers zero
    assert r["arms"]["base"]["init"]["from_base"] == 1.0 and r["arms"]["f=b"]["init"]["from_base"] == 0.9
    assert "base~aa" in r["arms"] and r["arms"]["base~aa"]["seeds"] == [10, 11, 12]
    assert "| f | b |" in markdown(r)


def test_assemble_zero_variance_effect_and_failed_repeat():
    spec = _spec(aa_seed_offset=None, repeat=True)
    r = assemble(spec, _records(spec, deltas=[0.25, 0.25, 0.25], repeat_delta=1e-6), _init())
    lv = r["factors"]["f"]["levels"]["b"]
    assert lv["paired"]["std"] == pytest.approx(0.0, abs=1e-12)
    assert lv["paired"]["ci95"] == pytest.approx([0.25, 0.25])
    assert lv["verdict"] == "worse" and "no A/A floor" in lv["reason"]
    assert r["aa"]["repeat"]["identical"] is False and r["aa"]["floor"] is None
    assert "DIFFERS" in markdown(r)


def test_strip_timing_at_every_depth():
    x = {"a": 1, "timing": 2, "b": [{"timing": 3, "c": 4}], "d": {"e": {"timing": 5, "f": 6}}}
    assert strip_timing(x) == {"a": 1, "b": [{"c": 4}], "d": {"e": {"f": 6}}}
