"""The architecture (``K3Config``: what a checkpoint's ``config.json`` describes), the run settings
(``RunConfig``: dtypes, kernels, dispatch, QAT, block sizes), named presets and ``from_hf``.

Only the model (``k3jax/model/network.py``, ``decoder.py``) reads a ``K3Config``; blocks get plain arguments
(docs/design.md §3.4).
Family switches (docs/model.md §13) are fields, not code forks; they double as ablation knobs.

    >>> cfg = get_preset("kimi-k3")
    >>> cfg.mla_layers[-2:], cfg.num_mla_layers
    ((91, 92), 24)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from k3jax.errors import InputError
from k3jax.lora_config import LORA_TARGETS, LoRAConfig

Act = Literal["situ", "silu"]
MoEImpl = Literal["sorted", "ragged", "tiled", "dense"]  # = k3jax.ops.grouped_matmul.EXPERT_IMPLS' keys (tested)
KDAImpl = Literal["recurrent", "chunked", "pallas"]
QATMode = Literal["off", "weights", "weights+acts"]
# Rematerialisation (model/network.py) per decoder layer, or per scanned group of layers: none; "full" =
# jax.checkpoint without a policy (keep only the unit's inputs; in the scanned AttnRes stack the group's backward
# also checkpoints each of its layers, so one layer's activations are live at a time); "group" = "full" without
# that inner checkpoint (the group's backward keeps its layers' activations: one forward fewer, more memory; in the
# unrolled stack the same as "full"); the rest name a jax.checkpoint_policies entry (what of the unit's forward stays
# saved).
Remat = Literal["none", "full", "group", "dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable",
                "everything_saveable"]
# The one list of each run-mode family (the Literals above are their single spelling): blocks, the train loop and
# the CLIs import these.
MOE_IMPLS: tuple[str, ...] = get_args(MoEImpl)
KDA_IMPLS: tuple[str, ...] = get_args(KDAImpl)
QAT_MODES: tuple[str, ...] = get_args(QATMode)
REMAT_POLICIES: tuple[str, ...] = get_args(Remat)


class ConfigError(InputError):
    """A malformed or contradictory config; the message names the field."""


@dataclass(frozen=True)
class K3Config:
    """Hyper-parameters of a K3-family model (Kimi K3, Kimi-Linear, and small K3-shaped presets).

    Layer indices in this object are **0-based**; ``full_attn_layers`` is kept 1-based as in the HF config.
    """

    name: str = "custom"
    # -- trunk
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # 1-based indices of the MLA ("full attention") layers; all others are KDA.
    full_attn_layers: tuple[int, ...] = ()
    # -- KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = -5.0  # None -> Kimi-Linear softplus gate (unbounded)
    kda_full_rank_gate: bool = True  # False -> low-rank g_a/g_b output gate (rank = kda_head_dim)
    # -- MLA
    mla_num_heads: int = 96
    q_lora_rank: int | None = 1536  # None -> direct q_proj (Kimi-Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = True
    mla_norm_eps: float = 1e-6  # docs/model.md §2.3: Moonshot/HF use 1e-6; torchtitan uses rms_norm_eps
    # -- FFN
    hidden_act: Act = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    intermediate_size: int = 33792  # dense layer-0 MLP
    first_k_dense_replace: int = 1
    # -- MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # None -> standard MoE (experts on full width)
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    # -- residual
    attn_res_block_size: int | None = 12  # None -> standard pre-norm residual (Kimi-Linear)
    # -- checkpoint storage of the routed experts
    expert_format: Literal["mxfp4", "bf16"] = "mxfp4"
    # release metadata read from config.json that is no architecture (hf_keys.EXTRA_READ, e.g.
    # max_position_embeddings): never compared, hashed or written
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        validate(self)

    # ---- derived facts, computed in one place
    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based indices of the gated-MLA layers."""
        return tuple(sorted(i - 1 for i in self.full_attn_layers))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        m = set(self.mla_layers)
        return tuple(l for l in range(self.num_layers) if l not in m)

    @property
    def num_mla_layers(self) -> int:
        return len(self.full_attn_layers)

    @property
    def num_kda_layers(self) -> int:
        return self.num_layers - self.num_mla_layers

    def is_mla(self, l: int) -> bool:
        return (l + 1) in self.full_attn_layers

    def is_moe(self, l: int) -> bool:
        return l >= self.first_k_dense_replace

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def moe_width(self) -> int:
        """Width the routed experts work in: the latent ℓ for LatentMoE, else d."""
        return self.routed_expert_hidden_size if self.is_latent_moe else self.hidden_size

    @property
    def shared_hidden(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attn_res_boundaries(self) -> tuple[int, ...]:
        if not self.uses_attn_res:
            return ()
        return tuple(l for l in range(self.num_layers) if l % self.attn_res_block_size == 0)

    @property
    def kda_gate(self) -> Literal["safe", "softplus"]:
        return "softplus" if self.kda_gate_lower_bound is None else "safe"

    def replace(self, **kw) -> K3Config:
        run = sorted(set(kw) & set(RUN_FIELDS))
        if run:
            raise ConfigError(f"{', '.join(run)}: run settings, not architecture; set them on a RunConfig "
                              "(k3jax.config.default_run(cfg, ...))")
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        d["full_attn_layers"] = list(self.full_attn_layers)
        return d


_CHOICES = {
    "hidden_act": ("situ", "silu"),
    "expert_format": ("mxfp4", "bf16"),
}
_RUN_CHOICES = {
    "moe_impl": MOE_IMPLS,
    "kda_impl": KDA_IMPLS,
    "qat": QAT_MODES,
    "qat_weight_rule": ("floor", "ceil", "even"),
    "qat_act_rule": ("floor", "ceil", "even"),
    "param_dtype": ("float32", "bfloat16", "float64"),
    "compute_dtype": ("float32", "bfloat16", "float64"),
    "layer_stack": ("loop", "scan"),
    "remat": REMAT_POLICIES,
}


def _need(c, cond: bool, fld: str, msg: str):
    if not cond:
        raise ConfigError(f"config field {fld!r}: {msg} (got {getattr(c, fld, None)!r})")


def validate(c: K3Config) -> None:
    """Raise ConfigError naming the field for any malformed or contradictory value."""

    def need(cond: bool, fld: str, msg: str):
        _need(c, cond, fld, msg)

    for fld, opts in _CHOICES.items():
        need(getattr(c, fld) in opts, fld, f"must be one of {opts}")
    for fld in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim", "kda_conv_size",
                "mla_num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                "num_experts", "num_experts_per_token", "moe_intermediate_size"):
        v = getattr(c, fld)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0, fld, "must be a positive integer")
    need(isinstance(c.qk_rope_head_dim, int) and c.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
    need(c.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
    need(c.q_lora_rank is None or c.q_lora_rank > 0, "q_lora_rank", "must be a positive integer or null")
    need(c.routed_expert_hidden_size is None or c.routed_expert_hidden_size > 0, "routed_expert_hidden_size",
         "must be a positive integer or null")
    need(c.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
    need(c.mla_norm_eps > 0, "mla_norm_eps", "must be > 0")
    need(c.situ_beta > 0 and c.situ_linear_beta > 0, "situ_beta", "SiTU betas must be > 0")
    need(c.kda_gate_lower_bound is None or c.kda_gate_lower_bound < 0, "kda_gate_lower_bound", "must be < 0")
    need(c.num_experts_per_token <= c.num_experts, "num_experts_per_token",
         f"top-k cannot exceed num_experts={c.num_experts}")
    need(0 <= c.first_k_dense_replace <= c.num_layers, "first_k_dense_replace", f"must be in [0, {c.num_layers}]")
    fal = c.full_attn_layers
    need(all(isinstance(i, int) and 1 <= i <= c.num_layers for i in fal), "full_attn_layers",
         f"1-based layer indices must lie in [1, {c.num_layers}]")
    need(len(set(fal)) == len(fal), "full_attn_layers", "duplicate layer index")
    need(c.attn_res_block_size is None or c.attn_res_block_size > 0, "attn_res_block_size", "must be > 0 or null")
    need(c.latent_moe_use_norm is False or c.is_latent_moe, "latent_moe_use_norm",
         "a latent norm needs routed_expert_hidden_size")
    need(c.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")


@dataclass(frozen=True)
class RunConfig:
    """How a model runs — never part of a checkpoint or its ``config.json``: dtypes, kernel and dispatch choices,
    the QAT mode and its rounding rules, block sizes. ``default_run(cfg)`` gives a preset's choices."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # matmul operand dtype (accumulation is always at least fp32)
    moe_impl: MoEImpl = "sorted"
    kda_impl: KDAImpl = "chunked"  # chunked for T > 1 (per-chunk states in training); decode uses the step
    kda_chunk_size: int = 64
    mla_block_size: int = 512  # key block of the blockwise causal attention
    qat: QATMode = "off"
    qat_weight_rule: str = "even"
    qat_act_rule: str = "ceil"
    # The repeating layer group of the stacked layout (model/layout.py): unrolled ("loop") or one lax.scan over the
    # groups ("scan": a compile time that does not grow with depth); equal up to reduction order (tests/model).
    layer_stack: str = "loop"
    # Each decoder layer's forward (loop), or each scanned group of layers (scan), under jax.checkpoint with this
    # policy (REMAT_POLICIES): the same math, less activation memory kept for the backward pass, more recompute.
    remat: Remat = "none"
    # LoRA adapters beside the weights (k3jax/layers/lora.py); None: none. Like packed experts, adapters change the
    # modules' parameters, not the architecture: a checkpoint's config.json never holds them.
    lora: LoRAConfig | None = None

    def __post_init__(self):
        _need(self, self.lora is None or isinstance(self.lora, LoRAConfig), "lora", "must be a LoRAConfig or None")
        for fld, opts in _RUN_CHOICES.items():
            _need(self, getattr(self, fld) in opts, fld, f"must be one of {opts}")
        for fld in ("kda_chunk_size", "mla_block_size"):
            v = getattr(self, fld)
            _need(self, isinstance(v, int) and not isinstance(v, bool) and v > 0, fld, "must be a positive integer")
        _need(self, self.kda_chunk_size % 16 == 0, "kda_chunk_size", "must be a multiple of the 16-token sub-chunk")

    def replace(self, **kw) -> RunConfig:
        return dataclasses.replace(self, **kw)


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))


# ---------------------------------------------------------------------------------------------- architectures

# K3Config fields an HF config does not carry: the config's name, and mla_norm_eps (fixed at Moonshot's 1e-6;
# docs/model.md §2.3). Run settings are not K3Config fields at all (RunConfig).
NOT_IN_HF_CONFIG = ("name", "mla_norm_eps")


def architecture(cfg: K3Config) -> dict:
    """The fields of ``cfg`` an HF config carries: what a model is, whatever it is called."""
    d = cfg.to_dict()
    for k in NOT_IN_HF_CONFIG:
        d.pop(k, None)
    return d


def architecture_diff(a: K3Config, b: K3Config, *, storage: bool = False) -> list[str]:
    """Architecture fields in which ``a`` and ``b`` differ (sorted); ``expert_format`` only with ``storage``
    (a checkpoint's storage is decided by the tensors present). Export, load, resume and the run settings compare
    architectures with this one function."""
    x, y = architecture(a), architecture(b)
    if not storage:
        x.pop("expert_format"), y.pop("expert_format")
    return sorted(k for k in x if x[k] != y.get(k))


# --------------------------------------------------------------------------------------------------------- from_hf

def from_hf(path_or_dict, *, strict: bool = False, report: dict | None = None, **overrides) -> K3Config:
    """Parse an HF ``config.json`` (official K3 or flat Kimi-Linear); see ``k3jax.hf_config.from_hf``, which holds
    the one table of config keys (imported lazily: that module imports this one)."""
    from k3jax.hf_config import from_hf as _from_hf

    return _from_hf(path_or_dict, strict=strict, report=report, **overrides)


# --------------------------------------------------------------------------------------------------------- presets

def k3_full_attn_layers(L: int) -> tuple[int, ...]:
    """K3's schedule rule: 1-based MLA layers at every 4th layer plus the last one."""
    return tuple(sorted({i for i in range(4, L + 1, 4)} | {L}))


def _kimi_k3() -> K3Config:
    here = os.path.dirname(__file__)
    return from_hf(os.path.join(here, "presets", "kimi-k3.config.json"), name="kimi-k3")


def _kimi_linear_48b() -> K3Config:
    here = os.path.dirname(__file__)
    return from_hf(os.path.join(here, "presets", "kimi-linear-48b.config.json"), name="kimi-linear-48b")


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


__all__ = ["KDA_IMPLS", "LORA_TARGETS", "MOE_IMPLS", "NOT_IN_HF_CONFIG", "QAT_MODES", "REMAT_POLICIES", "K3Config",
           "ConfigError", "LoRAConfig",
           "PRESETS", "PRESET_RUNS", "RUN_FIELDS", "RunConfig", "architecture", "architecture_diff", "default_run",
           "from_hf", "get_preset", "k3_full_attn_layers", "preset_of", "validate"]
