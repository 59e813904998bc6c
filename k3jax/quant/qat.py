"""QAT policy for the routed experts (SPEC §10.7) and the lossless export of QAT-trained expert weights.

Modes: "off" (plain model), "weights" (MXFP4 fake-quant of the expert stacks, blocks along ``in``), "weights+acts"
(also MXFP8 E4M3 fake-quant of the inputs of all three expert GEMMs, blocks along their contraction axis). The model
itself calls k3jax.ops.mx.fake_quant_* with the rules from the config; this module gives the same choices one name
for training code, notebooks and export.

Export is lossless because the weight fake-quant uses the checkpoint's own rule ("even", compressed-tensors): for a
master weight w, unpack(export(w)) == fake_quant_mxfp4(w) bit for bit, which is what the QAT model computed with.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.ops import mx
from k3jax.quant.packing import experts_to_packed, packed_to_experts

QAT_MODES = ("off", "weights", "weights+acts")
EXPERT_KEYS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class QATPolicy:
    """Which tensors are fake-quantized and with which scale rule."""

    mode: str = "off"
    weight_rule: str = "even"  # = compressed-tensors, so export reproduces the trained values
    act_rule: str = "ceil"  # never clips; activations are clipped to +-448 before the E4M3 cast anyway

    def __post_init__(self):
        if self.mode not in QAT_MODES:
            raise ValueError(f"qat mode must be one of {QAT_MODES}, got {self.mode!r}")
        for kind, rule in (("weight_rule", self.weight_rule), ("act_rule", self.act_rule)):
            if rule not in mx.SCALE_RULES:
                raise ValueError(f"{kind} must be one of {mx.SCALE_RULES}, got {rule!r}")

    @classmethod
    def from_config(cls, cfg) -> QATPolicy:
        return cls(mode=cfg.qat, weight_rule=cfg.qat_weight_rule, act_rule=cfg.qat_act_rule)

    @property
    def quantize_weights(self) -> bool:
        return self.mode in ("weights", "weights+acts")

    @property
    def quantize_acts(self) -> bool:
        return self.mode == "weights+acts"

    def weights(self, w_eio: jax.Array, *, axis: int = 1) -> jax.Array:
        """Expert stack [E, in, out] -> MXFP4 fake-quant along ``in`` (identity when weights are not quantized)."""
        return mx.fake_quant_mxfp4(w_eio, axis=axis, rule=self.weight_rule) if self.quantize_weights else w_eio

    def acts(self, x: jax.Array, *, axis: int = -1) -> jax.Array:
        """GEMM input -> MXFP8 fake-quant along the contraction ``axis`` (identity unless mode is weights+acts)."""
        return mx.fake_quant_mxfp8(x, axis=axis, rule=self.act_rule) if self.quantize_acts else x


def export_experts_mxfp4(experts: dict, *, rule: str = "even") -> dict:
    """Pack QAT-trained expert stacks for the checkpoint.

    Args:
      experts: {"w1": [E, P, F], "w3": [E, P, F], "w2": [E, F, P]} float master weights (k3jax orientation
        [E, in, out]); other keys are ignored.
      rule: the scale rule the QAT forward used (the export is lossless only for that rule).
    Returns:
      {"w1_packed": uint8 [E, F, P/2], "w1_scale": uint8 [E, F, P/32], "w2_packed": ..., ...}, the
      compressed-tensors per-expert orientation [E, out, in/2], [E, out, in/32].
    """
    out = {}
    for key in EXPERT_KEYS:
        if key in experts:
            out[f"{key}_packed"], out[f"{key}_scale"] = experts_to_packed(experts[key], rule=rule, name=key)
    if not out:
        raise ValueError(f"no expert stacks among keys {sorted(experts)}; expected some of {EXPERT_KEYS}")
    return out


def import_experts_mxfp4(packed: dict, dtype=jnp.float32) -> dict:
    """Inverse of ``export_experts_mxfp4``: {"w1_packed", "w1_scale", ...} -> {"w1": [E, in, out], ...} (exact)."""
    return {key: packed_to_experts(packed[f"{key}_packed"], packed[f"{key}_scale"], dtype, name=key)
            for key in EXPERT_KEYS if f"{key}_packed" in packed}
