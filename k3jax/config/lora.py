"""LoRA adapter settings (``RunConfig.lora``): what an adapter is, beside the architecture and the run settings of
this package; the adapters themselves live in k3jax/layers/lora.py, their file layout in k3jax/checkpoint/peft.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from k3jax.config.checks import ConfigError, need, positive_int

LORA_TARGETS = ("attn", "shared", "dense", "experts")
# how a PEFT export writes the routed experts' factors (k3jax/checkpoint/peft.py): "per-expert" nn.Linear modules
# (the release's modelling code, ``block_sparse_moe.experts.{e}.w1``), "fused" PEFT ``target_parameters`` over
# transformers 5's 3-D ``mlp.experts.gate_up_proj`` / ``down_proj``, or "auto": fused on the Kimi-Linear name-map
# layout (transformers 5's KimiLinear has no per-expert module: PEFT silently drops per-expert factors there),
# per-expert on the K3 layout
PEFT_EXPERTS = ("auto", "per-expert", "fused")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (k3jax/layers/lora.py): W x + (alpha / rank) B A x on the projections of ``targets`` —
    "attn" (KDA, MLA), "shared" / "dense" (those FFNs), "experts" (per-expert factors over each routed stack).
    ``dropout`` p in [0, 1): PEFT's LoRA dropout, W x + (alpha / rank) B A dropout(x) in training steps only (inverted
    dropout on the adapters' inputs; the base path and every evaluation, scoring or generation see x whole).
    ``experts_shared_a``: each routed stack's A is one [in, r] matrix shared by the layer's experts, B stays per
    expert [E, r, out] (needs "experts" in ``targets``); PEFT has no shared-A form, so an export copies A to every
    expert and k3jax's sidecar records the flag (k3jax/checkpoint/peft.py).
    ``peft_experts`` only picks the routed experts' layout of a PEFT export (``PEFT_EXPERTS``): it changes no
    computation, so it takes no part in equality (a run's compiled steps and an adapter's identity ignore it).
    A bad value is a ``ConfigError`` naming the field."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("attn", "shared", "experts")
    dropout: float = 0.0
    experts_shared_a: bool = False
    peft_experts: str = dataclasses.field(default="auto", compare=False)

    def __post_init__(self):
        need(self, positive_int(self.rank), "rank", "must be a positive integer")
        need(self, self.alpha > 0, "alpha", "must be > 0")
        need(self, bool(self.targets) and all(t in LORA_TARGETS for t in self.targets), "targets",
             f"must be a non-empty subset of {LORA_TARGETS}")
        need(self, isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
             and 0.0 <= self.dropout < 1.0, "dropout", "must lie in [0, 1) (the probability of dropping an input)")
        need(self, isinstance(self.experts_shared_a, bool), "experts_shared_a", "must be true or false")
        need(self, not self.experts_shared_a or "experts" in self.targets, "experts_shared_a",
             f"shares the routed experts' A: needs 'experts' in targets (targets are {self.targets})")
        need(self, self.peft_experts in PEFT_EXPERTS, "peft_experts", f"must be one of {PEFT_EXPERTS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def replace(self, **kw) -> LoRAConfig:
        return dataclasses.replace(self, **kw)

    def record(self) -> dict:
        """The settings a training run records (its resume key): the fields that change the computation
        (``compare``; an export's file layout does not); a field added after ``RECORDED`` only away from its
        default, so a run recorded before the field existed resumes unchanged."""
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.compare and (f.name in RECORDED or v != f.default):
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return d


RECORDED = ("rank", "alpha", "targets", "dropout")  # the fields every recorded run has
LORA_KEYS = ("rank", "alpha", "targets", "dropout", "experts_shared_a")  # what a --lora spec may set
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def lora_keys(text: str) -> dict:
    """The settings a ``--lora`` spec gives, ``"rank=16,alpha=32,targets=attn+shared+experts,dropout=0.05,
    experts_shared_a=true"`` (any subset) → {field: value}; a bad key or value is a ConfigError naming it (exit 2).
    The one parser of the spec: ``k3 train --lora`` and ``k3 plan --lora`` read it alike."""
    kw: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = part.partition("=")
        if not eq or key not in LORA_KEYS:
            raise ConfigError(f"--lora {part!r}: expected rank=, alpha=, targets=, dropout= or experts_shared_a=")
        if key == "experts_shared_a":
            if val.lower() not in _BOOLS:
                raise ConfigError(f"--lora experts_shared_a: expected true or false, got {val!r}")
            kw[key] = _BOOLS[val.lower()]
            continue
        try:
            kw[key] = (tuple(v for v in val.split("+") if v) if key == "targets" else
                       int(val) if key == "rank" else float(val))
        except ValueError:
            raise ConfigError(f"--lora {key}: not a number: {val!r}") from None
    return kw


def parse_lora(text: str, **defaults) -> LoRAConfig:
    """A ``--lora`` spec as a LoRAConfig: its keys over ``defaults`` over LoRAConfig's own (a bad field: a
    ConfigError naming it)."""
    return LoRAConfig(**{**defaults, **lora_keys(text)})


__all__ = ["LORA_KEYS", "LORA_TARGETS", "PEFT_EXPERTS", "LoRAConfig", "lora_keys", "parse_lora"]
