"""``--kernels`` (k3jax/config/run.py ``with_kernels``): what auto / xla / pallas choose per platform, the per-op
flags winning over it, auto falling back per op where a kernel cannot run and pallas refusing there (never a
silent fallback), and the fields left out of an ablation arm's settings at their old values."""

import pytest

from k3jax.config import KERNELS, RunConfig, with_kernels
from k3jax.config.lora import LoRAConfig
from k3jax.config.run import KERNEL_FIELDS, LATER_RUN_FIELDS, kernel_refusal
from k3jax.errors import InputError

BASE = RunConfig(mla_block_size=8, kda_chunk_size=16)


def _kernels(run):
    return {f: getattr(run, f) for f in KERNEL_FIELDS["xla"]}


def test_auto_is_the_runs_own_on_cpu_and_pallas_on_accelerators():
    assert with_kernels(BASE, "auto", "cpu") == BASE          # XLA paths; packed "auto" is the tile loop on a CPU
    assert _kernels(with_kernels(BASE, "auto", "gpu")) == KERNEL_FIELDS["pallas"]
    assert _kernels(with_kernels(BASE, "auto", "tpu")) == KERNEL_FIELDS["pallas"]
    assert _kernels(with_kernels(BASE, "xla", "tpu")) == KERNEL_FIELDS["xla"]
    assert _kernels(with_kernels(BASE, "pallas", "cpu")) == KERNEL_FIELDS["pallas"]   # the interpreter
    assert with_kernels(BASE, "pallas", "cpu").mla_block_size == 8                     # the rest is kept


def test_per_op_flags_win_and_recurrent_kda_stays_xla():
    run = with_kernels(BASE, "pallas", "tpu", kda_impl="chunked", packed_kernel=None, moe_impl="dense")
    assert (run.kda_impl, run.mla_impl, run.packed_kernel, run.moe_impl) == ("chunked", "pallas", "pallas", "dense")
    assert with_kernels(BASE.replace(kda_impl="recurrent"), "xla", "gpu").kda_impl == "recurrent"


def test_auto_falls_back_per_op_and_pallas_refuses_naming_the_kernel():
    # a multi-chip mesh: the KDA and MLA kernels are not partitioned by the compiler; the packed experts run inside
    # expert parallelism's shard_map
    run = with_kernels(BASE, "auto", "tpu", devices=64)
    assert (run.kda_impl, run.mla_impl, run.packed_kernel, run.kda_step_impl) == ("chunked", "xla", "pallas", "xla")
    with pytest.raises(InputError, match="KDA chunk kernel cannot run here: it runs on one tpu device"):
        with_kernels(BASE, "pallas", "tpu", devices=64)
    # under context parallelism both run inside the sequence's shard_map, one call per device
    assert _kernels(with_kernels(BASE, "pallas", "tpu", context=True, devices=64)) == KERNEL_FIELDS["pallas"]
    # whole sequences per device under a row split: the MLA kernels and KDA's decode step run per device; KDA's
    # chunk kernel stays XLA
    run = with_kernels(BASE, "auto", "tpu", devices=64, rows=True)
    assert (run.kda_impl, run.mla_impl, run.kda_step_impl) == ("chunked", "pallas", "pallas")
    with pytest.raises(InputError, match="KDA decode step kernel cannot run here: it runs on one tpu device"):
        with_kernels(BASE, "pallas", "tpu", devices=64, kda_impl="chunked", mla_impl="xla")
    assert kernel_refusal("mla_impl", "gpu", devices=8, rows=True) is None
    # LoRA dropout on the attention adapters: the MLA kernel takes kv_b merged, so auto keeps MLA on XLA
    drop = BASE.replace(lora=LoRAConfig(dropout=0.1))
    assert with_kernels(drop, "auto", "tpu", devices=64, rows=True).mla_impl == "xla"
    assert with_kernels(drop, "auto", "gpu").mla_impl == "xla"
    assert with_kernels(BASE.replace(lora=LoRAConfig(dropout=0.1, targets=("experts",))), "auto", "gpu").mla_impl == \
        "pallas"
    with pytest.raises(InputError, match="MLA latent-attention kernel cannot run here: it takes kv_b merged"):
        with_kernels(drop, "pallas", "gpu")
    # on a CPU the interpreter's jnp is partitioned like any other op
    assert with_kernels(BASE, "pallas", "cpu", devices=8).mla_impl == "pallas"
    assert kernel_refusal("packed_kernel", "tpu", context=True, devices=512) is None
    with pytest.raises(InputError, match="--kernels 'fast': unknown; known: auto, xla, pallas"):
        with_kernels(BASE, "fast", "cpu")
    assert KERNELS == ("auto", "xla", "pallas")


def test_later_fields_keep_their_old_values():
    run = RunConfig()
    assert {k: getattr(run, k) for k in LATER_RUN_FIELDS} == LATER_RUN_FIELDS
