"""The architecture (``K3Config``: what a checkpoint's ``config.json`` describes), its validation, and the one
comparison of architectures (``architecture``, ``architecture_diff``).

Only the model (``k3jax/model/network.py``, ``decoder.py``) reads a ``K3Config``; blocks get plain arguments
(docs/design.md §3.4).
Family switches (docs/model.md §13) are fields, not code forks; they double as ablation knobs. How a model runs is
not architecture: that is a ``RunConfig`` (k3jax/config/run.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from k3jax.config.checks import ConfigError, need, positive_int
from k3jax.config.run import RUN_FIELDS

Act = Literal["situ", "silu"]


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


def validate(c: K3Config) -> None:
    """Raise ConfigError naming the field for any malformed or contradictory value."""

    def check(cond: bool, fld: str, msg: str):
        need(c, cond, fld, msg)

    for fld, opts in _CHOICES.items():
        check(getattr(c, fld) in opts, fld, f"must be one of {opts}")
    for fld in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim", "kda_conv_size",
                "mla_num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                "num_experts", "num_experts_per_token", "moe_intermediate_size"):
        check(positive_int(getattr(c, fld)), fld, "must be a positive integer")
    check(isinstance(c.qk_rope_head_dim, int) and c.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
    check(c.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
    check(c.q_lora_rank is None or c.q_lora_rank > 0, "q_lora_rank", "must be a positive integer or null")
    check(c.routed_expert_hidden_size is None or c.routed_expert_hidden_size > 0, "routed_expert_hidden_size",
          "must be a positive integer or null")
    check(c.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
    check(c.mla_norm_eps > 0, "mla_norm_eps", "must be > 0")
    check(c.situ_beta > 0 and c.situ_linear_beta > 0, "situ_beta", "SiTU betas must be > 0")
    check(c.kda_gate_lower_bound is None or c.kda_gate_lower_bound < 0, "kda_gate_lower_bound", "must be < 0")
    check(c.num_experts_per_token <= c.num_experts, "num_experts_per_token",
          f"top-k cannot exceed num_experts={c.num_experts}")
    check(0 <= c.first_k_dense_replace <= c.num_layers, "first_k_dense_replace", f"must be in [0, {c.num_layers}]")
    fal = c.full_attn_layers
    check(all(isinstance(i, int) and 1 <= i <= c.num_layers for i in fal), "full_attn_layers",
          f"1-based layer indices must lie in [1, {c.num_layers}]")
    check(len(set(fal)) == len(fal), "full_attn_layers", "duplicate layer index")
    check(c.attn_res_block_size is None or c.attn_res_block_size > 0, "attn_res_block_size", "must be > 0 or null")
    check(c.latent_moe_use_norm is False or c.is_latent_moe, "latent_moe_use_norm",
          "a latent norm needs routed_expert_hidden_size")
    check(c.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")


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


__all__ = ["NOT_IN_HF_CONFIG", "K3Config", "architecture", "architecture_diff", "validate"]
