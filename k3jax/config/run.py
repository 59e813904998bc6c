"""The run settings (``RunConfig``: how a model runs — dtypes, kernels, dispatch, QAT and its rounding rules, block
sizes, the layer stack, remat, LoRA) and the one list of each run-mode family's values, which blocks, the train loop
and the CLIs import. Which settings a named preset runs with is ``default_run`` (k3jax/config/presets.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from k3jax.config.checks import need, positive_int
from k3jax.config.lora import LoRAConfig
from k3jax.errors import InputError

MoEImpl = Literal["sorted", "ragged", "tiled", "dense"]  # = k3jax.ops.grouped_matmul.EXPERT_IMPLS' keys (tested)
KDAImpl = Literal["recurrent", "chunked", "pallas"]
# Gated MLA's attention: XLA (k3jax/ops/attention.py, k3jax/ops/latent_attention.py) or the Pallas latent-attention
# kernels (pallas_kernels/mla: flash attention over the latent for whole sequences, the absorbed split-KV kernel for
# decode steps of up to 8 tokens per row).
MLAImpl = Literal["xla", "pallas"]
# KDA's one-token decode step: XLA's update, or the Pallas TPU kernel (pallas_kernels/kda/step.py: each layer's state
# read and written once, in place in its stack). XLA's step runs on a GPU (the kernel has no Triton schedule), under
# a context split (the step is outside the sequence's shard_map) and under a row split whose heads are split over
# tensor (``RowSplit.heads_whole``: there the kernel's shard_map cost step time on the TPU compiler).
KDAStepImpl = Literal["xla", "pallas"]
# Who runs packed MXFP4 expert stacks under expert parallelism (k3jax/sharding/expert_parallel.py): "auto" the
# Pallas kernel when compiling for a GPU or TPU and the XLA tile loop for a CPU, "pallas" the kernel always (its TPU
# schedule in the interpreter on a CPU), "tiles" the XLA loop always.
PackedKernel = Literal["auto", "pallas", "tiles"]
# The umbrella choice of every kernel (``with_kernels``; `k3 ... --kernels`): auto = Pallas on GPU / TPU, XLA on CPU.
Kernels = Literal["auto", "xla", "pallas"]
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
MLA_IMPLS: tuple[str, ...] = get_args(MLAImpl)
KDA_STEP_IMPLS: tuple[str, ...] = get_args(KDAStepImpl)
PACKED_KERNELS: tuple[str, ...] = get_args(PackedKernel)
KERNELS: tuple[str, ...] = get_args(Kernels)
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
    "mla_impl": MLA_IMPLS,
    "kda_step_impl": KDA_STEP_IMPLS,
    "packed_kernel": PACKED_KERNELS,
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
    mla_impl: MLAImpl = "xla"
    kda_step_impl: KDAStepImpl = "xla"
    packed_kernel: PackedKernel = "auto"
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
# Fields added after ablation studies were shipped, with the value every run had before them: an arm's flat settings
# leave a field out at that value, so a study's fingerprint stays (k3jax/ablate/resolve.py).
LATER_RUN_FIELDS = {"mla_impl": "xla", "packed_kernel": "auto", "kda_step_impl": "xla"}
# The run settings ``--kernels`` decides: each field's value per choice. A per-op flag (``--kda-impl``,
# ``--packed-kernel``) names one of these fields and wins over it.
KERNEL_FIELDS = {"pallas": {"kda_impl": "pallas", "mla_impl": "pallas", "packed_kernel": "pallas",
                            "kda_step_impl": "pallas"},
                 "xla": {"kda_impl": "chunked", "mla_impl": "xla", "packed_kernel": "tiles", "kda_step_impl": "xla"}}
_KERNEL_NAMES = {"kda_impl": "KDA chunk", "mla_impl": "MLA latent-attention", "packed_kernel": "MXFP4 expert",
                 "kda_step_impl": "KDA decode step"}


def kernel_refusal(fld: str, platform: str, *, context: bool = False, devices: int = 1,
                   rows: bool = False) -> str | None:
    """Why the Pallas kernel behind run field ``fld`` cannot run for a command on ``platform`` over ``devices``
    devices (``context``: the mesh splits sequences; ``rows``: the command runs whole sequences, its dispatch splits
    them — and any cache — by row, ``sharding.placement.kernel_rows``), or None. Without a context axis the KDA and
    MLA kernels are called outside ``shard_map``, and a Mosaic or Triton call is not partitioned by the compiler: on
    a GPU or TPU they run on one device (on a CPU the interpreter's jnp is partitioned like any other). Under context
    parallelism they run inside the sequence's ``shard_map``, one call per device
    (k3jax/sharding/context_parallel.py); under a row split the MLA kernels (flash, and decode on a cache) run
    inside one over the rows (k3jax/sharding/row_split.py); the packed-expert kernel inside expert parallelism's.
    KDA's decode-step kernel runs per device under a row split too; under a context split a decode step runs XLA's
    update (the layer's ``context`` path)."""
    if fld in ("mla_impl", "kda_step_impl") and rows:
        return None
    if fld in ("kda_impl", "mla_impl", "kda_step_impl") and platform != "cpu" and devices > 1 and not context:
        return f"it runs on one {platform} device (the compiler does not partition a kernel call; {devices} devices)"
    return None


def _lora_refusal(fld: str, run: RunConfig) -> str | None:
    """Why the MLA kernel cannot serve a run whose LoRA dropout acts on the attention adapters: it takes W_UK / W_UV
    merged with their adapter (``layers.lora.merged``), which leaves no adapter input to drop."""
    lora = run.lora
    if fld == "mla_impl" and lora is not None and lora.dropout > 0 and "attn" in lora.targets:
        return "it takes kv_b merged with its LoRA adapter, and LoRA dropout acts on the attention adapters"
    return None


def kernel_choice(kernels: str, platform: str) -> str:
    """"pallas" or "xla": what ``kernels`` (``KERNELS``) prefers on ``platform`` ('cpu', 'gpu' or 'tpu', the platform
    being run or compiled for): auto is Pallas on a GPU or TPU and XLA on a CPU; pallas on a CPU runs the kernels in
    Pallas' interpreter (slow, for checking them against the XLA paths)."""
    if kernels not in KERNELS:
        raise InputError(f"--kernels {kernels!r}: unknown; known: {', '.join(KERNELS)}")
    if kernels != "auto":
        return kernels
    return "xla" if platform == "cpu" else "pallas"


def with_kernels(run: RunConfig, kernels: str, platform: str, *, context: bool = False, devices: int = 1,
                 rows: bool = False, **overrides) -> RunConfig:
    """``run`` with the kernel fields (``KERNEL_FIELDS``) that ``kernels`` picks on ``platform``, then ``overrides``
    (the per-op flags given; None values skipped), which win. Where a Pallas kernel cannot run for the command
    (``kernel_refusal``), auto takes that op's XLA path and ``kernels="pallas"`` is an InputError naming the kernel
    and the reason (never a silent fallback). XLA keeps a recurrent KDA (the token-by-token form is XLA too)."""
    choice = kernel_choice(kernels, platform)
    given = {k: v for k, v in overrides.items() if v is not None}
    if kernels == "auto" and platform == "cpu":     # the run's own settings: XLA paths (packed "auto" = tiles here)
        return run.replace(**given)
    fields = dict(KERNEL_FIELDS[choice])
    if choice == "pallas":
        for fld in fields:
            why = None if fld in given else \
                kernel_refusal(fld, platform, context=context, devices=devices, rows=rows) or _lora_refusal(fld, run)
            if why and kernels == "pallas":
                raise InputError(f"--kernels pallas: the {_KERNEL_NAMES[fld]} kernel cannot run here: {why}; "
                                 f"use --kernels auto or xla")
            if why:
                fields[fld] = KERNEL_FIELDS["xla"][fld]
    if fields["kda_impl"] == "chunked" and run.kda_impl == "recurrent":
        fields["kda_impl"] = "recurrent"
    return run.replace(**(fields | given))


__all__ = ["DTYPES", "KDA_IMPLS", "KDA_STEP_IMPLS", "KERNELS", "KERNEL_FIELDS", "LATER_RUN_FIELDS", "LAYER_STACKS",
           "MLA_IMPLS", "MOE_IMPLS", "PACKED_KERNELS", "QAT_MODES", "REMAT_POLICIES", "RUN_FIELDS", "SCALE_RULES",
           "RunConfig", "kernel_choice", "kernel_refusal", "with_kernels"]
