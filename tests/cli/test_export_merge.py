"""`k3 export OUT --from BASE --merge-adapter DIR`: the merged checkpoint in the official layout,
experts re-quantized to MXFP4, with the report of what the grid kept and the merged-vs-adapter comparison."""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from k3jax.checkpoint import save
from k3jax.checkpoint.peft import save_adapter
from k3jax.cli.main import main
from k3jax.config import LoRAConfig, default_run, get_preset
from k3jax.model import init_params

TINY = get_preset("k3-tiny")
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "shared", "dense", "experts"))
HELDOUT = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "sft", "chat_heldout.jsonl")


def _tensors(d) -> dict:
    index = json.load(open(f"{d}/model.safetensors.index.json"))["weight_map"]
    out = {}
    for name, f in index.items():
        with safe_open(f"{d}/{f}", framework="numpy") as st:
            out[name] = hashlib.sha256(st.get_tensor(name).tobytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    save(init_params(TINY, jax.random.key(0)), TINY, root / "base", overwrite=True)
    run = default_run(TINY).replace(lora=LORA)
    fresh = init_params(TINY, jax.random.key(0), run)
    save_adapter(fresh, TINY, run, str(root / "zero"))
    rng = np.random.default_rng(0)
    trained = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype)
        if jax.tree_util.keystr(p).endswith("_lora_b']") else x, fresh)
    save_adapter(trained, TINY, run, str(root / "trained"))
    return root


@pytest.mark.slow  # CI's budget (session 23): the merge's other tests in this module stay in the default suite
def test_a_zero_adapter_merges_to_the_base_exactly(base_and_adapters, tmp_path):
    """Every value equal; the bytes too, except MXFP4 codes of a signed zero: the writer quantized a tiny negative
    weight to -0, which reads back as 0.0 and is written again as +0 (the same value)."""
    from k3jax.checkpoint.load import load

    root = base_and_adapters
    assert main(["export", str(tmp_path / "m"), "--from", str(root / "base"), "--merge-adapter",
                 str(root / "zero")]) == 0
    a, b = _tensors(tmp_path / "m"), _tensors(root / "base")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a if "experts" not in k)
    (_, pm), (_, pb) = load(str(tmp_path / "m")), load(str(root / "base"))
    for x, y in zip(jax.tree.leaves(pm), jax.tree.leaves(pb), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_merged_checkpoint_reports_the_grid_and_matches_the_adapter(base_and_adapters, tmp_path, capsys):
    root = base_and_adapters
    assert main(["export", str(tmp_path / "m"), "--from", str(root / "base"), "--merge-adapter",
                 str(root / "trained"), "--heldout", HELDOUT, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = out["requantization"]
    assert s["expert_tensors"] == 3 * len([l for l in range(TINY.num_layers) if l >= TINY.first_k_dense_replace])
    assert 0.0 < s["delta_kept_min"] <= s["delta_kept_mean"] <= 1.5 and 0.0 < s["moved_mean"] <= 1.0
    assert all({"delta_rel", "requant_rel", "delta_kept", "moved"} <= set(t) for t in out["tensors"].values())
    # merged (bf16 dense weights, MXFP4 experts) vs base + adapter in fp32: rounding only, far below the adapter
    assert out["logits_rel_rms_merged_vs_adapter"] < 0.05 * out["logits_rel_rms_base_vs_adapter"]
    h = out["heldout_answer_nats"]
    assert abs(h["merged"] - h["adapter"]) < 0.05 and set(h) == {"base", "adapter", "merged"}


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "k3-tiny", "--merge-adapter", "ZERO"], "give --from BASE"),
    (["--from", "BASE", "--heldout", "x.jsonl"], "give --merge-adapter"),
    (["--from", "BASE", "--merge-adapter", "BASE"], "adapter_config.json"),
], ids=["no-base", "heldout-alone", "not-an-adapter"])
def test_bad_merge_input_exits_2_and_writes_nothing(base_and_adapters, tmp_path, argv, msg, capsys):
    root = base_and_adapters
    subst = {"ZERO": str(root / "zero"), "BASE": str(root / "base")}
    assert main(["export", str(tmp_path / "m"), *[subst.get(a, a) for a in argv]]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
