"""`k3 bench compile`: the depth schedule, the JSON it assembles (default suite: the compiles replaced by recorded
figures, so the ratios are checked exactly), bad arguments exit 2 before any compile, and the benchmark itself at a
tiny size (slow: every train-step compile of k3-tiny is tens of seconds on 2 shared cores)."""

import json
import math

import pytest

from k3jax.bench import compile as bc
from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.model import layout


def test_k3_schedule_keeps_k3s_layer_pattern():
    cfg = bc.k3_schedule(get_preset("k3-micro"), 92)
    assert cfg.num_layers == 92 and cfg.hidden_size == get_preset("k3-micro").hidden_size
    assert cfg.mla_layers == tuple(l for l in range(92) if l % 4 == 3)  # l mod 4 = 3, the last layer among them
    assert cfg.attn_res_boundaries == tuple(range(0, 92, 12)) and not cfg.is_moe(0) and cfg.is_moe(1)
    lay = layout(cfg)
    assert (lay.pre, lay.start, lay.period, lay.groups, lay.post) == ((0, 1, 2, 3), 4, 4, 22, ())
    assert bc.k3_schedule(get_preset("k3-micro"), 13).mla_layers == (3, 7, 11, 12)  # + the last one


def _fake(monkeypatch):
    """Replace the compiles by figures that depend on (depth, stack, part) and (stack, policy)."""
    def compile_times(cfg, run, *, batch, seq_len, log=None, parts=bc.PARTS):
        L, scan = cfg.num_layers, run.layer_stack == "scan"
        per = lambda k: {"lower_s": 0.1 * k, "compile_s": k * (1.0 + 0.01 * L if scan else 0.5 * L)}  # noqa: E731
        return {p: per(k) for p, k in (("forward", 1.0), ("grad", 2.0), ("train_step", 3.0)) if p in parts}

    def train_temp_bytes(cfg, run, *, batch, seq_len):
        return {"none": 1000, "full": 250}[run.remat] * (2 if run.layer_stack == "loop" else 1) * batch

    monkeypatch.setattr(bc, "compile_times", compile_times)
    monkeypatch.setattr(bc, "train_temp_bytes", train_temp_bytes)


def test_bench_compile_json_from_recorded_figures(monkeypatch, capsys):
    _fake(monkeypatch)
    rc = main(["bench", "compile", "--json", "--depths", "92,12,48", "--remat-policies", "none,full",
               "--remat-batch", "3", "--parts", "train_step,grad,forward"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] is True, out
    assert out["shape"]["depths"] == [12, 48, 92] and out["shape"]["preset"] == "k3-micro"
    assert set(out["times"]) == {"12", "48", "92"}
    for per in out["times"].values():
        assert set(per) == {"loop", "scan"}
        for t in per.values():
            assert set(t) == {"forward", "grad", "train_step"}
            assert all(set(x) == {"lower_s", "compile_s"} for x in t.values())
    assert out["remat"] == {"depth": 12, "batch": 3, "seq_len": 256,
                            "temp_bytes": {"loop": {"none": 6000, "full": 1500}, "scan": {"none": 3000, "full": 750}}}
    r = out["ratios"]
    assert r["compile_time_92_over_12_scan"] == pytest.approx(3 * 1.92 / (3 * 1.12))
    assert r["compile_time_92_over_12_loop"] == pytest.approx(92 / 12)
    assert r["scan_over_loop_92"] == pytest.approx(1.92 / 46)
    assert r["forward_compile_time_92_over_12_scan"] == pytest.approx(1.92 / 1.12)
    assert r["forward_scan_over_loop_92"] == pytest.approx(1.92 / 46)
    assert r["grad_compile_time_92_over_12_loop"] == pytest.approx(92 / 12)
    assert r["remat_temp_full_over_none_loop"] == r["remat_temp_full_over_none_scan"] == 0.25
    assert len(r) == 11
    # the default parts: forward and train step (the value_and_grad alone on request)
    assert main(["bench", "compile", "--json", "--depths", "12,92", "--remat-policies", ""]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["parts"] == ["forward", "train_step"]
    assert all(set(t) == {"forward", "train_step"} for per in out["times"].values() for t in per.values())
    assert set(out["ratios"]) == {"compile_time_92_over_12_scan", "compile_time_92_over_12_loop", "scan_over_loop_92",
                                  "forward_compile_time_92_over_12_scan", "forward_compile_time_92_over_12_loop",
                                  "forward_scan_over_loop_92"}
    assert main(["bench", "compile", "--json", "--depths", "12,92", "--parts", "forward", "--remat-policies", ""]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is None  # no train step, no target to meet


def test_bench_compile_target_missed_exits_1(monkeypatch, capsys):
    _fake(monkeypatch)
    assert main(["bench", "compile", "--json", "--depths", "12,92", "--stacks", "loop", "--remat-policies", ""]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is None and set(out["ratios"]) == {"compile_time_92_over_12_loop",
                                                        "forward_compile_time_92_over_12_loop"}
    monkeypatch.setattr(bc, "TARGET_SCAN_GROWTH", 1.5)  # the fake scan grows 1.71x from 12 to 92 layers
    assert main(["bench", "compile", "--json", "--depths", "12,92", "--remat-policies", ""]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


@pytest.mark.parametrize("argv,named", [(["--depths", "12,x"], "'12,x'"), (["--depths", "0,4"], "'0,4'"),
                                        (["--remat-policies", "none,dots"], "'dots'"),
                                        (["--stacks", "loop,unrolled"], "'loop,unrolled'"),
                                        (["--parts", "forward,backward"], "'forward,backward'"),
                                        (["--preset", "k3-nano"], "'k3-nano'"), (["--batch", "0"], "--batch 0")])
def test_bench_compile_bad_arguments_exit_2_before_compiling(monkeypatch, capsys, argv, named):
    def no_compile(*a, **k):
        raise AssertionError("compiled before the arguments were checked")

    monkeypatch.setattr(bc, "compile_times", no_compile)
    monkeypatch.setattr(bc, "train_temp_bytes", no_compile)
    assert main(["bench", "compile", "--json", *argv]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.slow  # the scanned stack and the default parts only (905 s with both stacks, session 9; 405 s with the
# value_and_grad part too, session 13)
def test_bench_compile_tiny_json(capsys):
    rc = main(["bench", "compile", "--json", "--preset", "k3-tiny", "--depths", "4,8", "--stacks", "scan",
               "--remat-policies", "none,full", "--remat-batch", "2",
               "--remat-seq-len", "64"])
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "compile" and out["shape"]["depths"] == [4, 8]
    assert rc == (1 if out["ok"] is False else 0)
    for L in ("4", "8"):
        for st in ("scan",):
            for part in ("forward", "train_step"):
                t = out["times"][L][st][part]
                assert t["lower_s"] > 0 and t["compile_s"] > 0, (L, st, part, t)
    temp = out["remat"]["temp_bytes"]
    for st in ("scan",):
        assert 0 < temp[st]["full"] < temp[st]["none"], temp
    r = out["ratios"]
    assert {"compile_time_8_over_4_scan", "remat_temp_full_over_none_scan"} <= set(r)
    assert all(math.isfinite(v) and v > 0 for v in r.values()), r
