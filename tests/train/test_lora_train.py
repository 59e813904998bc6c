"""LoRA / QLoRA fine-tuning (`k3 train --init CKPT --lora ...`): only the adapters get gradients and
optimizer state, the base checkpoint's files are untouched, an MXFP4 base stays packed, and --export writes the
adapters in PEFT's layout, which `k3 logits --adapter` applies."""

import hashlib
import os

import jax
import numpy as np
import pytest

from k3jax.checkpoint import save
from k3jax.checkpoint.peft import ADAPTER_CONFIG, load_adapter
from k3jax.cli.main import main
from k3jax.config import LoRAConfig, default_run, get_preset
from k3jax.layers.experts import merge_trees, split_packed
from k3jax.layers.lora import is_adapter, split_adapters
from k3jax.model import forward, init_params
from k3jax.train.loop import build, train
from k3jax.train.settings import TrainConfig

TINY = get_preset("k3-tiny")
CHAT = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "sft", "chat_train.jsonl")


def _sha(d) -> dict:
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest() for f in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    save(init_params(TINY, jax.random.key(0)), TINY, d, overwrite=True)     # MXFP4 experts (k3-tiny's format)
    return str(d)


def _paths(tree) -> set:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def test_qlora_trains_adapters_only_and_leaves_the_base_untouched(base, tmp_path):
    before = _sha(base)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "shared", "dense", "experts"))
    tc = TrainConfig(preset=None, init=base, lora=lora, optimizer="adamw", steps=3, batch=4, seq_len=64,
                     data=(CHAT,), max_bytes=60_000, devices=1, eval_every=100, progress=False, peak_flops=1e9,
                     export=str(tmp_path / "adapter"))
    run = build(tc)
    trained, frozen = run.state["params"], run.state["frozen"]
    assert all("_lora_" in p for p in _paths(trained))                       # the adapters alone train
    assert not any("_lora_" in p for p in _paths(frozen))
    assert split_packed(frozen)[1]                                          # QLoRA: the experts stay packed bytes
    per_leaf = {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(run.state["opt"])
                if ".mu[" in jax.tree_util.keystr(p) or ".nu[" in jax.tree_util.keystr(p)}
    assert per_leaf and all("_lora_" in p for p in per_leaf)                 # AdamW moments of the adapters only
    assert len(per_leaf) == 2 * len(_paths(trained))
    summary = train(tc)
    assert _sha(base) == before                                             # the base checkpoint's files unchanged
    ad = split_adapters(summary["params"])[0]
    assert any(np.any(np.asarray(x) != 0) for p, x in jax.tree_util.tree_leaves_with_path(ad)
               if jax.tree_util.keystr(p).endswith("_lora_b']"))            # B moved off zero
    assert os.path.exists(tmp_path / "adapter" / ADAPTER_CONFIG)
    got_lora, leaves = load_adapter(str(tmp_path / "adapter"), TINY, default_run(TINY))
    assert got_lora == lora
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(leaves), jax.tree.leaves(ad), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(p)
    # the exported adapter over the loaded base reproduces the trained model's logits
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 16))
    run_l = default_run(TINY).replace(lora=lora)
    want = forward(summary["params"], tokens, TINY, run_l)
    from k3jax.checkpoint.source import load_model

    cfg, run2, params = load_model(ckpt=base, preset=None, adapter=str(tmp_path / "adapter"))
    np.testing.assert_allclose(forward(merge_trees(params, {}), tokens, cfg, run2), want, rtol=0, atol=1e-5)
    assert not any(is_adapter(k) for k in frozen)


@pytest.mark.parametrize("argv,msg", [
    (["--lora", "rank=0"], "rank"),
    (["--lora", "targets=attn+mlp"], "targets"),
    (["--lora", "rank=4,beta=1"], "beta"),
    (["--lora", "targets=attn,experts_shared_a=true"], "experts_shared_a"),
    (["--lora", "experts_shared_a=maybe"], "experts_shared_a"),
    (["--lora", "dropout=1"], "config field 'dropout': must lie in [0, 1)"),
    (["--lora", "dropout=-0.1"], "config field 'dropout': must lie in [0, 1)"),
], ids=["rank", "target", "key", "shared-a-without-experts", "shared-a-not-a-bool", "dropout-1", "dropout-negative"])
def test_bad_lora_exits_2_before_compute(argv, msg, capsys, monkeypatch):
    import k3jax.train.loop as loop_mod

    def boom(*a, **k):
        raise AssertionError("initialised parameters despite bad input")

    monkeypatch.setattr(loop_mod, "initial_params", boom)
    assert main(["train", "--preset", "k3-tiny", *argv, "--no-progress"]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--adapter-experts", "fused", "--export", "x"], "--adapter-experts: only with --lora and --export"),
    (["--lora", "rank=4", "--adapter-experts", "fused"], "--adapter-experts: only with --lora and --export"),
    (["--lora", "rank=4", "--adapter-experts", "stacked", "--export", "x"], "invalid choice: 'stacked'"),
], ids=["no-lora", "no-export", "bad-layout"])
def test_bad_adapter_flags_exit_2_before_compute(argv, msg, capsys, monkeypatch, tmp_path):
    import k3jax.train.loop as loop_mod

    monkeypatch.setattr(loop_mod, "initial_params", lambda *a, **k: pytest.fail("initialised despite bad input"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--preset", "k3-tiny", *argv, "--no-progress"]) == 2
    assert msg in capsys.readouterr().err


def test_adapter_flags_reach_the_lora_config():
    from k3jax.cli.main import build_parser
    from k3jax.cli.train import train_config

    args = build_parser().parse_args(["train", "--preset", "k3-tiny", "--lora", "rank=4",
                                      "--adapter-experts", "fused", "--export", "x"])
    lora = train_config(args).lora
    assert (lora.rank, lora.peft_experts) == (4, "fused")
    args = build_parser().parse_args(["train", "--preset", "k3-tiny", "--lora", "rank=4"])
    assert train_config(args).lora.peft_experts == "auto"


def _train_lora_cli(monkeypatch, base, lora: str, out) -> dict:
    """`k3 train --init base --lora LORA --export OUT` for 2 steps of chat data: the run's summary, its parameters
    kept (and the MFU probe skipped)."""
    import k3jax.train.loop as loop_mod

    real, got = loop_mod.train, {}

    def keep_params(tc, **kw):
        got.update(real(tc.replace(peak_flops=1e9), **{**kw, "need_params": True}))
        return got

    monkeypatch.setattr(loop_mod, "train", keep_params)
    assert main(["train", "--init", base, "--lora", lora, "--steps", "2", "--batch", "2", "--seq-len", "32", "--data",
                 CHAT, "--max-bytes", "60000", "--devices", "1", "--eval-every", "100", "--no-progress",
                 "--export", str(out)]) == 0
    return got


@pytest.mark.slow  # ~55 s on the 2-core CPU (the train step's compile ~30 s, k3 logits' ~10 s)
def test_shared_a_lora_trains_exports_and_k3_logits_applies_it(base, tmp_path, monkeypatch):
    """`k3 train --init CKPT --lora ...,experts_shared_a=true --export DIR` trains one A per routed stack (B per
    expert) over the packed base, exports it per expert (A copied to every expert, the sidecar's flag), and
    `k3 logits --adapter DIR` gives the trained model's logits."""
    out = tmp_path / "adapter"
    got = _train_lora_cli(monkeypatch, base, "rank=4,alpha=8,targets=attn+experts,experts_shared_a=true", out)
    ex = got["params"]["pre"][2]["moe"]["experts"]
    assert np.any(np.asarray(ex["w1_lora_b"]) != 0)                                      # trained off B = 0
    assert ex["w1_lora_a"].ndim == 2 and ex["w1_lora_b"].shape[:2] == (TINY.num_experts, 4)   # A [in, r] shared
    lora, leaves = load_adapter(str(out), TINY, default_run(TINY))
    assert lora == LoRAConfig(rank=4, alpha=8.0, targets=("attn", "experts"), experts_shared_a=True)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(leaves), jax.tree.leaves(
            split_adapters(got["params"])[0]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(p)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 16)).astype(np.int32)
    np.save(tmp_path / "t.npy", tokens)
    assert main(["logits", "--ckpt", base, "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "y.npy"),
                 "--adapter", str(out)]) == 0
    want = forward(got["params"], tokens, TINY, default_run(TINY).replace(lora=lora))
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=0, atol=1e-5)


def test_shared_a_lora_flag_spellings_and_help(capsys):
    from k3jax.cli.main import build_parser
    from k3jax.config.lora import parse_lora

    assert parse_lora("targets=experts,experts_shared_a=true").experts_shared_a
    assert parse_lora("experts_shared_a=1").experts_shared_a
    assert not parse_lora("experts_shared_a=False").experts_shared_a
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "PEFT has no shared-A form, so --export expands A per expert" in " ".join(capsys.readouterr().out.split())


def test_lora_dropout_flag_and_help(capsys):
    from k3jax.cli.main import build_parser
    from k3jax.config.lora import parse_lora

    assert parse_lora("rank=4,dropout=0.05").dropout == 0.05 and parse_lora("rank=4").dropout == 0.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "dropout=P (0 <= P < 1, default 0): PEFT's LoRA dropout" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow  # ~95 s on the 2-core CPU (the train step's compile)
def test_lora_dropout_trains_exports_and_reloads(base, tmp_path, monkeypatch):
    """`k3 train --lora ...,dropout=0.1 --export DIR` runs its steps with dropout and exports it: per-expert
    modules (k3-tiny's layout) carry lora_dropout 0.1; the same adapter with fused experts writes 0 (PEFT refuses
    dropout on target_parameters) and the sidecar keeps 0.1; both reload to the trained LoRAConfig and leaves."""
    import json

    from k3jax.checkpoint.peft import SIDECAR, save_adapter

    out = tmp_path / "adapter"
    got = _train_lora_cli(monkeypatch, base, "rank=4,alpha=8,targets=attn+shared+experts,dropout=0.1", out)
    assert got["step"] == 2 and not got["skipped_steps"] and np.isfinite(got["final_loss"])
    trained = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "shared", "experts"), dropout=0.1)
    ad = split_adapters(got["params"])[0]
    fused = tmp_path / "fused"
    save_adapter(ad, TINY, default_run(TINY).replace(lora=trained.replace(peft_experts="fused")), str(fused))
    for d, written in ((out, 0.1), (fused, 0.0)):
        assert json.load(open(d / ADAPTER_CONFIG))["lora_dropout"] == written
        assert json.load(open(d / SIDECAR))["lora"]["dropout"] == 0.1
        lora, leaves = load_adapter(str(d), TINY, default_run(TINY))
        assert lora == trained and lora.dropout == 0.1
        for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(leaves), jax.tree.leaves(ad), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(p)
