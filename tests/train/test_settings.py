"""TrainConfig as the one declaration of each training setting: the `k3 train` flags generated from its fields,
the resume keys and their flags, the ablation keys shipped studies were fingerprinted with, the choice lists held
equal to their homes, and `k3 plan`'s train programs running `k3 train`'s settings. No compute."""

import argparse
import dataclasses

import pytest

from k3jax.ablate.spec import LATER_TRAIN_KEYS, TRAIN_KEYS
from k3jax.cli.main import build_parser
from k3jax.config import DTYPES, KERNELS, LAYER_STACKS, QAT_MODES, REMAT_POLICIES, LoRAConfig, get_preset
from k3jax.optim import balance, dist_muon, optimizer
from k3jax.optim.optimizer import OptimConfig
from k3jax.plan.spec import PLAN_REMAT_AUTO, TRAIN_MODES, PlanSpec, run_settings, train_config, with_defaults
from k3jax.sharding import placement as place
from k3jax.sharding import rules
from k3jax.train import settings as ts
from k3jax.train.settings import TrainConfig
from k3jax.train.step import StepSpec

# The training keys ablation files could set when the shipped studies were run (experiments/ablations): a study's
# fingerprint holds its arms' resolved train keys, so this set may only grow by "later" keys.
SHIPPED_TRAIN_KEYS = {"batch", "micro_batches", "seq_len", "lr", "optimizer", "qat", "compute_dtype", "balance",
                      "sign_gamma", "qb_ema", "aux_alpha", "qk_clip", "qk_tau", "devices", "opt_state_dtype",
                      "muon_layout"}
# The resume keys and the flag each is named by in a refusal, as checkpoints were written with them.
RESUME_FLAGS = {"preset": "--preset", "init": "--init", "seed": "--seed", "batch": "--batch",
                "micro_batches": "--micro-batches", "seq_len": "--seq-len", "lr": "--lr", "optimizer": "--optimizer",
                "qat": "--qat", "compute_dtype": "--compute-dtype", "balance": "--balance", "sign_gamma": "sign_gamma",
                "qb_ema": "--qb-ema", "aux_alpha": "aux_alpha", "qk_clip": "--no-qk-clip", "qk_tau": "--qk-tau",
                "data": "--data", "max_bytes": "--max-bytes", "heldout_frac": "--heldout-frac",
                "total_steps": "--steps", "frozen_experts": "--frozen-experts", "opt_state_dtype": "--opt-state-dtype",
                "muon_layout": "--muon-layout", "packing_masks": "--no-packing-masks", "lora": "--lora"}


def _train_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["train"]


def test_ablation_keys_are_the_shipped_ones():
    assert set(ts.ablatable_keys()) == set(TRAIN_KEYS) == SHIPPED_TRAIN_KEYS
    assert set(ts.later_ablatable_keys()) == set(LATER_TRAIN_KEYS) == {"opt_state_dtype", "muon_layout"}


def test_resume_keys_and_their_flags():
    assert {k: ts.flag_of(k) for k in ts.RESUME_KEYS} == RESUME_FLAGS
    # a checkpoint that predates a key ran with its ``before`` value: the per-layer Muon, no document masks
    assert ts.resume_diff({}, TrainConfig(muon_layout="layer", packing_masks=False).resume_key()) == []
    assert ts.resume_diff({}, TrainConfig().resume_key()) == ["muon_layout", "packing_masks"]


def test_lora_resume_key_ignores_the_export_layout_and_reads_older_records():
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "experts"))
    key = TrainConfig(lora=lora).resume_key()["lora"]
    # what a run recorded before any later LoRA field existed
    assert key == {"rank": 4, "alpha": 8.0, "targets": ["attn", "experts"], "dropout": 0.0}
    assert TrainConfig(lora=lora.replace(peft_experts="fused")).resume_key()["lora"] == key  # file layout only


def test_choice_lists_are_their_homes():
    assert ts.OPTIMIZERS == optimizer.MODES
    assert ts.BALANCE_MODES == balance.MODES
    assert ts.MUON_LAYOUTS == ("auto", *dist_muon.LAYOUTS)
    assert ts.STRATEGIES == rules.STRATEGIES
    choices = {k: s.choices for k, s in ts.SETTINGS.items() if s.choices}
    assert choices == {"qat": QAT_MODES, "compute_dtype": ("float32", "bfloat16"), "layer_stack": LAYER_STACKS,
                       "remat": REMAT_POLICIES, "optimizer": ts.OPTIMIZERS, "muon_layout": ts.MUON_LAYOUTS,
                       "balance": ts.BALANCE_MODES, "kernels": KERNELS}
    assert set(ts.TRAIN_DTYPES) < set(DTYPES)


def test_every_flag_is_a_setting_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    job = {"coordinator", "num_processes", "process_id", "distributed_timeout"}  # the process group's, not the run's
    # --draft-for's own flags: the draft it trains (k3jax/draft/train.py), not a model run's settings
    job |= {"draft_for", "draft_layers", "draft_tokens", "draft_anchors", "target_dense"}
    job |= {"adapter_experts"}  # folded into --lora's setting (LoRAConfig.peft_experts: the export's file layout)
    actions = [a for a in _train_parser()._actions if not isinstance(a, argparse._HelpAction) and a.dest not in job]
    flagged = {k for k, s in ts.SETTINGS.items() if s.group}
    assert {a.dest for a in actions} == flagged
    resolved_later = {"preset", "optimizer"}  # None on the command line: train_config resolves them
    for a in actions:
        default = None if a.dest in resolved_later else fields[a.dest].default
        assert a.default == default, a.dest
        assert a.option_strings[0] == ts.flag_of(a.dest), a.dest  # --progress also has --no-progress
    d = TrainConfig()
    assert (d.max_bytes, d.heldout_frac) == (ts.CORPUS_BYTES, ts.HELDOUT_FRAC) == (4 << 20, 0.05)


def test_generated_help_names_every_choice():
    helps = {a.dest: a.help for a in _train_parser()._actions}
    assert all(s in helps["strategy"] for s in rules.STRATEGIES), helps["strategy"]
    assert "group" in helps["remat"] and "none" in helps["remat"]
    assert "1%% linear warm-up" in helps["lr"] and "(default 4,194,304)" in helps["max_bytes"]
    assert "(default 100)" in helps["qk_tau"] and '{"text": ...}' in helps["data"]


@pytest.mark.parametrize("mode", TRAIN_MODES)
def test_plan_train_programs_run_k3_trains_settings(mode):
    """A train-mode plan compiles `k3 train`'s step: its run, optimizer and step settings are TrainConfig's —
    the values plans compiled before they shared the train program."""
    cfg = get_preset("k3-mini")
    spec = with_defaults(PlanSpec(mode=mode, mesh="fsdp=2,expert=2", batch=8, seq_len=64))[0]
    assert spec.remat == "auto"  # resolved by the compile (aot.auto_remat) into each policy it tries
    spec = dataclasses.replace(spec, remat=PLAN_REMAT_AUTO[0])
    tc = train_config(spec)
    lora = mode == "lora"
    sizes = dict(fsdp=2, expert=2)          # the plan's --kernels on its (TPU) target, over its mesh
    rows = place.kernel_rows(spec.strategy, sizes, spec.batch)   # whole sequences per device: the MLA kernel
    assert rows and run_settings(cfg, spec).mla_impl == "pallas"
    assert run_settings(cfg, spec) == ts.run_settings(tc, cfg, param_dtype="bfloat16" if lora else "float32",
                                                      platform=spec.platform, mesh=sizes, rows=rows)
    assert ts.optim_config(tc) == OptimConfig(total_steps=1000, state_dtype=spec.opt_state_dtype,
                                              muon_layout=spec.muon_layout, mode="adamw" if lora else "per_head")
    assert ts.step_spec(tc) == (StepSpec(balance="off", qk_clip=False) if lora else StepSpec())
