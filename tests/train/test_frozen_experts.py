"""Frozen-expert fine-tuning (`k3 train --init CKPT --frozen-experts`): the routed experts stay the checkpoint's
MXFP4 bytes (run by the grouped MXFP4 matmul, outside gradients and the optimizer); everything else trains.

* k3-mini from an exported MXFP4 checkpoint: held-out loss at step 20 at least 0.05 nats below step 0, and the
  re-exported expert tensors (weight_packed / weight_scale) are byte-identical (sha256) (slow);
* the same on an expert-parallel mesh (k3-tiny, data 2 × expert 4): the packed experts are sharded over `expert`
  and the losses equal the one-device run's (slow);
* bad input exits 2 before anything is initialised.
"""

import hashlib
import json

import jax
import numpy as np
import pytest
from safetensors import safe_open

from k3jax.checkpoint import save
from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.model import init_params
from k3jax.train.loop import build, train
from k3jax.train.settings import TrainConfig


def _export(cfg, d, fmt="mxfp4"):
    cfg = cfg.replace(expert_format=fmt)
    save(init_params(cfg, jax.random.key(0)), cfg, d, overwrite=True)
    return str(d)


def _expert_hashes(d) -> dict:
    index = json.load(open(f"{d}/model.safetensors.index.json"))["weight_map"]
    out = {}
    for name, f in sorted(index.items()):
        if ".experts." in name:
            with safe_open(f"{d}/{f}", framework="numpy") as st:
                out[name] = hashlib.sha256(st.get_tensor(name).tobytes()).hexdigest()
    return out


@pytest.mark.slow
def test_frozen_expert_finetune_k3_mini_learns_and_keeps_expert_bytes(tmp_path):
    ck = _export(get_preset("k3-mini"), tmp_path / "ck")
    tc = TrainConfig(preset=None, init=ck, frozen_experts=True, steps=20, batch=8, seq_len=64, lr=3e-3,
                     eval_every=20, eval_at_start=True, progress=False, peak_flops=1e12, devices=1,
                     export=str(tmp_path / "out"))
    s = train(tc, log=lambda m: None)
    (s0, l0), (s20, l20) = s["evals"]
    assert (s0, s20) == (0, 20)
    print(f"\nfrozen experts, k3-mini: held-out {l0:.4f} -> {l20:.4f} (drop {l0 - l20:.4f} nats)")
    assert l0 - l20 >= 0.05
    before, after = _expert_hashes(ck), _expert_hashes(tmp_path / "out")
    assert len(before) == 3 * 2 * 32 * (9 - 1) and before == after  # w1/w3/w2 × packed/scale × 32 experts × 8 MoE


@pytest.mark.slow
def test_frozen_experts_on_an_expert_parallel_mesh(tmp_path):
    ck = _export(get_preset("k3-tiny"), tmp_path / "ck")
    tc = TrainConfig(preset=None, init=ck, frozen_experts=True, steps=2, batch=8, seq_len=16, max_bytes=100_000,
                     eval_every=1000, progress=False, peak_flops=1e12)
    run = build(tc.replace(mesh="data=2,expert=4"), log=lambda m: None)
    frozen = run.state["frozen"]
    packed = jax.tree.leaves(frozen)
    assert packed and all(x.dtype == np.uint8 for x in packed)
    assert not any("experts" in jax.tree_util.keystr(p) for p, _ in
                   jax.tree_util.tree_leaves_with_path(run.state["params"]))  # nothing of the experts is trained
    for x in packed:  # [E, out, in/2 or in/32] (or [G, E, ...]): the expert axis split 4 ways
        assert {s.data.size * 4 for s in x.addressable_shards} == {x.size}
    single = train(tc.replace(devices=1), log=lambda m: None)["losses"]
    mesh = train(tc.replace(mesh="data=2,expert=4"), log=lambda m: None)["losses"]
    np.testing.assert_allclose(mesh, single, rtol=1e-5)


@pytest.mark.parametrize("argv, msg", [
    (["--preset", "k3-tiny", "--frozen-experts"], "give --init"),
    (["--init", "BF16", "--frozen-experts"], "stores its routed experts as bf16"),
    (["--init", "MXFP4", "--frozen-experts", "--qat", "weights"], "without master weights"),
], ids=["no-init", "bf16-experts", "qat-weights"])
def test_bad_frozen_input_exits_2_before_compute(argv, msg, tmp_path, capsys, monkeypatch):
    import k3jax.train.loop as loop_mod

    cfg = get_preset("k3-tiny")
    subst = {"BF16": _export(cfg, tmp_path / "bf16", "bf16") if "BF16" in argv else None,
             "MXFP4": _export(cfg, tmp_path / "mx") if "MXFP4" in argv else None}

    def boom(*a, **k):
        raise AssertionError("initialised parameters despite bad input")

    monkeypatch.setattr(loop_mod, "initial_params", boom)
    rc = main(["train", *[subst.get(a) or a for a in argv], "--steps", "1", "--max-bytes", "100000",
               "--no-progress"])
    assert rc == 2
    assert msg in capsys.readouterr().err
