"""LoRA adapter settings (``RunConfig.lora``): what an adapter is, beside the architecture and the run settings of
this package; the adapters themselves live in k3jax/layers/lora.py, their file layout in k3jax/checkpoint/peft.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3jax.config.checks import need, positive_int

LORA_TARGETS = ("attn", "shared", "dense", "experts")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (k3jax/layers/lora.py): W x + (alpha / rank) B A x on the projections of ``targets`` —
    "attn" (KDA, MLA), "shared" / "dense" (those FFNs), "experts" (per-expert factors over each routed stack).
    A bad value is a ``ConfigError`` naming the field."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("attn", "shared", "experts")
    dropout: float = 0.0

    def __post_init__(self):
        need(self, positive_int(self.rank), "rank", "must be a positive integer")
        need(self, self.alpha > 0, "alpha", "must be > 0")
        need(self, bool(self.targets) and all(t in LORA_TARGETS for t in self.targets), "targets",
             f"must be a non-empty subset of {LORA_TARGETS}")
        need(self, self.dropout == 0.0, "dropout", "not implemented (the model takes no dropout key): only 0")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


__all__ = ["LORA_TARGETS", "LoRAConfig"]
