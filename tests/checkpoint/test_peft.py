"""LoRA adapters in PEFT's layout (k3jax/checkpoint/peft.py): save → load round trips in the state's layout (stacked
groups included), the exact PEFT key names, PEFT's delta lora_B @ lora_A * alpha / r equal to the name map's HF form
of the leaf delta, and bad adapters refused naming the file and the field or tensor. No forward pass: fast."""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SIDECAR, load_adapter, save_adapter
from k3jax.config import LORA_TARGETS, LoRAConfig, default_run, get_preset
from k3jax.errors import InputError
from k3jax.layers.lora import is_adapter
from k3jax.model import abstract_params, layout
from k3jax.ops.lora import lora_weight
from k3jax.pytree import key_names

TINY = get_preset("k3-tiny")  # 5 layers, none stacked
STACKED = get_preset("k3-tiny", num_layers=13, full_attn_layers=(4, 8, 12, 13))  # layers 4-11: 2 stacked groups
P = "base_model.model.language_model.model.layers."


def _run(cfg, targets=LORA_TARGETS, **kw):
    return default_run(cfg, **kw).replace(lora=LoRAConfig(rank=4, alpha=8.0, targets=targets))


def _adapter(cfg, run, seed=0):
    """Random adapter leaves (B nonzero) as a params-shaped dict, from the abstract tree (no init)."""
    rng = np.random.default_rng(seed)
    flat = jax.tree_util.tree_flatten_with_path(abstract_params(cfg, run))[0]
    tree: dict = {}
    for path, s in flat:
        names = key_names(path)
        if is_adapter(names[-1]):
            node = tree
            for k in names[:-1]:
                node = node.setdefault(k, {})
            node[names[-1]] = rng.standard_normal(s.shape).astype(s.dtype)
    return tree


def _flat(tree):
    return {key_names(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A k3-tiny adapter on every target group, saved once."""
    run = _run(TINY)
    leaves = _adapter(TINY, run)
    d = tmp_path_factory.mktemp("peft") / "a"
    save_adapter(leaves, TINY, run, d, base="k3-tiny")
    return str(d), leaves


@pytest.mark.parametrize("cfg, stack, targets, dtype", [
    (TINY, "loop", LORA_TARGETS, "float32"),
    (STACKED, "loop", ("attn", "experts"), "float32"),
    (STACKED, "scan", ("shared", "dense"), "bfloat16"),
], ids=["tiny-loop-all", "stacked-loop-attn+experts", "stacked-scan-shared+dense-bf16"])
def test_save_load_round_trip(tmp_path, cfg, stack, targets, dtype):
    run = _run(cfg, targets, layer_stack=stack, param_dtype=dtype)
    leaves = _adapter(cfg, run)
    save_adapter(leaves, cfg, run, tmp_path / "a")
    lora, got = load_adapter(tmp_path / "a", cfg, run.replace(lora=None))
    assert lora == run.lora
    want = {key_names(p): s for p, s in jax.tree_util.tree_flatten_with_path(abstract_params(cfg, run))[0]
            if is_adapter(key_names(p)[-1])}
    got, leaves = _flat(got), _flat(leaves)
    assert got.keys() == want.keys() == leaves.keys()
    for k, v in got.items():
        assert v.shape == want[k].shape and v.dtype == want[k].dtype, k
        np.testing.assert_array_equal(v, leaves[k], err_msg=str(k))
    if cfg is STACKED:
        assert layout(cfg).groups == 2 and any(k[0] == "groups" for k in got)


def test_key_names_config_and_stacked_rows(tmp_path, saved):
    path, leaves = saved
    t = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    a, b = t[P + "0.self_attn.q_proj.lora_A.weight"], t[P + "0.self_attn.q_proj.lora_B.weight"]
    np.testing.assert_array_equal(a, leaves["pre"][0]["kda"]["wq_lora_a"].T)                # [r, D]
    np.testing.assert_array_equal(b, leaves["pre"][0]["kda"]["wq_lora_b"].reshape(4, -1).T)  # [N*K, r]
    ex = leaves["pre"][1]["moe"]["experts"]
    np.testing.assert_array_equal(t[P + "1.block_sparse_moe.experts.3.w1.lora_A.weight"], ex["w1_lora_a"][3].T)
    np.testing.assert_array_equal(t[P + "1.block_sparse_moe.experts.3.w1.lora_B.weight"], ex["w1_lora_b"][3].T)
    sh = leaves["pre"][2]["moe"]["shared"]
    np.testing.assert_array_equal(t[P + "2.block_sparse_moe.shared_experts.gate_proj.lora_B.weight"],
                                  sh["w_gate_lora_b"].T)
    assert t[P + "4.self_attn.kv_b_proj.lora_A.weight"].shape == (4, TINY.kv_lora_rank)
    conf = json.load(open(os.path.join(path, ADAPTER_CONFIG)))
    assert (conf["peft_type"], conf["r"], conf["lora_alpha"], conf["base_model_name_or_path"]) == ("LORA", 4, 8,
                                                                                                    "k3-tiny")
    assert not conf["use_rslora"] and not conf["fan_in_fan_out"] and conf["lora_dropout"] == 0.0
    mods = conf["target_modules"]
    assert mods == sorted(mods) and len(t) == 2 * len(mods)
    assert {k.rsplit(".lora_", 1)[0][len("base_model.model."):] for k in t} == set(mods)
    # a stacked layer: layer 9 is group 1, position 1 of the period
    run = _run(STACKED, ("attn",))
    lv = _adapter(STACKED, run)
    save_adapter(lv, STACKED, run, tmp_path / "s")
    t = load_file(tmp_path / "s" / ADAPTER_WEIGHTS)
    np.testing.assert_array_equal(t[P + "9.self_attn.q_proj.lora_A.weight"],
                                  lv["groups"]["layers"][1]["kda"]["wq_lora_a"][1].T)


@pytest.mark.parametrize("name, leaf", [
    ("0.self_attn.q_proj", ("pre", 0, "kda", "wq")),            # [D, N, K], in_axes 1
    ("2.self_attn.o_proj", ("pre", 2, "kda", "wo")),            # [N, K, D], in_axes 2
    ("4.self_attn.kv_b_proj", ("pre", 4, "mla", "kv_b")),       # [R, N, H]
    ("3.block_sparse_moe.experts.5.w2", ("pre", 3, "moe", "experts", "w2")),
])
def test_peft_delta_is_the_hf_form_of_the_leaf_delta(saved, name, leaf):
    """PEFT's lora_B @ lora_A * (lora_alpha / r) == leaf_to_hf(scale · A B) for the base tensor of that module."""
    path, leaves = saved
    t = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    d = leaves
    for k in leaf[:-1]:
        d = d[k]
    a, b = d[leaf[-1] + "_lora_a"], d[leaf[-1] + "_lora_b"]
    lead = 1 if "experts" in leaf else 0                        # W [E, in, out]: A [E, in, r], B [E, r, out]
    shape = (*a.shape[:-1], *b.shape[1 + lead:])
    delta = np.asarray(lora_weight(np.zeros(shape, np.float32), a, b, 8.0 / 4))
    specs = {s.name: s for s in nm.hf_tensors(TINY, expert_format="bf16")}
    spec = specs[f"language_model.model.layers.{name}.weight"]._replace(dtype="F32")  # the delta, not the bf16 file
    want = nm.leaf_to_hf(delta, spec)
    got = t[f"base_model.model.language_model.model.layers.{name}.lora_B.weight"] @ \
        t[f"base_model.model.language_model.model.layers.{name}.lora_A.weight"] * (8.0 / 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_peft_written_keys_and_metadata_load(tmp_path, saved):
    """A file as PEFT / the safetensors library writes it (``__metadata__`` {"format": "pt"}, no sidecar) and the
    adapter-name variant of the keys (``lora_A.default.weight``) load to the same leaves."""
    path, leaves = saved
    d = tmp_path / "peft"
    shutil.copytree(path, d)
    os.remove(d / SIDECAR)
    t = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    save_file({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v.astype(
        ml_dtypes.bfloat16).astype(np.float32) for k, v in t.items()}, d / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    lora, got = load_adapter(d, TINY, default_run(TINY))
    assert lora == LoRAConfig(rank=4, alpha=8.0, targets=LORA_TARGETS)
    got, want = _flat(got), _flat(leaves)
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], want[k].astype(ml_dtypes.bfloat16).astype(np.float32))


def _edit_tensors(d, fn):
    t = load_file(d / ADAPTER_WEIGHTS)
    fn(t)
    save_file(t, d / ADAPTER_WEIGHTS)


def _edit_json(d, name, fn):
    c = json.loads((d / name).read_text())
    fn(c)
    (d / name).write_text(json.dumps(c))


Q = P + "0.self_attn.q_proj"
BAD = {
    "wrong-shape": (lambda d: _edit_tensors(d, lambda t: t.update({Q + ".lora_A.weight": np.zeros((4, 63),
                                                                                                   np.float32)})),
                    ADAPTER_WEIGHTS, f"tensor '{Q}.lora_A.weight': shape [4, 63]"),
    "unknown-module": (lambda d: _edit_tensors(d, lambda t: t.update({P + "0.self_attn.foo.lora_A.weight": np.zeros(
        (4, 64), np.float32), P + "0.self_attn.foo.lora_B.weight": np.zeros((64, 4), np.float32)})),
        ADAPTER_WEIGHTS, "module 'language_model.model.layers.0.self_attn.foo' is not a module of this base"),
    "other-peft-key": (lambda d: _edit_tensors(d, lambda t: t.update({Q + ".lora_magnitude_vector": np.zeros(
        64, np.float32)})), ADAPTER_WEIGHTS, "lora_magnitude_vector': not a LoRA factor"),
    "missing-b": (lambda d: _edit_tensors(d, lambda t: t.pop(Q + ".lora_B.weight")), ADAPTER_WEIGHTS,
                  "module 'language_model.model.layers.0.self_attn.q_proj' has no lora_B"),
    "partial-group": (lambda d: _edit_tensors(d, lambda t: [t.pop(k) for k in list(t) if ".layers.1.self_attn.k_proj"
                                                            in k]), ADAPTER_WEIGHTS,
                      "target group 'attn' is only partly covered: module "
                      "'language_model.model.layers.1.self_attn.k_proj' has no factors"),
    "missing-field": (lambda d: _edit_json(d, ADAPTER_CONFIG, lambda c: c.pop("lora_alpha")), ADAPTER_CONFIG,
                      "field 'lora_alpha': missing"),
    "rslora": (lambda d: _edit_json(d, ADAPTER_CONFIG, lambda c: c.update(use_rslora=True)), ADAPTER_CONFIG,
               "field 'use_rslora': rank-stabilized scaling"),
    "fan-in-fan-out": (lambda d: _edit_json(d, ADAPTER_CONFIG, lambda c: c.update(fan_in_fan_out=True)),
                       ADAPTER_CONFIG, "field 'fan_in_fan_out'"),
    "ia3": (lambda d: _edit_json(d, ADAPTER_CONFIG, lambda c: c.update(peft_type="IA3")), ADAPTER_CONFIG,
            "field 'peft_type': only LORA adapters"),
    "other-base": (lambda d: _edit_json(d, SIDECAR, lambda c: c["architecture"].update(rms_norm_eps=1e-6,
                                                                                         situ_beta=2.0)),
                   SIDECAR, "made for another base: the architecture differs in rms_norm_eps, situ_beta"),
    "sidecar-rank": (lambda d: _edit_json(d, SIDECAR, lambda c: c["lora"].update(alpha=16.0)), SIDECAR,
                     "field 'lora.alpha' is 16.0"),
    "dropout-1.5": (lambda d: _edit_json(d, ADAPTER_CONFIG, lambda c: c.update(lora_dropout=1.5)), ADAPTER_CONFIG,
                    "field 'lora_dropout': must be a probability in [0, 1) (got 1.5)"),
    "dropout-nan": (lambda d: _edit_json(d, ADAPTER_CONFIG, lambda c: c.update(lora_dropout=float("nan"))),
                    ADAPTER_CONFIG, "field 'lora_dropout': must be a probability in [0, 1) (got nan)"),
    "sidecar-dropout": (lambda d: _edit_json(d, SIDECAR, lambda c: c["lora"].update(dropout=1.0)), SIDECAR,
                        "field 'lora.dropout' is 1.0"),
    "pickle-only": (lambda d: (os.remove(d / ADAPTER_WEIGHTS), (d / "adapter_model.bin").write_bytes(b"x")), "",
                    "only pickle-based weights (adapter_model.bin); k3jax never unpickles"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_adapter_is_an_input_error_naming_file_and_field(tmp_path, saved, kind):
    make, fname, words = BAD[kind]
    d = tmp_path / "bad"
    shutil.copytree(saved[0], d)
    make(d)
    with pytest.raises(InputError) as e:
        load_adapter(d, TINY, default_run(TINY))
    assert str(e.value).startswith(str(d / fname) if fname else str(d)), str(e.value)
    assert words in str(e.value), str(e.value)


def test_save_refuses_leaves_outside_the_targets_and_an_existing_dir(tmp_path, saved):
    leaves = _adapter(TINY, _run(TINY))
    with pytest.raises(InputError, match="does not cover"):
        save_adapter(leaves, TINY, _run(TINY, ("attn",)), tmp_path / "x")
    with pytest.raises(InputError, match="exists and is not empty"):
        save_adapter(leaves, TINY, _run(TINY), saved[0])
    assert sorted(os.listdir(tmp_path)) == []  # nothing half-written


def test_training_dropout_does_not_block_loading(tmp_path, saved):
    """lora_dropout acts only while training: an adapter trained with it (PEFT's common 0.05) applies unchanged,
    its value recorded in the LoRAConfig (k3jax's sidecar, when there is one, holds the trained value)."""
    d = tmp_path / "dropout"
    shutil.copytree(saved[0], d)
    _edit_json(d, ADAPTER_CONFIG, lambda c: c.update(lora_dropout=0.05))
    lora, leaves = load_adapter(d, TINY, default_run(TINY))
    _, want = load_adapter(saved[0], TINY, default_run(TINY))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(leaves), jax.tree.leaves(want), strict=True))
    assert lora.dropout == 0.0                                          # the sidecar's (k3jax trained it at 0)
    os.remove(d / SIDECAR)                                              # an adapter PEFT wrote: its config's value
    assert load_adapter(d, TINY, default_run(TINY))[0].dropout == 0.05


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_export_writes_the_trained_dropout_and_loads_it_back(tmp_path, layout):
    """adapter_config's lora_dropout is the run's, except 0 beside fused routed experts (PEFT's ParamWrapper refuses
    any other: the inference math is the same); the sidecar keeps the trained value and loading returns it."""
    run = default_run(TINY).replace(lora=LoRAConfig(rank=4, alpha=8.0, targets=("attn", "experts"), dropout=0.1,
                                                    peft_experts=layout))
    save_adapter(_adapter(TINY, run), TINY, run, tmp_path / "a")
    conf = json.load(open(tmp_path / "a" / ADAPTER_CONFIG))
    assert conf["lora_dropout"] == (0.1 if layout == "per-expert" else 0.0)
    assert bool(conf.get("target_parameters")) == (layout == "fused")
    assert json.load(open(tmp_path / "a" / SIDECAR))["lora"]["dropout"] == 0.1
    lora, _ = load_adapter(tmp_path / "a", TINY, default_run(TINY))
    assert lora == run.lora and lora.dropout == 0.1


def test_kimi_linear_names_transformers_modules_and_reads_both_spellings(tmp_path):
    """On the Kimi-Linear layout a shared expert is transformers' ``mlp.shared_experts.*`` (KimiLinear's conversion
    mapping renames the checkpoint's ``block_sparse_moe.``; PEFT over it loads these names: test_peft_oracle.py);
    routed experts in the per-expert layout keep the checkpoint's ``block_sparse_moe.experts.{e}.w*`` (the default
    "auto" writes them fused on this layout: test_peft_experts.py). The checkpoint spelling loads to the same leaves;
    both spellings of one module are refused."""
    cfg = get_preset("kimi-linear-tiny")
    run = _run(cfg)
    run = run.replace(lora=run.lora.replace(peft_experts="per-expert"))
    leaves = _adapter(cfg, run)
    save_adapter(leaves, cfg, run, tmp_path / "a")
    t = load_file(tmp_path / "a" / ADAPTER_WEIGHTS)
    mods = json.load(open(tmp_path / "a" / ADAPTER_CONFIG))["target_modules"]
    assert "model.layers.1.mlp.shared_experts.gate_proj" in mods and "model.layers.0.mlp.up_proj" in mods
    assert "model.layers.1.block_sparse_moe.experts.3.w2" in mods
    assert not any("block_sparse_moe.shared" in m or ".mlp.experts." in m for m in mods)
    d = tmp_path / "ckpt-names"
    shutil.copytree(tmp_path / "a", d)
    save_file({k.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts."): v for k, v in t.items()},
              d / ADAPTER_WEIGHTS)
    _, got = load_adapter(d, cfg, default_run(cfg))
    got, want = _flat(got), _flat(leaves)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    k = "base_model.model.model.layers.1.mlp.shared_experts.up_proj.lora_A.weight"
    save_file({**t, k.replace(".mlp.", ".block_sparse_moe."): t[k]}, d / ADAPTER_WEIGHTS)
    with pytest.raises(InputError, match="module 'model.layers.1.mlp.shared_experts.up_proj' is given twice"):
        load_adapter(d, cfg, default_run(cfg))


def test_a_relative_adapter_path_loads(tmp_path, saved, monkeypatch):
    """`k3 logits --adapter runs/a` from the repo root: the reader must not join the directory twice."""
    shutil.copytree(saved[0], tmp_path / "rel")
    monkeypatch.chdir(tmp_path)
    _, leaves = load_adapter("rel", TINY, default_run(TINY))
    _, want = load_adapter(saved[0], TINY, default_run(TINY))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(leaves), jax.tree.leaves(want), strict=True))
