"""Routed-expert LoRA in transformers 5's fused layout (k3jax/checkpoint/peft_experts.py): per-expert ↔ fused round
trips to equal leaves, PEFT's fused delta equal to k3jax's per-expert one, PEFT's plain rank-r gate_up_proj form,
and bad fused adapters refused naming the file and the field or tensor. No forward pass: fast (the logits against
PEFT: test_peft_oracle.py)."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_peft import _adapter, _flat  # the same seeded adapter leaves

from k3jax.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SIDECAR, experts_layout, load_adapter, save_adapter
from k3jax.config import LORA_TARGETS, LoRAConfig, default_run, get_preset
from k3jax.errors import InputError

KL = get_preset("kimi-linear-tiny")  # layer 0 dense, 1-7 MoE (8 experts, hidden 64, expert FFN 32)
STACKED_K3 = get_preset("k3-tiny", num_layers=13, full_attn_layers=(4, 8, 12, 13))
E = "base_model.model.model.layers.{l}.mlp.experts."


def _run(cfg, layout="fused", targets=LORA_TARGETS, **kw):
    return default_run(cfg, **kw).replace(lora=LoRAConfig(rank=4, alpha=8.0, targets=targets, peft_experts=layout))


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    run = _run(KL)
    leaves = _adapter(KL, run)
    d = tmp_path_factory.mktemp("fused") / "a"
    assert save_adapter(leaves, KL, run, d)["experts"] == "fused"
    return d, leaves


def _same(a, b):
    a, b = _flat(a), _flat(b)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


@pytest.mark.parametrize("cfg, stack", [(KL, "loop"), (STACKED_K3, "scan")], ids=["kimi-linear", "k3-stacked-scan"])
def test_per_expert_and_fused_round_trip_to_equal_leaves(tmp_path, cfg, stack):
    """save fused → load → save per-expert → load (and back) give the leaves that were saved, bit for bit."""
    run = _run(cfg, layer_stack=stack)
    leaves = _adapter(cfg, run)
    save_adapter(leaves, cfg, run, tmp_path / "f")
    lora, got = load_adapter(tmp_path / "f", cfg, run.replace(lora=None))
    assert lora == run.lora and lora.peft_experts == "fused"
    _same(got, leaves)
    save_adapter(got, cfg, run.replace(lora=lora.replace(peft_experts="per-expert")), tmp_path / "p")
    lora, again = load_adapter(tmp_path / "p", cfg, run.replace(lora=None))
    assert lora.peft_experts == "per-expert"
    _same(again, leaves)
    save_adapter(again, cfg, run, tmp_path / "f2")
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        assert (tmp_path / "f" / name).read_bytes() == (tmp_path / "f2" / name).read_bytes()


def test_auto_layout_is_fused_on_kimi_linear_only():
    assert experts_layout(LoRAConfig(), KL) == "fused"
    assert experts_layout(LoRAConfig(), get_preset("k3-tiny")) == "per-expert"
    assert experts_layout(LoRAConfig(peft_experts="per-expert"), KL) == "per-expert"
    assert experts_layout(LoRAConfig(peft_experts="fused"), get_preset("k3-tiny")) == "fused"


def test_fused_tensors_are_peft_param_wrapper_factors(fused):
    """PEFT's ParamWrapper delta (``einsum("o r e, e r i -> e o i", B.reshape(out, r, E), A.reshape(E, r, in))``
    · alpha_g / r_g) equals k3jax's per-expert scale · (A B)ᵀ, gate rows (w1) first, then up (w3); down_proj = w2."""
    d, leaves = fused
    t = load_file(d / ADAPTER_WEIGHTS)
    conf = json.loads((d / ADAPTER_CONFIG).read_text())
    assert conf["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert conf["rank_pattern"] == {"mlp.experts.gate_up_proj": 8}
    assert conf["alpha_pattern"] == {"mlp.experts.gate_up_proj": 16}
    assert not any(".experts." in m for m in conf["target_modules"])
    ex = leaves["pre"][2]["moe"]["experts"]

    def delta(key, r_g, alpha_g):
        a, b = t[E.format(l=2) + key + "lora_A.weight"], t[E.format(l=2) + key + "lora_B.weight"]
        return np.einsum("ore,eri->eoi", b.reshape(b.shape[0], r_g, 8), a.reshape(8, r_g, -1)) * alpha_g / r_g

    def k3(name):
        return np.einsum("eir,ero->eoi", ex[f"{name}_lora_a"], ex[f"{name}_lora_b"]) * 2.0

    np.testing.assert_allclose(delta("base_layer.", 8, 16), np.concatenate([k3("w1"), k3("w3")], 1), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(delta("", 4, 8), k3("w2"), rtol=1e-5, atol=1e-6)


def test_peft_plain_rank_r_gate_up_loads_with_one_a_for_gate_and_up(tmp_path, fused):
    """A PEFT user's rank-r gate_up_proj (no rank_pattern: one A_e for the gate and up rows) is k3jax's w1 and w3
    with A1 = A3 and B1 / B3 the two halves of B."""
    d = tmp_path / "plain"
    shutil.copytree(fused[0], d)
    t = load_file(d / ADAPTER_WEIGHTS)
    rng = np.random.default_rng(3)
    for l in range(1, 8):
        k = E.format(l=l) + "base_layer."
        t[k + "lora_A.weight"] = rng.standard_normal((4 * 8, 64)).astype(np.float32)
        t[k + "lora_B.weight"] = rng.standard_normal((64, 4 * 8)).astype(np.float32)
    save_file(t, d / ADAPTER_WEIGHTS)
    _edit(d, ADAPTER_CONFIG, lambda c: c.update(rank_pattern={}, alpha_pattern={}))
    _, got = load_adapter(d, KL, default_run(KL))
    ex = got["pre"][3]["moe"]["experts"]
    a, b = t[E.format(l=3) + "base_layer.lora_A.weight"], t[E.format(l=3) + "base_layer.lora_B.weight"]
    np.testing.assert_array_equal(ex["w1_lora_a"], ex["w3_lora_a"])
    np.testing.assert_array_equal(ex["w1_lora_a"][5], a[5 * 4:6 * 4].T)
    np.testing.assert_array_equal(ex["w3_lora_b"][5], b[32:, 5::8].T)   # column k·E + e
    np.testing.assert_array_equal(ex["w1_lora_b"][5], b[:32, 5::8].T)


def _edit(d, name, fn):
    c = json.loads((d / name).read_text())
    fn(c)
    (d / name).write_text(json.dumps(c))


def _tensors(d, fn):
    t = load_file(d / ADAPTER_WEIGHTS)
    fn(t)
    save_file(t, d / ADAPTER_WEIGHTS)


GU = E.format(l=1) + "base_layer.lora_B.weight"
BAD = {
    "wrong-shape": (lambda d: _tensors(d, lambda t: t.update({GU: np.zeros((64, 63), np.float32)})),
                    ADAPTER_WEIGHTS, f"tensor '{GU}': shape [64, 63]"),
    "unknown-parameter": (lambda d: _edit(d, ADAPTER_CONFIG, lambda c: c["target_parameters"].append(
        "mlp.experts.up_proj")), ADAPTER_CONFIG, "'mlp.experts.up_proj' is no routed-expert parameter of this base"),
    "both-layouts": (lambda d: _tensors(d, lambda t: t.update({
        "base_model.model.model.layers.2.block_sparse_moe.experts.3.w1.lora_A.weight": np.zeros((4, 64), np.float32),
        "base_model.model.model.layers.2.block_sparse_moe.experts.3.w1.lora_B.weight": np.zeros((32, 4), np.float32)
    })), ADAPTER_WEIGHTS, "given twice: as target_parameters (fused) and as per-expert module "
                          "'model.layers.2.block_sparse_moe.experts.3.w1'"),
    "not-block-diagonal": (lambda d: _tensors(d, lambda t: t.update({GU: t[GU] + 1e-3})), ADAPTER_WEIGHTS,
                           f"tensor '{GU}': model.layers.1.mlp.experts.gate_up_proj has rank 8 = 2r but its lora_B "
                           "is not block-diagonal"),
    "only-gate-up": (lambda d: (_edit(d, ADAPTER_CONFIG, lambda c: c.update(target_parameters=[
        "mlp.experts.gate_up_proj"])), _tensors(d, lambda t: [t.pop(k) for k in list(t) if ".experts.lora_" in k])),
        ADAPTER_WEIGHTS, "not a factor of the fused parameters"),
    "down-missing": (lambda d: _edit(d, ADAPTER_CONFIG, lambda c: c.update(target_parameters=[
        "mlp.experts.gate_up_proj"])), ADAPTER_WEIGHTS, "not a factor of the fused parameters"),
    "no-target-parameters": (lambda d: _edit(d, ADAPTER_CONFIG, lambda c: (c.pop("target_parameters"), c.update(
        rank_pattern={}, alpha_pattern={}))), ADAPTER_WEIGHTS, "holds fused expert factors, but field "
                                                               "'target_parameters'"),
    "pattern-on-a-module": (lambda d: _edit(d, ADAPTER_CONFIG, lambda c: c["rank_pattern"].update(q_proj=8)),
                            ADAPTER_CONFIG, "key 'q_proj' applies to 'model.layers.0.self_attn.q_proj'"),
    "other-scale": (lambda d: _edit(d, ADAPTER_CONFIG, lambda c: c.update(alpha_pattern={
        "mlp.experts.gate_up_proj": 8})), ADAPTER_CONFIG, "model.layers.1.mlp.experts.gate_up_proj has rank 8, "
                                                          "lora_alpha 8"),
    "down-pattern": (lambda d: _edit(d, ADAPTER_CONFIG, lambda c: c["rank_pattern"].update(
        {"mlp.experts.down_proj": 8})), ADAPTER_CONFIG,
        "key 'mlp.experts.down_proj' applies to 'model.layers.1.mlp.experts.down_proj'"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_fused_adapter_is_an_input_error_naming_file_and_tensor(tmp_path, fused, kind):
    make, fname, words = BAD[kind]
    d = tmp_path / "bad"
    shutil.copytree(fused[0], d)
    make(d)
    with pytest.raises(InputError) as e:
        load_adapter(d, KL, default_run(KL))
    assert str(e.value).startswith(str(d / fname)), str(e.value)
    assert words in str(e.value), str(e.value)


def test_sidecar_still_checks_the_fused_adapter(tmp_path, fused):
    d = tmp_path / "side"
    shutil.copytree(fused[0], d)
    _edit(d, SIDECAR, lambda c: c["lora"].update(targets=["attn"]))
    with pytest.raises(InputError, match="field 'lora.targets'"):
        load_adapter(d, KL, default_run(KL))


def _shared_run(cfg, layout, **kw):
    run = _run(cfg, layout, **kw)
    return run.replace(lora=run.lora.replace(experts_shared_a=True))


def _tiled(leaves):
    """The per-expert leaves a shared-A adapter stands for: each routed stack's A [..., in, r] copied to every
    expert ([..., E, in, r], E from its B)."""
    def walk(node, routed):
        out = {}
        for k, v in node.items():
            if isinstance(v, dict):
                out[k] = walk(v, k == "experts")
            elif isinstance(v, list):
                out[k] = [walk(x, False) for x in v]
            elif routed and k.endswith("_lora_a"):
                b = node[k[:-1] + "b"]
                out[k] = np.broadcast_to(v[..., None, :, :], (*b.shape[:-2], *v.shape[-2:])).copy()
            else:
                out[k] = v
        return out

    return walk(leaves, False)


@pytest.mark.parametrize("cfg, stack, layout", [(KL, "loop", "fused"), (STACKED_K3, "scan", "per-expert")],
                         ids=["kimi-linear-fused", "k3-stacked-scan-per-expert"])
def test_shared_a_exports_per_expert_and_reloads_factorised(tmp_path, cfg, stack, layout):
    """A shared-A adapter is written as PEFT's per-expert (or fused) factors with A copied to every expert — the same
    files as the per-expert adapter with A tiled, but the sidecar's flag — and k3jax reloads it factorised, leaves
    bit for bit; without the sidecar the same files load per expert (A tiled), as PEFT reads them."""
    run = _shared_run(cfg, layout, layer_stack=stack)
    leaves = _adapter(cfg, run)
    ex = leaves["pre"][2]["moe"]["experts"] if stack == "loop" else leaves["groups"]["layers"][0]["moe"]["experts"]
    assert ex["w1_lora_a"].shape[:-2] == ex["w1_lora_b"].shape[:-3]             # a shared A (a stack's: [G, in, r])
    save_adapter(leaves, cfg, run, tmp_path / "s")
    assert json.loads((tmp_path / "s" / SIDECAR).read_text())["lora"]["experts_shared_a"] is True
    lora, got = load_adapter(tmp_path / "s", cfg, run.replace(lora=None))
    assert lora == run.lora and lora.experts_shared_a
    _same(got, leaves)
    per_run = _run(cfg, layout, layer_stack=stack)
    save_adapter(_tiled(leaves), cfg, per_run, tmp_path / "t")
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        assert (tmp_path / "s" / name).read_bytes() == (tmp_path / "t" / name).read_bytes()
    (tmp_path / "s" / SIDECAR).unlink()
    lora, got = load_adapter(tmp_path / "s", cfg, run.replace(lora=None))
    assert lora == per_run.lora and not lora.experts_shared_a
    _same(got, _tiled(leaves))


@pytest.mark.parametrize("cfg, stack, layout", [(KL, "loop", "per-expert"), (KL, "loop", "fused"),
                                                 (STACKED_K3, "scan", "per-expert")],
                         ids=["per-expert", "fused", "k3-stacked-group"])
def test_shared_a_sidecar_with_unequal_experts_names_the_tensor(tmp_path, cfg, stack, layout):
    """A sidecar that says experts_shared_a over files whose experts' A differ (here expert 3's, of one layer's w1 —
    on k3-tiny layer 9, inside the scanned group: edited after the export) is refused, naming the weights file and
    the tensor."""
    run = _shared_run(cfg, layout, layer_stack=stack)
    d = tmp_path / "a"
    save_adapter(_adapter(cfg, run), cfg, run, d)
    t = load_file(d / ADAPTER_WEIGHTS)
    if layout == "fused":
        name = E.format(l=2) + "base_layer.lora_A.weight"            # gate_up_proj: [E·2r, D], rows e·2r + k
        t[name][3 * 8] += 1.0
    elif cfg is KL:
        name = "base_model.model.model.layers.2.block_sparse_moe.experts.3.w1.lora_A.weight"
        t[name][0, 0] += 1.0
    else:
        name = "base_model.model.language_model.model.layers.9.block_sparse_moe.experts.3.w1.lora_A.weight"
        t[name][0, 0] += 1.0
    save_file(t, d / ADAPTER_WEIGHTS)
    with pytest.raises(InputError, match="expert 3's differs") as err:
        load_adapter(d, cfg, default_run(cfg, layer_stack=stack))
    assert name in str(err.value) and ADAPTER_WEIGHTS in str(err.value)
