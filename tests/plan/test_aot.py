"""Ahead-of-time plans (k3jax/plan/aot.py, `k3 plan --compile`): the compiled program's per-device argument bytes
against the closed-form estimate for every mode, the input checks (exit 2 before any compile), the CPU re-spawn and
the TPU compiler through libtpu's deviceless topologies (slow pass: one libtpu process at a time)."""

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.plan import aot, estimate, hardware
from k3jax.plan import spec as plan_spec
from k3jax.plan.hardware import xla_flags

REPO = Path(__file__).resolve().parents[2]
TINY = get_preset("k3-tiny")
LIBTPU_LOCK = "/tmp/k3jax_libtpu_tests.lock"  # the lock tests/pallas/test_targets.py takes around libtpu children


# CI budget (session 13): forward in the default suite, train in the slow pass, frozen-experts manual (passed in
# 109 s, experiments/LOG.md)
@pytest.mark.parametrize("mode,state", [("forward", "float32"),
                                        pytest.param("train", "float32", marks=pytest.mark.slow),
                                        pytest.param("train", "bfloat16", marks=pytest.mark.slow),
                                        pytest.param("frozen-experts", "float32", marks=pytest.mark.manual)])
def test_compiled_arguments_match_the_closed_form(mode, state):
    """XLA:CPU over the test's 8 devices, data=2 x expert=4: the compiler's argument bytes per device are the
    config's parameters x the rules' shardings x the mode's bytes per parameter (within 0.1%: the estimate leaves
    out step counters, the RNG key and Muon's coefficients; ``--opt-state-dtype bfloat16``: 2 bytes per moment); the
    program is the scanned stack with the expert-parallel exchange inside it, and its FLOPs are counted through the
    loops. Serving modes: test_serving.py."""
    spec = plan_spec.PlanSpec(mode=mode, mesh="data=2,expert=4", batch=8, seq_len=32,
                              remat="none" if mode == "forward" else "full", opt_state_dtype=state)
    out = aot.compile_plan(TINY, hardware.parse_target("cpu:8"), spec)
    assert out["argument_over_estimate"] == pytest.approx(1.0, rel=1e-3), out["estimate"]
    assert out["temp_bytes_per_device"] > 0 and out["fits"] is None and out["roofline"] is None
    assert "all-to-all" in out["collectives"]  # the bucketed expert exchange (XLA:CPU)
    assert out["hlo"]["while_trip_counts"]
    # packed experts run a tile loop whose trip count depends on the routing (counted once, and listed)
    assert (out["hlo"]["unknown_trip_counts"] > 0) == (mode != "train")
    assert out["flops"]["compiled_per_device"] > out["hlo"]["flops_counted_once"]
    if mode == "forward":
        assert out["estimate"]["optimizer"] == 0 and out["estimate"]["packed_experts"] > 0
    else:
        assert out["lower_bound_bytes_per_device"] > out["estimated_argument_bytes_per_device"]
        assert (out["estimate"]["packed_experts"] > 0) == (mode == "frozen-experts")
    if mode == "train":  # no routing-dependent loops: the FLOP check is exact up to attention and capacity padding
        assert out["flops"]["within_20pct_of_expected"], out["flops"]
    if mode != "forward":  # the owner layout's Newton–Schulz: the compiled program spends what the pools plan
        assert out["flops"]["newton_schulz_compiled_over_split"] == pytest.approx(1.0, rel=1e-6), out["flops"]
        assert out["optimizer_collectives"]["bytes"] > 0


@pytest.mark.slow
def test_lora_plan_trains_the_adapters_alone_over_a_packed_base():
    """--mode lora (the QLoRA step) on 8 XLA:CPU devices: argument bytes = the BF16 base + packed experts + fp32
    adapters with AdamW's two moments (the closed form), no Newton–Schulz, the optimizer state the adapters' alone."""
    spec = plan_spec.PlanSpec(mode="lora", mesh="data=2,expert=4", batch=8, seq_len=32, lora_rank=4)
    out = aot.compile_plan(TINY, hardware.parse_target("cpu:8"), spec)
    assert out["argument_over_estimate"] == pytest.approx(1.0, rel=1e-3), out["estimate"]
    e = out["estimate"]
    assert e["packed_experts"] > 0 and e["optimizer"] == 2 * e["gradient_bytes"] > 0
    assert "newton_schulz" not in out["flops"] and "optimizer_collectives" not in out
    assert out["flops"]["compiled_per_device"] > 0


def test_lora_spec_over_the_plan_defaults():
    """``--lora`` takes k3 train's vocabulary over the plan's adapters (rank 16 or --lora-rank, alpha 2 x rank,
    every target): shared-A expert factors are planned as trained."""
    lora = plan_spec.plan_lora(plan_spec.PlanSpec(mode="lora", mesh="expert=8", batch=8, seq_len=32,
                                                  lora="experts_shared_a=true,rank=8"))
    assert (lora.rank, lora.alpha, lora.targets, lora.experts_shared_a) == (8, 16.0, plan_spec.LORA_TARGETS, True)
    lora = plan_spec.plan_lora(plan_spec.PlanSpec(mode="lora", mesh="expert=8", batch=8, seq_len=32, lora_rank=4,
                                                  lora="targets=experts,dropout=0.1"))
    assert (lora.rank, lora.alpha, lora.targets, lora.dropout) == (4, 8.0, ("experts",), 0.1)


def test_estimate_by_hand_for_kimi_k3():
    """The closed form at full size, against a count by hand: under ep over 64 devices every tensor with an experts
    dimension (the routed experts and the router [D, E], 92 MoE layers) splits 64 ways and everything else —
    the router's QB bias [E] too — is replicated; train keeps fp32 master + Muon momentum (AdamW: two moments)."""
    cfg = get_preset("kimi-k3")
    spec = plan_spec.PlanSpec(mode="train", mesh="expert=64", batch=64, seq_len=4096, opt_state_dtype="float32")
    sizes, strategy = plan_spec.check(cfg, hardware.parse_target("cpu:64"), spec)
    est = estimate.estimate_arguments(cfg, spec, sizes, strategy)
    n_total = 2_779_484_476_000  # docs/checkpoint.md §12.1, the k3jax tree (A_log unpadded)
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    n_experts = moe_layers * cfg.num_experts * (3 * cfg.routed_expert_hidden_size * cfg.moe_intermediate_size
                                                + cfg.hidden_size)
    per_device = n_total - n_experts + n_experts / 64
    assert est["weights"] == pytest.approx(4 * per_device, rel=1e-9)
    assert 8 * per_device <= est["weights"] + est["optimizer"] <= 12 * per_device
    assert est["tokens"] == 4 * 4097
    half = estimate.estimate_arguments(cfg, spec.__class__(**{**spec.__dict__, "opt_state_dtype": "bfloat16"}), sizes,
                                       strategy)
    assert half["optimizer"] == pytest.approx(est["optimizer"] / 2, rel=1e-12) and half["weights"] == est["weights"]


def test_plan_defaults_are_the_full_size_program_and_flags_override_them():
    """Unset fields get what one deploys at full size (capacity 1.25, remat auto in the train modes — group where
    it fits, else full: ``aot.auto_remat`` —, zero3_ep_tp on fsdp x expert meshes, bf16 moments in train mode), each
    reported; a flag given is kept as given (-1: dropless)."""
    spec, d = plan_spec.with_defaults(plan_spec.PlanSpec(mode="frozen-experts", mesh="fsdp=8,expert=64", batch=512,
                                             seq_len=4096))
    assert d == {"remat": "auto", "capacity_factor": 1.25, "strategy": "zero3_ep_tp", "opt_state_dtype": "float32"}
    assert (spec.remat, spec.capacity_factor, spec.strategy) == ("auto", 1.25, "zero3_ep_tp")
    spec, d = plan_spec.with_defaults(plan_spec.PlanSpec(mode="train", mesh="fsdp=8,expert=64", batch=512,
                                                         seq_len=4096))
    assert d["opt_state_dtype"] == spec.opt_state_dtype == "bfloat16" and d["remat"] == "auto"
    spec, d = plan_spec.with_defaults(plan_spec.PlanSpec(mode="forward", mesh="expert=64", batch=64, seq_len=4096))
    assert d == {"remat": "none", "capacity_factor": 1.25, "strategy": "ep"} and spec.opt_state_dtype == "float32"
    given = plan_spec.PlanSpec(mode="train", mesh="fsdp=2,expert=4", batch=8, seq_len=32, remat="dots_saveable",
                         capacity_factor=-1.0, strategy="fsdp_ep_tp", opt_state_dtype="float32")
    assert plan_spec.with_defaults(given) == (given, {})
    assert plan_spec.check(TINY, hardware.parse_target("cpu:8"), given)[1] == "fsdp_ep_tp"


def test_auto_remat_keeps_the_first_policy_that_fits():
    """Remat auto compiles group, then full only when group does not fit (over the chip, or the compiler's own
    out-of-memory); each policy tried is reported with its peak; when none fits, the last plan says so."""
    def compiler(fits: dict):
        calls = []

        def compile_with(policy):
            calls.append(policy)
            if fits[policy] == "oom":
                e = aot.HbmOomError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
                e.plan = {"defaults": {}, "wall_s": 1.0}
                raise e
            return {"fits": fits[policy], "peak_bytes_per_device": 90e9 if fits[policy] else 120e9,
                    "wall_s": 2.0, "defaults": {}}
        return compile_with, calls

    log = lambda s: None  # noqa: E731
    fn, calls = compiler({"group": True, "full": True})
    out = aot.auto_remat(fn, log)
    assert calls == ["group"] and out["remat_auto"]["chosen"] == "group" and out["defaults"]["remat"] == "auto"
    fn, calls = compiler({"group": None, "full": True})  # off TPU nothing is over budget: group
    assert aot.auto_remat(fn, log)["remat_auto"]["chosen"] == "group" and calls == ["group"]
    for group in (False, "oom"):
        fn, calls = compiler({"group": group, "full": True})
        out = aot.auto_remat(fn, log)
        assert calls == ["group", "full"] and out["remat_auto"]["chosen"] == "full"
        assert [t["fits"] for t in out["remat_auto"]["tried"]] == [False, True]
    fn, calls = compiler({"group": False, "full": False})
    out = aot.auto_remat(fn, log)
    assert out["fits"] is False and out["remat_auto"]["chosen"] is None and calls == ["group", "full"]
    fn, calls = compiler({"group": "oom", "full": "oom"})
    with pytest.raises(aot.HbmOomError) as e:
        aot.auto_remat(fn, log)
    assert e.value.plan["remat_auto"]["chosen"] is None and len(e.value.plan["remat_auto"]["tried"]) == 2


def test_newton_schulz_flops_match_the_compiled_optimizer():
    """The closed-form Newton–Schulz FLOPs of one K3 optimizer step (per head / per expert / per layer blocks,
    from the config and the rules) equal the dot FLOPs of the compiled optimizer update (loop-corrected: the
    stacked groups are updated one layer at a time in a loop), on one device; the per-device share of a mesh is
    the global figure over the ways the leaves are split, and a replicated leaf counts once per device."""
    import jax
    import numpy as np

    from k3jax.model import abstract_params
    from k3jax.optim.optimizer import OptimConfig, make_optimizer
    from k3jax.plan.hlo_cost import program_stats
    from k3jax.sharding.placement import parse_mesh

    spec = plan_spec.PlanSpec(mode="train", mesh="data=1", batch=1, seq_len=8)
    ns = estimate.newton_schulz_flops(TINY, spec, parse_mesh("data=1"), "fsdp", OptimConfig().ns_steps)
    params = abstract_params(TINY)
    tx, _ = make_optimizer(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), params), OptimConfig())
    state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(lambda g, s, p: tx.update(g, s, p)[0]).lower(params, state, params).compile()
    assert program_stats(compiled.as_text()).flops == pytest.approx(ns["global"], rel=1e-3)
    assert ns["per_device"] == ns["global"]
    # layer layout: experts split 4 ways, everything else replicated: the expert blocks' share falls 4x
    layer = plan_spec.PlanSpec(mode="train", mesh="expert=4", batch=4, seq_len=8, muon_layout="layer")
    sharded = estimate.newton_schulz_flops(TINY, layer, parse_mesh("expert=4"), "ep", OptimConfig().ns_steps)
    assert sharded["global"] == ns["global"] and ns["global"] / 4 < sharded["per_device"] < ns["global"]
    # owner layout (the default): the replicated blocks are split too; what is left over the ideal quarter is padding
    owner = estimate.newton_schulz_flops(TINY, layer.__class__(**{**layer.__dict__, "muon_layout": "owner"}),
                                         parse_mesh("expert=4"), "ep", OptimConfig().ns_steps)
    assert owner["per_device"] < sharded["per_device"]
    assert owner["per_device"] * 4 == pytest.approx(ns["global"] * (1 + owner["padding"]))
    assert 0 <= owner["padding"] < 1


@pytest.mark.parametrize("argv,msg", [
    (["--target", "cpu:8", "--mesh", "expert=4"], "--mesh expert=4: 4 devices, but --target cpu:8 has 8"),
    (["--target", "cpu:3", "--mesh", "expert=3"], "not divisible by mesh axes ('expert',)"),
    (["--target", "gpu:h200", "--mesh", "expert=8"], "--target 'gpu:h200': unknown target"),
    (["--target", "tpu:v9:2x2", "--mesh", "expert=4"], "--target 'tpu:v9:2x2': unknown target"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "serve"], "--mode 'serve': unknown"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "decode"], "--mode decode needs --context"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "decode", "--context", "64", "--batch", "12"],
     "--batch 12: not divisible by the 8 ways the batch is split (mesh axes expert), and not smaller than them"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "prefill", "--batch", "1"], "--batch 1: not divisible"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "decode", "--context", "64", "--seq-len", "8"],
     "--seq-len 8: a decode step is one token per row"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--context", "64"],
     "--context 64: the cache's length; --mode forward has no cache"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "prefill", "--batch", "8", "--seq-len", "64",
      "--context", "32"], "--context 32: must lie in [64,"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--opt-state-dtype", "bfloat16"],
     "--opt-state-dtype bfloat16: --mode forward has no optimizer"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--mode", "train", "--opt-state-dtype", "int8"],
     "--opt-state-dtype 'int8': the optimizer state's dtype must be a float dtype"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "decode", "--context", "64", "--batch", "8",
      "--muon-layout", "layer"], "--muon-layout layer: --mode decode has no optimizer"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--packed-kernel", "pallas"],
     "--packed-kernel pallas --target cpu:8: the packed-expert Pallas kernel compiles for TPU targets"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--mode", "train", "--remat", "most"], "--remat 'most'"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--remat", "full"], "--mode forward has none"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "4"], "--batch 4: not divisible by the 8 ways"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--capacity-factor", "0"], "--capacity-factor 0.0"),
    (["--target", "cpu:8"], "--compile needs one --mesh"),
    (["--mesh", "expert=8"], "--compile needs --target"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--strategy", "zero4"], "--strategy 'zero4': unknown"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--packed-kernel", "fast"], "--packed-kernel 'fast': unknown"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--mode", "train", "--lora",
      "experts_shared_a=true"], "--lora experts_shared_a=true: --mode train has no adapters"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--mode", "lora", "--lora-rank", "8", "--lora",
      "rank=4"], "give the rank once"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--mode", "lora", "--lora", "rank=0"], "rank"),
    (["--target", "cpu:8", "--mesh", "expert=8", "--batch", "8", "--mode", "lora", "--lora", "shared=1"],
     "--lora 'shared=1': expected rank="),
])
def test_bad_input_exits_2_before_any_compile(capsys, argv, msg):
    assert main(["plan", "--preset", "k3-tiny", "--compile", *argv]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--mode", "decode", "--batch", "64", "--context", "2097152"], "--context 2097152: must lie in [1, 1048576]"),
    (["--mode", "prefill", "--batch", "64", "--seq-len", "2097152"],
     "--seq-len 2097152: above kimi-k3's max_position_embeddings 1048576"),
])
def test_context_above_the_release_limit_exits_2(capsys, argv, msg):
    """The release's max_position_embeddings (config.json; K3 is NoPE, k3jax keeps it as read metadata)."""
    assert main(["plan", "--preset", "kimi-k3", "--compile", "--target", "cpu:64", "--mesh", "tensor=4,expert=16",
                 *argv]) == 2
    assert msg in capsys.readouterr().err


def test_tpu_target_without_libtpu_exits_2_saying_how_to_install(capsys, monkeypatch):
    monkeypatch.setattr(plan_spec, "libtpu_installed", lambda: False)
    assert main(["plan", "--preset", "k3-tiny", "--compile", "--target", "tpu:v5p:2x2x1", "--mesh", "expert=4",
                 "--batch", "4"]) == 2
    err = capsys.readouterr().err
    assert "libtpu is not installed" in err and "pip install -e '.[tpu]'" in err


def test_oom_message_figures():
    msg = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
           "CompileTimeHbmOomError: ... HLO temporaries (6.03T) exceeds available HBM (95.73G)")
    f = aot.oom_figures(msg)
    assert f == {"used_bytes": pytest.approx(6.03 * 2**40), "available_bytes": pytest.approx(95.73 * 2**30)}


def _k3(argv, env=None, timeout=900):
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = xla_flags(None)  # one CPU device
    return subprocess.run([sys.executable, "-m", "k3jax.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.slow
def test_cpu_target_respawns_with_its_device_count(tmp_path):
    """`--target cpu:4` from a process without 4 CPU devices re-runs itself with
    --xla_force_host_platform_device_count=4; the JSON is the child's (one object on stdout); --hlo-out writes the
    compiled program."""
    hlo = tmp_path / "plan.hlo"
    r = _k3(["plan", "--preset", "k3-tiny", "--compile", "--target", "cpu:4", "--mesh", "expert=4", "--mode",
             "frozen-experts", "--batch", "4", "--seq-len", "32", "--json", "--hlo-out", str(hlo)])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["devices"] == 4 and out["mesh"] == "expert=4" and out["strategy"] == "ep"
    assert out["argument_over_estimate"] == pytest.approx(1.0, rel=1e-3)
    assert "ENTRY" in hlo.read_text()


def _tpu(argv, preset="k3-tiny"):
    with open(LIBTPU_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # libtpu: one process at a time
        return _k3(["plan", "--preset", preset, "--compile", *argv, "--json"], timeout=1200)


@pytest.mark.slow
@pytest.mark.xdist_group("libtpu")
def test_tpu_compiler_plans_and_out_of_memory_exits_1():
    """The TPU compiler (libtpu, deviceless v5p:2x2x1): the train step compiles with the ragged expert exchange and
    the roofline at v5p's peaks; the full kimi-k3 forward on four v5e chips (16 GB each; its replicated BF16
    weights alone are ~114 GB) is a result, exit 1 with the compiler's figures (~20 s: the compiler stops early)."""
    r = _tpu(["--target", "tpu:v5p:2x2x1", "--mesh", "expert=4", "--mode", "train", "--batch", "4",
              "--seq-len", "64"])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["platform"] == "tpu" and out["fits"] is True and "ragged-all-to-all" in out["collectives"]
    assert out["roofline"]["chip"] == "TPU v5p" and out["roofline"]["step_s"] > 0
    assert out["argument_bytes_per_device"] >= out["estimated_argument_bytes_per_device"]  # TPU tiles pad
    # frozen MXFP4 experts under EP: the Mosaic kernels run the routed experts (forward, and the transposed one for
    # the rows' gradient), loop-corrected per MoE layer, charged their cost estimates in the roofline's byte split
    r = _tpu(["--target", "tpu:v5p:2x2x1", "--mesh", "expert=4", "--mode", "frozen-experts", "--batch", "4",
              "--seq-len", "64"])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    tiny = get_preset("k3-tiny")
    moe_layers = sum(tiny.is_moe(i) for i in range(tiny.num_layers))
    kernels = out["hlo"]["kernels"]
    assert kernels["mxfp4_gmm_tpu_fwd"]["count"] >= 3 * moe_layers and kernels["mxfp4_gmm_tpu_fwd"]["estimated"]
    assert kernels["mxfp4_gmm_tpu_bwd_x"]["count"] >= 3 * moe_layers and kernels["mxfp4_gmm_tpu_bwd_x"]["estimated"]
    assert out["hlo"]["custom_calls"]["tpu_custom_call"] >= 6 * moe_layers
    split = out["hlo"]["hbm_bytes_split"]
    assert split["kernels"] >= sum(k["bytes"] for n, k in kernels.items() if n.startswith("mxfp4"))
    assert sum(split.values()) == pytest.approx(out["hlo"]["bytes_accessed"])
    roof = out["roofline"]
    assert roof["compiled_compute_s"] >= roof["compute_s"] > 0 and roof["compute_share"] == pytest.approx(
        roof["compute_s"] / roof["step_s"])
    r = _tpu(["--target", "tpu:v5e:2x2", "--mesh", "expert=4", "--batch", "4", "--seq-len", "64"], preset="kimi-k3")
    assert r.returncode == 1, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["fits"] is False and out["hbm_oom"]["used_bytes"] > out["hbm_oom"]["available_bytes"]
