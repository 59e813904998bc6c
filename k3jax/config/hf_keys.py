"""The table behind HF ``config.json`` <-> ``K3Config`` (``k3jax.config.hf`` parses and emits with it;
docs/model.md §1.1, §13): every used key of the release's form (``KEYS``: its field, types, default, what k3jax accepts,
how it is written), transformers' own form of some of them (``DERIVED``: the keys its ``KimiLinearConfig`` derives and
serializes, which stand in for the release's keys a file lacks and must agree with those it has), and the known keys
that change no math (``BOILERPLATE``, ``IRRELEVANT``; ``EXTRA_READ`` of them kept as metadata).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3jax.config.arch import K3Config

REQUIRED = object()


# Serialized transformers.PretrainedConfig attributes and release metadata: no model hyper-parameter
# (docs/model.md §1.1). Every key the official K3 and Kimi-Linear files carry besides the used ones is here.
BOILERPLATE = frozenset("""
_name_or_path add_cross_attention architectures auto_map bad_words_ids begin_suppress_tokens bos_token_id
chunk_size_feed_forward cross_attention_hidden_size decoder_start_token_id diversity_penalty do_sample dtype
torch_dtype early_stopping encoder_no_repeat_ngram_size eos_token_id exponential_decay_length_penalty finetuning_task
forced_bos_token_id forced_eos_token_id id2label label2id is_decoder is_encoder_decoder length_penalty max_length
min_length no_repeat_ngram_size num_beam_groups num_beams num_return_sequences output_attentions output_hidden_states
output_scores pad_token_id prefix problem_type pruned_heads remove_invalid_values repetition_penalty return_dict
return_dict_in_generate sep_token_id suppress_tokens task_specific_params temperature tf_legacy_loss
tie_encoder_decoder tokenizer_class top_k top_p torchscript transformers_version typical_p use_bfloat16 use_cache
initializer_range max_position_embeddings model_type ignore_index media_placeholder_token_id image_placeholder
head_dim attention_dropout attention_bias mlp_bias use_return_dict vision_config
""".split())
EXTRA_READ = ("max_position_embeddings",)  # read into K3Config.extra, never compared or written
# Keys other writers add that change nothing k3jax computes (generation/runtime defaults, tokenizer ids, RoPE
# settings of a NoPE model, training-only switches of other frameworks). Accepted and reported.
# pretraining_tp: transformers' KimiLinear never reads it (modeling_kimi_linear.py in 5.23 has no use; Llama's old
# pretraining_tp > 1 only split matmuls into slices of the same product), so any value is math-neutral.
IRRELEVANT = frozenset("""
model_max_length rope_parameters rope_theta rope_scaling unk_token_id tokenizer_name generation_config
output_router_logits return_legacy_cache use_sliding_window sliding_window max_window_layers pretraining_tp
""".split())


# ---------------------------------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class Key:
    """One used HF key.

    ``field`` is the K3Config field it fills (None: a fixed switch that is checked, not stored). ``default`` is
    the value assumed when the key is absent (``REQUIRED``: an error); a callable default gets the text config.
    ``accept`` (fixed switches) says which values k3jax implements; ``why`` is the error text otherwise.
    ``emit(cfg)`` is the value ``to_hf_dict`` writes (default: the field's value); ``emit_if(cfg)`` whether it
    writes the key at all.
    """

    name: str  # "linear_attn_config.x" for keys nested in linear_attn_config
    field: str | None
    types: tuple
    default: Any = REQUIRED
    nullable: bool = False
    accept: Callable[[Any], bool] | None = None
    why: str = ""
    to_cfg: Callable[[Any], Any] = lambda v: v
    emit: Callable[[K3Config], Any] | None = None
    emit_if: Callable[[K3Config], bool] = lambda c: True
    missing: str = "required field is missing"


_INT, _NUM, _BOOL, _STR, _LIST = (int,), (int, float), (bool,), (str,), (list,)
_SITU_MISSING = "hidden_act 'situ' needs activation_situ_beta and activation_situ_linear_beta"
_never = lambda c: False  # noqa: E731  (accepted on input, left out of what k3jax writes, as before)

KEYS: tuple[Key, ...] = (
    Key("vocab_size", "vocab_size", _INT),
    Key("hidden_size", "hidden_size", _INT),
    Key("num_hidden_layers", "num_layers", _INT),
    Key("rms_norm_eps", "rms_norm_eps", _NUM, 1e-6, to_cfg=float),
    Key("tie_word_embeddings", "tie_word_embeddings", _BOOL, False),
    Key("linear_attn_config.full_attn_layers", "full_attn_layers", _LIST, to_cfg=tuple,
        emit=lambda c: list(c.full_attn_layers),
        missing="required field is missing (and the file has no transformers' layer_types to read it from)"),
    Key("linear_attn_config.kda_layers", None, _LIST, None, nullable=True,
        emit=lambda c: [i for i in range(1, c.num_layers + 1) if i not in set(c.full_attn_layers)]),
    Key("linear_attn_config.num_heads", "kda_num_heads", _INT, lambda tc: tc.get("num_attention_heads")),
    Key("linear_attn_config.head_dim", "kda_head_dim", _INT, 128),
    Key("linear_attn_config.short_conv_kernel_size", "kda_conv_size", _INT, 4),
    Key("linear_attn_config.use_full_rank_gate", "kda_full_rank_gate", _BOOL, False),
    Key("linear_attn_config.gate_lower_bound", "kda_gate_lower_bound", _NUM, None, nullable=True,
        to_cfg=lambda v: None if v is None else float(v), emit_if=lambda c: c.kda_gate_lower_bound is not None),
    Key("num_attention_heads", "mla_num_heads", _INT),
    Key("num_key_value_heads", None, _INT, None, nullable=True, emit=lambda c: c.mla_num_heads),
    Key("q_lora_rank", "q_lora_rank", _INT, None, nullable=True),
    Key("kv_lora_rank", "kv_lora_rank", _INT),
    Key("qk_nope_head_dim", "qk_nope_head_dim", _INT),
    Key("qk_rope_head_dim", "qk_rope_head_dim", _INT),
    Key("v_head_dim", "v_head_dim", _INT),
    Key("mla_use_nope", None, _BOOL, lambda tc: _nope_default(tc), accept=lambda v: v is True,
        why="only NoPE MLA (true) is supported; K3 and Kimi-Linear apply no RoPE", emit=lambda c: True),
    Key("mla_use_output_gate", "mla_output_gate", _BOOL, False),
    Key("hidden_act", "hidden_act", _STR, "silu", accept=lambda v: v in ("situ", "silu"),
        why="must be 'situ' or 'silu'"),
    Key("activation_situ_beta", "situ_beta", _NUM, lambda tc: _situ_default(tc, 4.0), to_cfg=float,
        missing=_SITU_MISSING),
    Key("activation_situ_linear_beta", "situ_linear_beta", _NUM, lambda tc: _situ_default(tc, 25.0), to_cfg=float,
        missing=_SITU_MISSING),
    Key("intermediate_size", "intermediate_size", _INT),
    Key("first_k_dense_replace", "first_k_dense_replace", _INT, 0),
    Key("moe_layer_freq", None, _INT, 1, accept=lambda v: v == 1,
        why="only 1 (every layer after first_k_dense_replace is MoE) is supported", emit=lambda c: 1),
    Key("num_experts", "num_experts", _INT),
    Key("num_experts_per_token", "num_experts_per_token", _INT),
    Key("num_shared_experts", "num_shared_experts", _INT, 0),
    Key("moe_intermediate_size", "moe_intermediate_size", _INT),
    Key("routed_expert_hidden_size", "routed_expert_hidden_size", _INT, None, nullable=True),
    Key("latent_moe_use_norm", "latent_moe_use_norm", _BOOL, False),
    Key("routed_scaling_factor", "routed_scaling_factor", _NUM, 1.0, to_cfg=float),
    Key("moe_renormalize", "moe_renormalize", _BOOL, True),
    Key("moe_router_activation_func", None, _STR, "sigmoid", accept=lambda v: v == "sigmoid",
        why="only 'sigmoid' routing is supported", emit=lambda c: "sigmoid"),
    Key("topk_method", None, _STR, "noaux_tc", accept=lambda v: v == "noaux_tc",
        why="only 'noaux_tc' is supported", emit=lambda c: "noaux_tc"),
    Key("use_grouped_topk", None, _BOOL, True, emit_if=_never),  # with one group, grouped top-k is plain top-k
    Key("num_expert_group", None, _INT, 1, nullable=True, accept=lambda v: v in (1, None),
        why="group-limited routing (num_expert_group != 1) is not supported", emit_if=_never),
    Key("topk_group", None, _INT, 1, nullable=True, accept=lambda v: v in (1, None),
        why="group-limited routing (topk_group != 1) is not supported", emit_if=_never),
    Key("num_nextn_predict_layers", None, _INT, 0, nullable=True, accept=lambda v: v in (0, None),
        why="MTP layers are not part of the release and not supported", emit=lambda c: 0),
    Key("attn_res_block_size", "attn_res_block_size", _INT, None, nullable=True),
)


@dataclass(frozen=True)
class Derived:
    """A key of transformers' form: what its ``KimiLinearConfig`` (5.x) derives from the release's keys and
    serializes (beside them when it read a release file; alone when it built the config itself, e.g.
    ``KimiLinearConfig(layer_types=..., linear_num_heads=...)`` then ``save_pretrained``).

    ``value(kw)`` is what it must be for the K3Config fields parsed from the same file (before any overrides);
    ``source`` names the used key(s) it restates; ``why`` is the error's reason when both are present and disagree.
    ``normalize`` maps a stored value to the form compared (transformers' own spelling remaps).
    ``stands_for`` is the used key it fills where the file lacks that key (transformers' form), ``read(v, L)`` the
    value it gives there from the normalized value and the layer count; ``read`` raises ``ValueError(reason)`` for
    a value k3jax does not implement.
    """

    name: str
    types: tuple
    value: Callable[[dict], Any]
    source: str
    why: str = "it restates that value"
    normalize: Callable[[Any], Any] = lambda v: v
    stands_for: str | None = None
    read: Callable[[Any, int], Any] = lambda v, L: v


# transformers remaps these legacy layer-type spellings on load (configuration_utils._LEGACY_LAYER_TYPE_REMAP)
_LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}
_LINEAR_WHY = "transformers' KDA reads it where linear_attn_config lacks the key"


def _layer_list(v: list, L: int, kinds: tuple[str, ...], what: str) -> None:
    if len(v) != L:
        raise ValueError(f"{len(v)} entries for {L} layers")
    bad = next((i for i, t in enumerate(v) if t not in kinds), None)
    if bad is not None:
        raise ValueError(f"1-based layer {bad + 1} is {v[bad]!r}: k3jax builds only "
                         f"{' and '.join(repr(k) for k in kinds)} {what}")


def _read_layer_types(v: list, L: int) -> list[int]:
    """transformers' ``layer_types`` -> the release's 1-based ``full_attn_layers`` (MLA; the rest KDA)."""
    _layer_list(v, L, ("full_attention", "linear_attention"), "layers (MLA and KDA)")
    return [i + 1 for i, t in enumerate(v) if t == "full_attention"]


def _read_mlp_layer_types(v: list, L: int) -> int:
    """transformers' ``mlp_layer_types`` -> ``first_k_dense_replace``: k3jax's dense MLPs are a leading run."""
    _layer_list(v, L, ("dense", "sparse"), "MLPs")
    k = next((i for i, t in enumerate(v) if t == "sparse"), L)
    if "dense" in v[k:]:
        i = v.index("dense", k)
        raise ValueError(f"1-based layer {i + 1} is 'dense' after the MoE layer {k + 1}: k3jax places dense MLPs "
                         "only before the first MoE layer (first_k_dense_replace)")
    return k


DERIVED: tuple[Derived, ...] = (
    # transformers' decoder layer: MLA iff layer_types[l] == "full_attention", else KDA
    Derived("layer_types", _LIST,
            lambda kw: ["full_attention" if l + 1 in kw["full_attn_layers"] else "linear_attention"
                        for l in range(kw["num_layers"])],
            "linear_attn_config.full_attn_layers",
            why="transformers builds MLA / KDA layers from layer_types, k3jax from linear_attn_config",
            normalize=lambda v: [_LEGACY_LAYER_TYPES.get(t, t) for t in v],
            stands_for="linear_attn_config.full_attn_layers", read=_read_layer_types),
    # transformers' decoder layer: MoE iff mlp_layer_types[l] == "sparse", else the dense MLP
    Derived("mlp_layer_types", _LIST,
            lambda kw: ["dense" if l < kw["first_k_dense_replace"] else "sparse" for l in range(kw["num_layers"])],
            "first_k_dense_replace",
            why="transformers picks MoE / dense MLP layers from mlp_layer_types, k3jax from first_k_dense_replace",
            stands_for="first_k_dense_replace", read=_read_mlp_layer_types),
    # transformers' KDA reads these where linear_attn_config lacks the key (so does k3jax)
    Derived("linear_num_heads", _INT, lambda kw: kw["kda_num_heads"], "linear_attn_config.num_heads", _LINEAR_WHY,
            stands_for="linear_attn_config.num_heads"),
    Derived("linear_head_dim", _INT, lambda kw: kw["kda_head_dim"], "linear_attn_config.head_dim", _LINEAR_WHY,
            stands_for="linear_attn_config.head_dim"),
    Derived("linear_conv_kernel_dim", _INT, lambda kw: kw["kda_conv_size"],
            "linear_attn_config.short_conv_kernel_size", _LINEAR_WHY,
            stands_for="linear_attn_config.short_conv_kernel_size"),
    Derived("qk_head_dim", _INT, lambda kw: kw["qk_nope_head_dim"] + kw["qk_rope_head_dim"],
            "qk_nope_head_dim + qk_rope_head_dim"),
)
DERIVED_NAMES = frozenset(d.name for d in DERIVED)
STANDS_FOR = {d.stands_for: d for d in DERIVED if d.stands_for is not None}  # used key -> transformers' key
KEY_NAMES = frozenset(k.name.split(".")[0] for k in KEYS) | {"model_type", "quantization_config"} | DERIVED_NAMES
LINEAR_ATTN_KEYS = frozenset(k.name.split(".", 1)[1] for k in KEYS if k.name.startswith("linear_attn_config."))
TOP_USED = frozenset({"model_type", "text_config", "tie_word_embeddings", "quantization_config"})

MXFP4_FORMAT = "mxfp4-pack-quantized"


def _situ_default(tc: dict, value: float):
    """SiTU's betas have no transformers default: a 'situ' config must state them (unused for 'silu')."""
    return REQUIRED if tc.get("hidden_act") == "situ" else value


def _nope_default(tc: dict) -> bool:
    """``mla_use_nope`` absent: the release's own modelling code (its ``KimiLinearConfig`` defaults to false) would
    rotate, so a release-form file must state it; a file without ``linear_attn_config`` (transformers' form) is read
    only by transformers' ``KimiLinear``, whose MLA has no RoPE (it has no such key)."""
    return "linear_attn_config" not in tc


__all__ = ["BOILERPLATE", "DERIVED", "DERIVED_NAMES", "EXTRA_READ", "IRRELEVANT", "KEY_NAMES", "KEYS",
           "LINEAR_ATTN_KEYS", "MXFP4_FORMAT", "REQUIRED", "STANDS_FOR", "TOP_USED", "Derived", "Key"]
