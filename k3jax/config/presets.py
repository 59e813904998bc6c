"""The named presets (``get_preset``: the release's architectures, read from their shipped ``config.json``, and
small K3-shaped ones built here), the run settings each is tuned with (``default_run``), and which preset a loaded
model is (``preset_of``).

    >>> cfg = get_preset("kimi-k3")
    >>> cfg.mla_layers[-2:], cfg.num_mla_layers
    ((91, 92), 24)
"""

from __future__ import annotations

import functools
import os

from k3jax.config.arch import K3Config, architecture
from k3jax.config.checks import ConfigError
from k3jax.config.hf import from_hf
from k3jax.config.run import RunConfig

# The shipped config files (pyproject's package data: k3jax/presets/*.json)
PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "presets")


def preset_json(name: str) -> str:
    """Path of the shipped ``config.json`` of preset ``name`` (kimi-k3: the release's own, byte for byte)."""
    return os.path.join(PRESET_DIR, f"{name}.config.json")


def k3_full_attn_layers(L: int) -> tuple[int, ...]:
    """K3's schedule rule: 1-based MLA layers at every 4th layer plus the last one."""
    return tuple(sorted({i for i in range(4, L + 1, 4)} | {L}))


def _kimi_k3() -> K3Config:
    return from_hf(preset_json("kimi-k3"), name="kimi-k3")


def _kimi_linear_48b() -> K3Config:
    return from_hf(preset_json("kimi-linear-48b"), name="kimi-linear-48b")


def _k3_mini() -> K3Config:
    # ~30M parameters, CPU-trainable, K3's structure: 9 layers, MLA at 0-based {3, 7, 8} (every 4th + the last two),
    # dense layer 0, latent = hidden/2, 2 shared experts, 32 routed experts top-4 (1/8), AttnRes blocks of 4
    # (boundaries 0, 4, 8: two full blocks plus a tail).
    return K3Config(
        name="k3-mini", vocab_size=256, hidden_size=384, num_layers=9, full_attn_layers=k3_full_attn_layers(9),
        kda_num_heads=6, kda_head_dim=64, mla_num_heads=6, q_lora_rank=192, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1024,
        num_experts=32, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=160,
        routed_expert_hidden_size=192, attn_res_block_size=4,
    )


def _k3_tiny() -> K3Config:
    # For unit tests: 5 layers (KDA 0-2, MLA 3-4), AttnRes blocks of 2 (boundaries 0, 2, 4), odd vocab.
    return K3Config(
        name="k3-tiny", vocab_size=97, hidden_size=64, num_layers=5, full_attn_layers=k3_full_attn_layers(5),
        kda_num_heads=2, kda_head_dim=32, mla_num_heads=2, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
        num_experts=8, num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=32,
        routed_expert_hidden_size=32, attn_res_block_size=2,
    )


def _k3_micro() -> K3Config:
    # For CPU ablation grids (`k3 ablate`): k3-mini's structure (9 layers, MLA at 0-based {3, 7, 8}, dense layer 0,
    # byte vocabulary, head dims, latent = hidden/2, 2 shared experts, routed top-k = 1/8 of the experts, AttnRes
    # blocks of 4) at a third of its width: ~3M parameters, ~8x k3-mini's training tokens/s on 2 CPU cores, so a
    # 16-run grid of 131K-token runs fits in well under an hour.
    return _k3_mini().replace(
        name="k3-micro", hidden_size=128, kda_num_heads=2, mla_num_heads=2, q_lora_rank=64, kv_lora_rank=64,
        intermediate_size=384, num_experts=16, num_experts_per_token=2, moe_intermediate_size=64,
        routed_expert_hidden_size=64,
    )


def _kimi_linear_tiny() -> K3Config:
    # kimi-linear-48b with every size shrunk and every switch kept (softplus gate, low-rank output gate, direct
    # q_proj, no MLA gate, SwiGLU, standard MoE with 1 shared expert, routed scale 2.446, no AttnRes, BF16 experts):
    # 8 layers, MLA at 1-based {4, 8} (every 4th + the last), dense layer 0, 8 experts top-2. ~0.68M parameters
    # (2.7 MB in fp32): the checkpoint of tests/golden/kimi_linear, written by HF transformers.
    return _kimi_linear_48b().replace(
        name="kimi-linear-tiny", vocab_size=512, hidden_size=64, num_layers=8, full_attn_layers=(4, 8),
        kda_num_heads=2, kda_head_dim=32, mla_num_heads=2, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, intermediate_size=192, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=32,
    )


PRESETS = {
    "kimi-k3": _kimi_k3,
    "kimi-linear-48b": _kimi_linear_48b,
    "kimi-linear-tiny": _kimi_linear_tiny,
    "k3-mini": _k3_mini,
    "k3-micro": _k3_micro,
    "k3-tiny": _k3_tiny,
}


# Run settings the small presets are tuned with: attention key blocks and KDA chunks sized to their short sequences
# (k3-tiny's small blocks also make short test sequences exercise the blockwise and multi-chunk paths).
PRESET_RUNS = {
    "k3-mini": RunConfig(mla_block_size=128),
    "k3-micro": RunConfig(mla_block_size=128),
    "k3-tiny": RunConfig(mla_block_size=8, kda_chunk_size=16),
    "kimi-linear-tiny": RunConfig(mla_block_size=16, kda_chunk_size=16),
}


def get_preset(name: str, **overrides) -> K3Config:
    """A named preset; unknown names raise ConfigError listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg


def preset_of(cfg: K3Config) -> str | None:
    """The preset ``cfg`` is: its name when that names a preset, else the preset with its architecture
    (``architecture_diff``; the storage format aside) — a checkpoint loaded from disk is named after its
    ``model_type`` (``hf-kimi_k3``), not after the preset it was trained as. None for any other model."""
    if cfg.name in PRESETS:
        return cfg.name
    return next((name for name, arch in _preset_architectures().items() if arch == _identity(cfg)), None)


def _identity(cfg: K3Config) -> dict:
    d = architecture(cfg)
    d.pop("expert_format")
    return d


@functools.cache
def _preset_architectures() -> dict[str, dict]:
    return {name: _identity(make()) for name, make in PRESETS.items()}


def default_run(cfg: K3Config, **overrides) -> RunConfig:
    """The run settings ``cfg``'s preset is tuned with (``PRESET_RUNS``, found by ``preset_of``: a loaded
    checkpoint of k3-mini runs as k3-mini does), ``RunConfig()`` for any other model; with ``overrides``."""
    run = PRESET_RUNS.get(preset_of(cfg), RunConfig())
    return run.replace(**overrides) if overrides else run


__all__ = ["PRESETS", "PRESET_DIR", "PRESET_RUNS", "default_run", "get_preset", "k3_full_attn_layers", "preset_json",
           "preset_of"]
