"""The run settings (``RunConfig``: how a model runs — dtypes, kernels, dispatch, QAT and its rounding rules, block
sizes, the layer stack, remat, LoRA) and the one list of each run-mode family's values, which blocks, the train loop
and the CLIs import. Which settings a named preset runs with is ``default_run`` (k3jax/config/presets.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from k3jax.config.checks import need, positive_int
from k3jax.config.lora import LoRAConfig

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
# How an MX block's shared power-of-two scale is rounded (docs/numerics.md §10.2; k3jax/ops/mx.py implements them):
# QAT's weight and activation rules take one of these.
SCALE_RULES: tuple[str, ...] = ("floor", "ceil", "even")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64")  # param_dtype / compute_dtype
LAYER_STACKS: tuple[str, ...] = ("loop", "scan")

_RUN_CHOICES = {
    "moe_impl": MOE_IMPLS,
    "kda_impl": KDA_IMPLS,
    "qat": QAT_MODES,
    "qat_weight_rule": SCALE_RULES,
    "qat_act_rule": SCALE_RULES,
    "param_dtype": DTYPES,
    "compute_dtype": DTYPES,
    "layer_stack": LAYER_STACKS,
    "remat": REMAT_POLICIES,
}


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
        need(self, self.lora is None or isinstance(self.lora, LoRAConfig), "lora", "must be a LoRAConfig or None")
        for fld, opts in _RUN_CHOICES.items():
            need(self, getattr(self, fld) in opts, fld, f"must be one of {opts}")
        for fld in ("kda_chunk_size", "mla_block_size"):
            need(self, positive_int(getattr(self, fld)), fld, "must be a positive integer")
        need(self, self.kda_chunk_size % 16 == 0, "kda_chunk_size", "must be a multiple of the 16-token sub-chunk")

    def replace(self, **kw) -> RunConfig:
        return dataclasses.replace(self, **kw)


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))

__all__ = ["DTYPES", "KDA_IMPLS", "LAYER_STACKS", "MOE_IMPLS", "QAT_MODES", "REMAT_POLICIES", "RUN_FIELDS",
           "SCALE_RULES", "RunConfig"]
