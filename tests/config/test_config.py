"""K3Config: the official config.json, Kimi-Linear, presets, and clear errors naming the field."""

import json
import os

import pytest

from k3jax.config import PRESETS, ConfigError, from_hf, get_preset
from k3jax.model import abstract_params, count_params

HERE = os.path.dirname(__file__)

OFFICIAL = os.path.join(HERE, "..", "..", "k3jax", "presets", "kimi-k3.config.json")


def n_params(cfg) -> int:
    """Total parameter count of the model's own tree (eval_shape: nothing allocated, fine at full size)."""
    return count_params(abstract_params(cfg))


def official():
    with open(OFFICIAL) as f:
        return json.load(f)


def test_official_config_parses_to_k3():
    c = from_hf(OFFICIAL)
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (7168, 93, 163840)
    assert c.mla_layers == tuple(range(3, 91, 4)) + (91, 92) and c.num_mla_layers == 24 and c.num_kda_layers == 69
    assert 0 in c.kda_layers and not c.is_mla(0) and c.is_mla(91) and c.is_mla(92)
    assert not c.is_moe(0) and all(c.is_moe(l) for l in range(1, 93))
    assert c.attn_res_boundaries == (0, 12, 24, 36, 48, 60, 72, 84)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.routed_expert_hidden_size, c.moe_intermediate_size, c.intermediate_size) == (3584, 3072, 33792)
    assert c.kda_gate_lower_bound == -5.0 and c.kda_full_rank_gate and c.mla_output_gate
    assert (c.situ_beta, c.situ_linear_beta) == (4.0, 25.0) and c.hidden_act == "situ"
    assert c.expert_format == "mxfp4" and c.mla_norm_eps == 1e-6 and c.rms_norm_eps == 1e-5
    assert n_params(c) == 2_779_484_476_000  # docs/checkpoint.md §12.1 (96 real A_log entries per layer)


def test_official_config_file_is_byte_exact_copy():
    shared = os.path.join(HERE, "..", "..", "..", "shared", "k3", "config.json")
    if not os.path.exists(shared):
        pytest.skip("../shared/k3 not present")
    with open(shared, "rb") as a, open(OFFICIAL, "rb") as b:
        assert a.read() == b.read()


def test_kimi_linear_preset():
    c = get_preset("kimi-linear-48b")
    assert c.kda_gate == "softplus" and not c.kda_full_rank_gate and c.q_lora_rank is None
    assert not c.mla_output_gate and c.hidden_act == "silu" and not c.uses_attn_res and not c.is_latent_moe
    assert c.mla_layers == (3, 7, 11, 15, 19, 23, 26) and c.routed_scaling_factor == 2.446
    assert abs(n_params(c) / 49.12e9 - 1) < 1e-3  # docs/model.md §13 sanity budget


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build(name):
    assert get_preset(name).name == name


def test_k3_mini_keeps_k3_structure():
    c = get_preset("k3-mini")
    assert 20e6 <= n_params(c) <= 60e6
    assert c.mla_layers[-2:] == (c.num_layers - 2, c.num_layers - 1)
    assert not c.is_moe(0) and c.routed_expert_hidden_size * 2 == c.hidden_size and c.num_shared_experts == 2
    assert c.num_experts >= 32 and c.num_experts_per_token / c.num_experts <= 1 / 8
    assert len(c.attn_res_boundaries) >= 3  # >= 2 full blocks plus the embedding


def test_unknown_preset_lists_known():
    with pytest.raises(ConfigError, match="known presets: .*k3-mini"):
        get_preset("k3-huge")


@pytest.mark.parametrize("mutate,field", [
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.update(num_experts_per_token=1000), "num_experts_per_token"),
    (lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 3]), "kda_layers"),
    (lambda t: t["linear_attn_config"].update(full_attn_layers=[4, 8, 200]), "full_attn_layers"),
    (lambda t: t.update(num_key_value_heads=8), "num_key_value_heads"),
    (lambda t: t.update(hidden_size="7168"), "hidden_size"),
    (lambda t: t.update(mla_use_nope=False), "mla_use_nope"),
    (lambda t: t.update(num_expert_group=8), "num_expert_group"),
    (lambda t: t.pop("vocab_size"), "vocab_size"),
    (lambda t: t["linear_attn_config"].update(gate_lower_bound=3.0), "kda_gate_lower_bound"),
])
def test_bad_fields_are_named(mutate, field):
    raw = official()
    mutate(raw["text_config"])
    with pytest.raises(ConfigError, match=field):
        from_hf(raw)


def test_bad_top_level():
    with pytest.raises(ConfigError, match="model_type"):
        from_hf({"model_type": "llama"})
    with pytest.raises(ConfigError, match="no such config file"):
        from_hf("/nonexistent/config.json")


def test_bad_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        from_hf(str(tmp_path))


def test_architecture_and_run_settings_are_separate():
    import dataclasses

    from k3jax.config import RUN_FIELDS, RunConfig, default_run

    arch = {f.name for f in dataclasses.fields(get_preset("k3-mini"))}
    assert not arch & set(RUN_FIELDS)  # a K3Config is what config.json describes, nothing about how it runs
    with pytest.raises(ConfigError, match="qat: run settings, not architecture"):
        get_preset("k3-mini").replace(qat="weights")
    with pytest.raises(ConfigError, match="compute_dtype"):
        get_preset("k3-tiny", compute_dtype="bfloat16")
    assert default_run(get_preset("k3-mini")).mla_block_size == 128  # the presets' tuned choices
    assert default_run(get_preset("k3-tiny")) == RunConfig(mla_block_size=8, kda_chunk_size=16)
    assert default_run(get_preset("kimi-k3")) == RunConfig()
    assert default_run(get_preset("k3-mini"), qat="weights").qat == "weights"
    with pytest.raises(ConfigError, match="'kda_impl'"):
        RunConfig(kda_impl="fast")
    with pytest.raises(ConfigError, match="'kda_chunk_size'"):
        RunConfig(kda_chunk_size=24)


def test_each_run_mode_list_has_one_home():
    from k3jax.config import KDA_IMPLS, MOE_IMPLS, QAT_MODES, SCALE_RULES
    from k3jax.layers import kda, moe
    from k3jax.ops import mx
    from k3jax.ops.grouped_matmul import EXPERT_IMPLS

    assert tuple(EXPERT_IMPLS) == MOE_IMPLS  # the dispatch table's keys are the config's MoE impls
    assert kda.IMPLS is KDA_IMPLS and moe.QAT_MODES is QAT_MODES
    assert QAT_MODES == ("off", "weights", "weights+acts") and "pallas" in KDA_IMPLS
    assert mx.SCALE_RULES == SCALE_RULES == ("floor", "ceil", "even")  # the MX scale rules RunConfig's QAT takes


def test_run_settings_follow_the_architecture_not_the_name():
    """A loaded checkpoint is named after its model_type; it runs with the settings of the preset it is (the shipped
    k3-mini: mla_block_size 128, not RunConfig's 512), and an unknown architecture with RunConfig's."""
    from k3jax.checkpoint.source import default_ckpt
    from k3jax.config import PRESET_RUNS, RunConfig, default_run, preset_of

    ckpt = default_ckpt()
    if ckpt is not None:
        shipped = from_hf(os.path.join(ckpt, "config.json"))
        assert shipped.name != "k3-mini" and preset_of(shipped) == "k3-mini"
        assert default_run(shipped) == PRESET_RUNS["k3-mini"] and default_run(shipped).mla_block_size == 128
    loaded_tiny = get_preset("k3-tiny").replace(name="hf-kimi_k3", expert_format="mxfp4")  # storage aside
    assert preset_of(loaded_tiny) == "k3-tiny" and default_run(loaded_tiny, remat="full") == PRESET_RUNS[
        "k3-tiny"].replace(remat="full")
    other = get_preset("k3-tiny").replace(name="hf-kimi_k3", hidden_size=96)
    assert preset_of(other) is None and default_run(other) == RunConfig()


def test_the_config_package_imports_in_one_direction():
    """checks <- lora <- run <- arch <- hf_keys <- hf <- presets: each module imports only those before it (the
    package's __init__ re-exports them all)."""
    import ast
    import pathlib

    import k3jax.config

    order = ["checks", "lora", "run", "arch", "hf_keys", "hf", "presets"]
    pkg = pathlib.Path(k3jax.config.__file__).parent
    assert sorted(p.stem for p in pkg.glob("*.py") if p.stem != "__init__") == sorted(order)
    for i, name in enumerate(order):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        used = {n.module.split(".")[2] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                and n.module.startswith("k3jax.config.")}
        assert used <= set(order[:i]), f"k3jax/config/{name}.py imports {sorted(used - set(order[:i]))}"
