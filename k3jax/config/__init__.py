"""What a model is and how it runs: the architecture (``K3Config``: what a checkpoint's ``config.json`` describes),
HF ``config.json`` <-> ``K3Config`` (``from_hf``, ``to_hf_dict``), the named presets, the run settings (``RunConfig``:
dtypes, kernels, dispatch, QAT, block sizes) and the LoRA settings.

One import direction inside: ``checks`` (``ConfigError``) <- ``lora`` <- ``run`` <- ``arch`` <- ``hf_keys`` <-
``hf`` <- ``presets``; this file re-exports the public names, so ``from k3jax.config import X`` is the way in.
"""

from k3jax.config.arch import NOT_IN_HF_CONFIG, K3Config, architecture, architecture_diff, validate
from k3jax.config.checks import ConfigError
from k3jax.config.hf import UnknownConfigKeysWarning, from_hf, to_hf_dict
from k3jax.config.lora import LORA_TARGETS, LoRAConfig
from k3jax.config.presets import (
    PRESET_RUNS,
    PRESETS,
    default_run,
    get_preset,
    k3_full_attn_layers,
    preset_json,
    preset_of,
)
from k3jax.config.run import (
    DTYPES,
    KDA_IMPLS,
    KERNELS,
    LAYER_STACKS,
    MLA_IMPLS,
    MOE_IMPLS,
    PACKED_KERNELS,
    QAT_MODES,
    REMAT_POLICIES,
    RUN_FIELDS,
    SCALE_RULES,
    RunConfig,
    kernel_choice,
    with_kernels,
)

__all__ = ["DTYPES", "KDA_IMPLS", "KERNELS", "LAYER_STACKS", "LORA_TARGETS", "MLA_IMPLS", "MOE_IMPLS",
           "NOT_IN_HF_CONFIG", "PACKED_KERNELS", "PRESETS", "PRESET_RUNS", "QAT_MODES", "REMAT_POLICIES", "RUN_FIELDS",
           "SCALE_RULES", "ConfigError", "K3Config", "LoRAConfig", "RunConfig", "UnknownConfigKeysWarning",
           "architecture", "architecture_diff", "default_run", "from_hf", "get_preset", "k3_full_attn_layers",
           "kernel_choice", "preset_json", "preset_of", "to_hf_dict", "validate", "with_kernels"]
