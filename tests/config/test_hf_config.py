"""The HF config key table: used / known-irrelevant / unknown keys, unsupported math, parse == emit."""

import copy
import json
import os
import warnings

import pytest

from k3jax.config import PRESETS, ConfigError, UnknownConfigKeysWarning, architecture, from_hf, get_preset, to_hf_dict
from k3jax.config.hf import classify_keys
from k3jax.config.hf_keys import DERIVED_NAMES, KEYS

HERE = os.path.dirname(__file__)
PRESET_DIR = os.path.join(HERE, "..", "..", "k3jax", "presets")


def official():
    with open(os.path.join(PRESET_DIR, "kimi-k3.config.json")) as f:
        return json.load(f)


def kimi_linear():
    with open(os.path.join(PRESET_DIR, "kimi-linear-48b.config.json")) as f:
        return json.load(f)


def parse_quietly(raw, **kw):
    """from_hf that fails the test on any warning (known keys must be accepted silently)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return from_hf(raw, **kw)


def test_release_configs_have_no_unknown_or_ignored_keys():
    for raw, where in ((official(), "text_config."), (kimi_linear(), "")):
        tc = raw.get("text_config", raw)
        assert classify_keys(raw, tc, where) == ([], [])
        parse_quietly(raw, strict=True)


def test_known_irrelevant_keys_are_accepted_silently_and_reported():
    raw = official()
    raw["text_config"].update(model_max_length=1048576, rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                              rope_theta=50000.0, rope_scaling=None, use_cache=False, transformers_version="5.0.0")
    raw["transformers_version"] = "5.0.0"
    report = {}
    c = parse_quietly(raw, strict=True, report=report)
    assert architecture(c) == architecture(get_preset("kimi-k3"))
    assert report == {"unknown_keys": [], "ignored_keys": ["text_config.model_max_length",
                      "text_config.rope_parameters", "text_config.rope_theta", "text_config.rope_scaling"],
                      "derived_keys": [], "transformers_form": {}}


def test_unknown_keys_warn_once_listing_every_path():
    raw = official()
    raw["text_config"]["mystery_knob"] = 1
    raw["text_config"]["linear_attn_config"]["extra_gate"] = True
    raw["writer_note"] = "x"
    report = {}
    with pytest.warns(UnknownConfigKeysWarning) as rec:
        c = from_hf(raw, report=report)
    assert len(rec) == 1
    msg = str(rec[0].message)
    for k in ("writer_note", "text_config.mystery_knob", "text_config.linear_attn_config.extra_gate"):
        assert k in msg and k in report["unknown_keys"]
    assert architecture(c) == architecture(get_preset("kimi-k3"))


def test_strict_makes_unknown_keys_errors_naming_them():
    raw = official()
    raw["text_config"]["mystery_knob"] = 1
    with pytest.raises(ConfigError, match=r"unknown field\(s\) text_config\.mystery_knob"):
        from_hf(raw, strict=True)


@pytest.mark.parametrize("mutate,words", [
    (lambda t: t.update(mla_use_nope=False, rope_theta=1e4), ["mla_use_nope", "False"]),
    (lambda t: t.pop("mla_use_nope"), ["mla_use_nope", "NoPE"]),  # transformers' default is False: RoPE applied
    (lambda t: t.update(moe_router_activation_func="softmax"), ["moe_router_activation_func", "'softmax'"]),
    (lambda t: t.update(hidden_act="gelu"), ["hidden_act", "'gelu'"]),
    (lambda t: t.update(topk_method="greedy"), ["topk_method", "'greedy'"]),
    (lambda t: t.update(topk_group=4), ["topk_group", "4"]),
    (lambda t: t.update(num_nextn_predict_layers=1), ["num_nextn_predict_layers", "MTP"]),
    (lambda t: t.update(moe_layer_freq=2), ["moe_layer_freq", "2"]),
    (lambda t: t["quantization_config"].update(format="nvfp4-pack-quantized"), ["quantization_config", "nvfp4"]),
    (lambda t: t["quantization_config"]["config_groups"]["group_0"].update(format="float-quantized"),
     ["config_groups.group_0.format", "float-quantized"]),
    (lambda t: t["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16),
     ["weights.group_size", "16"]),
    (lambda t: t.update(quantization_config={"quant_method": "fp8"}), ["quantization_config.format", "None"]),
    (lambda t: t.update(num_key_value_heads=8), ["num_key_value_heads", "8"]),
    (lambda t: t.update(first_k_dense_replace="1"), ["first_k_dense_replace", "'1'"]),
    (lambda t: t.update(tie_word_embeddings=1), ["tie_word_embeddings", "1"]),
    (lambda t: t.pop("activation_situ_beta"), ["activation_situ_beta", "situ"]),
    (lambda t: t["linear_attn_config"].update(head_dim=None), ["linear_attn_config.head_dim", "None"]),
])
def test_unsupported_math_is_an_error_naming_field_and_value(mutate, words):
    raw = official()
    mutate(raw["text_config"])
    with pytest.raises(ConfigError) as ei:
        from_hf(raw)
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_missing_quantization_config_means_bf16_experts():
    raw = official()
    del raw["text_config"]["quantization_config"]
    assert parse_quietly(raw).expert_format == "bf16"


def test_missing_keys_take_transformers_defaults():
    raw = kimi_linear()
    for k in ("first_k_dense_replace", "rms_norm_eps", "num_shared_experts", "moe_renormalize"):
        raw.pop(k)
    c = parse_quietly(raw)
    assert (c.first_k_dense_replace, c.rms_norm_eps, c.num_shared_experts, c.moe_renormalize) == (0, 1e-6, 0, True)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_emit_then_parse_is_the_identity_on_architectures(name, fmt):
    cfg = get_preset(name).replace(expert_format=fmt)
    qc = official()["text_config"]["quantization_config"]
    d = to_hf_dict(cfg, qc)
    tc = d.get("text_config", d)
    assert classify_keys(d, tc, "text_config." if tc is not d else "") == ([], [])  # emits only used keys
    # the release's form: linear_attn_config and first_k_dense_replace, none of transformers' derived keys
    assert "linear_attn_config" in tc and "first_k_dense_replace" in tc and not DERIVED_NAMES & set(tc)
    assert architecture(parse_quietly(copy.deepcopy(d), strict=True)) == architecture(cfg)


def test_every_table_row_with_a_field_names_a_config_field():
    fields = set(get_preset("k3-tiny").to_dict())
    assert all(k.field in fields for k in KEYS if k.field is not None)
    # every used config field of the architecture is filled by exactly one row (or derived: expert_format)
    filled = [k.field for k in KEYS if k.field is not None]
    assert len(filled) == len(set(filled))
    assert set(architecture(get_preset("k3-tiny"))) - set(filled) == {"expert_format"}


# ------------------------------------------------------------- transformers 5's derived keys (KimiLinearConfig)

GOLDEN_CONFIG = os.path.join(HERE, "..", "golden", "kimi_linear", "ckpt", "config.json")
DERIVED = ["layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
           "qk_head_dim"]


def with_transformers5_keys(tc: dict) -> dict:
    """``tc`` plus what transformers 5.23's ``KimiLinearConfig.__post_init__`` derives and ``save_pretrained``
    writes (transcribed from it, not from k3jax), and ``pretraining_tp``."""
    lac, L = tc["linear_attn_config"], tc["num_hidden_layers"]
    types = [None] * L
    for i in lac["full_attn_layers"]:
        types[i - 1] = "full_attention"
    for i in lac["kda_layers"]:
        types[i - 1] = "linear_attention"
    tc.update(layer_types=types,
              mlp_layer_types=["dense" if i < tc.get("first_k_dense_replace", 1) else "sparse" for i in range(L)],
              linear_head_dim=lac["head_dim"], linear_num_heads=lac["num_heads"],
              linear_conv_kernel_dim=lac["short_conv_kernel_size"],
              qk_head_dim=tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"], pretraining_tp=1)
    return tc


def test_transformers_written_config_parses_strictly_and_reports_its_derived_keys():
    report = {}
    c = parse_quietly(GOLDEN_CONFIG, strict=True, report=report)
    assert architecture(c) == architecture(get_preset("kimi-linear-tiny"))
    assert report == {"unknown_keys": [], "derived_keys": DERIVED, "transformers_form": {},
                      "ignored_keys": ["model_max_length", "output_router_logits", "pretraining_tp"]}


@pytest.mark.parametrize("family", ["kimi-linear-48b", "kimi-k3"])
def test_agreeing_derived_keys_are_accepted_and_reported(family):
    raw = kimi_linear() if family == "kimi-linear-48b" else official()
    tc, where = raw.get("text_config", raw), "text_config." if "text_config" in raw else ""
    with_transformers5_keys(tc)
    report = {}
    c = parse_quietly(raw, strict=True, report=report)
    assert architecture(c) == architecture(get_preset(family))
    assert report["derived_keys"] == [where + k for k in DERIVED]
    assert report["ignored_keys"] == [where + "pretraining_tp"] and report["unknown_keys"] == []


def test_derived_keys_accept_null_and_transformers_legacy_layer_type_spellings():
    raw = with_transformers5_keys(kimi_linear())
    raw["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in raw["layer_types"]]
    raw.update(mlp_layer_types=None, qk_head_dim=None)  # null: transformers derives them itself
    report = {}
    assert architecture(parse_quietly(raw, strict=True, report=report)) == architecture(get_preset("kimi-linear-48b"))
    assert "mlp_layer_types" not in report["derived_keys"] and "layer_types" in report["derived_keys"]


def _swap_first_mla(types):
    types[3], types[4] = types[4], types[3]  # 1-based layer 4 is MLA in the 48B schedule


@pytest.mark.parametrize("mutate,words", [
    (lambda t: _swap_first_mla(t["layer_types"]),
     ["'layer_types'", "linear_attn_config.full_attn_layers", "1-based layer 4", "'linear_attention' vs "
      "'full_attention'"]),
    (lambda t: t["layer_types"].pop(), ["'layer_types'", "26 entries for 27 layers"]),
    (lambda t: t["layer_types"].__setitem__(0, "sliding_attention"), ["'layer_types'", "'sliding_attention'"]),
    (lambda t: t["mlp_layer_types"].__setitem__(1, "dense"),
     ["'mlp_layer_types'", "first_k_dense_replace", "1-based layer 2: 'dense' vs 'sparse'"]),
    (lambda t: t["mlp_layer_types"].__setitem__(0, "sparse"), ["'mlp_layer_types'", "'sparse' vs 'dense'"]),
    (lambda t: t.update(linear_num_heads=16), ["'linear_num_heads'", "16", "linear_attn_config.num_heads", "32"]),
    (lambda t: t.update(linear_head_dim=64), ["'linear_head_dim'", "64", "linear_attn_config.head_dim", "128"]),
    (lambda t: t.update(linear_conv_kernel_dim=3),
     ["'linear_conv_kernel_dim'", "3", "linear_attn_config.short_conv_kernel_size", "4"]),
    (lambda t: t.update(qk_head_dim=128), ["'qk_head_dim'", "128", "qk_nope_head_dim + qk_rope_head_dim", "192"]),
    (lambda t: t.update(layer_types="linear_attention"), ["'layer_types'", "list of strings"]),
    (lambda t: t.update(qk_head_dim=192.0), ["'qk_head_dim'", "expected int"]),
], ids=["layer_types-swapped", "layer_types-short", "layer_types-unknown-kind", "mlp-dense-too-many",
        "mlp-moe-at-0", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "qk_head_dim",
        "layer_types-not-a-list", "qk_head_dim-float"])
def test_a_derived_key_that_disagrees_is_an_error_naming_it_and_both_values(mutate, words):
    raw = with_transformers5_keys(kimi_linear())
    mutate(raw)
    with pytest.raises(ConfigError) as ei:
        from_hf(raw)
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_derived_keys_check_the_file_not_the_overrides():
    raw = with_transformers5_keys(kimi_linear())
    c = parse_quietly(raw, strict=True, first_k_dense_replace=2)
    assert c.first_k_dense_replace == 2


def test_pretraining_tp_is_math_neutral_at_any_value():
    # transformers' KimiLinear never reads it (no use in modeling_kimi_linear.py, 5.23)
    raw = kimi_linear()
    raw["pretraining_tp"] = 4
    report = {}
    assert architecture(parse_quietly(raw, strict=True, report=report)) == architecture(get_preset("kimi-linear-48b"))
    assert report["ignored_keys"] == ["pretraining_tp"]


# ------------------------------------------ transformers' own form (a config transformers 5 built from its arguments)

TF_GOLDEN_CONFIG = os.path.join(HERE, "..", "golden", "kimi_linear_transformers_form", "ckpt", "config.json")
# used key -> the derived key k3jax reads in its place when the file lacks it
TRANSFORMERS_FORM = {
    "linear_attn_config.full_attn_layers": "layer_types", "linear_attn_config.num_heads": "linear_num_heads",
    "linear_attn_config.head_dim": "linear_head_dim",
    "linear_attn_config.short_conv_kernel_size": "linear_conv_kernel_dim", "first_k_dense_replace": "mlp_layer_types"}


def transformers_form(tc: dict) -> dict:
    """``tc`` as transformers 5's ``save_pretrained`` writes it when it built ``KimiLinearConfig`` from its own
    arguments: its derived keys, and of the rest only the keys that class serializes (the set its golden checkpoint's
    ``config.json`` has: no ``linear_attn_config``, ``first_k_dense_replace``, ``mla_use_nope``, ...;
    ``max_position_embeddings`` is written as ``model_max_length``)."""
    with open(TF_GOLDEN_CONFIG) as f:
        keys = set(json.load(f))
    with_transformers5_keys(tc)
    tc["model_max_length"] = tc.pop("max_position_embeddings", 1048576)
    return {k: v for k, v in tc.items() if k in keys}


@pytest.mark.parametrize("source", ["kimi-linear-48b file", "kimi-linear-tiny preset"])
def test_transformers_form_parses_to_the_release_forms_config_and_exports_the_release_form(source):
    release = kimi_linear() if source == "kimi-linear-48b file" else to_hf_dict(get_preset("kimi-linear-tiny"))
    tf = transformers_form(copy.deepcopy(release))
    assert not {"linear_attn_config", "first_k_dense_replace", "mla_use_nope"} & set(tf)
    report = {}
    got = parse_quietly(tf, strict=True, report=report)
    assert got == parse_quietly(release, strict=True)
    assert report["transformers_form"] == TRANSFORMERS_FORM and report["derived_keys"] == DERIVED
    assert report["unknown_keys"] == [] and sorted(report["ignored_keys"]) == ["model_max_length", "pretraining_tp"]
    out = to_hf_dict(got)  # export: the release's form
    assert out == to_hf_dict(parse_quietly(release)) and "linear_attn_config" in out and not DERIVED_NAMES & set(out)


def test_transformers_form_accepts_its_legacy_layer_type_spellings():
    tf = transformers_form(kimi_linear())
    tf["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in tf["layer_types"]]
    assert parse_quietly(tf, strict=True) == parse_quietly(kimi_linear())


def test_golden_transformers_written_config_parses_to_its_architecture():
    """The config.json transformers 5.25 wrote for a model it built itself (tests/golden/kimi_linear_transformers_form:
    MLA at 1-based 2 and 5, dense MLPs at 1 and 2, short conv 3)."""
    report = {}
    cfg = parse_quietly(TF_GOLDEN_CONFIG, strict=True, report=report)
    assert cfg == get_preset("kimi-linear-tiny").replace(
        name="hf-kimi_linear", vocab_size=256, hidden_size=32, num_layers=5, full_attn_layers=(2, 5), kda_head_dim=16,
        kda_conv_size=3, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=64,
        first_k_dense_replace=2, num_experts=4, moe_intermediate_size=16)
    assert report["transformers_form"] == TRANSFORMERS_FORM and report["unknown_keys"] == []
    lac = to_hf_dict(cfg)["linear_attn_config"]
    assert (lac["full_attn_layers"], lac["kda_layers"], lac["short_conv_kernel_size"]) == ([2, 5], [1, 3, 4], 3)


def test_a_derived_key_stands_in_for_a_used_key_the_file_lacks():
    # transformers takes linear_head_dim when linear_attn_config has no head_dim; so does k3jax
    raw = with_transformers5_keys(kimi_linear())
    raw["linear_attn_config"].pop("head_dim")
    raw["linear_head_dim"] = 64
    report = {}
    assert parse_quietly(raw, strict=True, report=report).kda_head_dim == 64
    assert report["transformers_form"] == {"linear_attn_config.head_dim": "linear_head_dim"}


@pytest.mark.parametrize("mutate,words", [
    # both forms present and disagreeing: an error naming both fields
    (lambda t: t.update(first_k_dense_replace=2),
     ["'mlp_layer_types'", "first_k_dense_replace", "1-based layer 2: 'sparse' vs 'dense'"]),
    (lambda t: t.update(linear_attn_config={"num_heads": 16}, mla_use_nope=True),
     ["'linear_num_heads'", "32", "linear_attn_config.num_heads", "16"]),
    (lambda t: t.update(linear_attn_config={"full_attn_layers": [4, 8]}, mla_use_nope=True),
     ["'layer_types'", "linear_attn_config.full_attn_layers", "1-based layer 12"]),
    # values k3jax does not implement: an error naming the derived key
    (lambda t: t["layer_types"].__setitem__(0, "sliding_attention"),
     ["'layer_types'", "1-based layer 1 is 'sliding_attention'", "'full_attention' and 'linear_attention'"]),
    (lambda t: t["layer_types"].pop(), ["'layer_types'", "26 entries for 27 layers"]),
    (lambda t: t["mlp_layer_types"].__setitem__(5, "dense"),
     ["'mlp_layer_types'", "1-based layer 6 is 'dense' after the MoE layer 2", "first_k_dense_replace"]),
    (lambda t: t["mlp_layer_types"].__setitem__(0, "moe"), ["'mlp_layer_types'", "1-based layer 1 is 'moe'"]),
    (lambda t: t.update(linear_num_heads="32"), ["'linear_num_heads'", "expected int", "'32'"]),
    (lambda t: t.update(mla_use_nope=False), ["'mla_use_nope'", "NoPE", "False"]),  # NoPE is the default only
    (lambda t: t.pop("layer_types"), ["'linear_attn_config.full_attn_layers'", "required", "layer_types"]),
], ids=["first_k_dense_replace-vs-mlp_layer_types", "num_heads-vs-linear_num_heads",
        "full_attn_layers-vs-layer_types", "sliding-layer", "layer_types-short", "dense-after-moe", "unknown-mlp-kind",
        "linear_num_heads-str", "rope", "no-layer-schedule"])
def test_transformers_form_errors_name_the_field(mutate, words):
    tf = transformers_form(kimi_linear())
    mutate(tf)
    with pytest.raises(ConfigError) as ei:
        from_hf(tf)
    for w in words:
        assert w in str(ei.value), str(ei.value)
