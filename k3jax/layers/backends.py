"""The one place layers reach Pallas kernels (docs/design.md §2: ops → pallas_kernels → layers/backends.py only).

Kernels are imported lazily, so the XLA paths never import Pallas. Off-GPU the KDA kernel runs in interpret mode; so
does the MXFP4 grouped matmul on CPU (off GPU/TPU the packed experts run the XLA loop of k3jax/ops/packed_experts.py
unless the "ragged" dispatch asks for the kernel).
"""

from __future__ import annotations

from k3jax.errors import InputError
from pallas_kernels.platform import target_platform


def kda_chunk_pallas(q, k, v, g, beta, *, scale, initial_state, chunk_size, gate_lower_bound, segment_ids=None):
    """Chunked KDA forward as a Pallas kernel (custom VJP through the jnp chunked path); see pallas_kernels/kda.
    ``segment_ids`` [B, T]: packed documents, each from a zero state (``k3jax.ops.segments``)."""
    from pallas_kernels.kda import kda_chunk  # Pallas: imported lazily, so the XLA paths never import Pallas

    docs = {} if segment_ids is None else {"segment_ids": segment_ids}
    return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                     gate_lower_bound=gate_lower_bound, **docs)


def _kernel_input(kernel: str, call):
    """``call()``, a kernel's own refusal of its arguments (a ValueError: a shape or block it cannot tile) turned into
    the InputError of the run setting that asked for it (`k3` exits 2 naming the kernel and the reason)."""
    try:
        return call()
    except InputError:
        raise
    except ValueError as e:
        raise InputError(f"--kernels pallas: the {kernel} kernel cannot run here: {e}") from e


def mla_flash(q, c_kv, k_rope, w_uk, w_uv, *, scale, block_size: int, segment_ids=None, key_segment_ids=None,
              q_offset=None, cost_offset: int | None = None):
    """Causal attention of q [B, T, N, Hn+Hr] over the MLA latent (c_kv [B, T, R], the shared key slice k_rope
    [B, T, Hr], W_UK [R, N, Hn] / W_UV [R, N, V]) as a Pallas flash kernel with a custom VJP (pallas_kernels/mla:
    keys up-projected per key block, no work above the diagonal) → (o [B, T, N, V], max_logit [B, N]); the contract
    of ``ops.attention.causal_attention`` over the up-projected keys (``segment_ids``, ``key_segment_ids``,
    ``q_offset`` alike; ``cost_offset``: the offset its cost estimate charges for a traced one). Interpreted on a CPU
    (inside ``shard_map``, the TPU interpreter)."""
    from pallas_kernels.mla import mla_flash as flash  # Pallas, lazily (the module docstring)

    target = kernel_target()
    return _kernel_input("MLA flash", lambda: flash(
        q, c_kv, k_rope, w_uk, w_uv, scale=scale, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
        q_offset=q_offset, block_k=block_size, platform=target, interpret=target == "cpu", cost_offset=cost_offset))


def mla_decode(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, q_pos, kv_len, scale, layer=None):
    """Absorbed attention of up to 8 query tokens per row over an MLA latent cache as a Pallas split-KV kernel
    (pallas_kernels/mla): the contract of ``ops.latent_attention.latent_attention(absorbed=True)``. Interpreted on a
    CPU."""
    from pallas_kernels.mla import mla_decode as decode  # Pallas, lazily (the module docstring)

    target = kernel_target()
    return _kernel_input("MLA decode", lambda: decode(
        q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos=q_pos, kv_len=kv_len, scale=scale, layer=layer,
        platform=target, interpret=target == "cpu"))


def kda_decode_step(*, scale: float):
    """KDA's one-token decode step as a TPU kernel, f(q, k, v, g, beta, states, layer) → (o, states): the layer's
    slice of the stacked state [L, B, N, K, V] read once and written once in place (pallas_kernels/kda/step.py) —
    or None where it does not run: a GPU target (the kernel has no Triton schedule; XLA's step runs there).
    Interpreted on a CPU. A shape it cannot tile is the InputError of ``--kernels pallas`` (``_kernel_input``)."""
    if kernel_target() == "gpu":
        return None
    from pallas_kernels.kda.step import kda_step  # Pallas, lazily (the module docstring)

    def step(q, k, v, g, beta, states, layer):
        target = kernel_target()     # here: inside a shard_map the mesh it runs under names the device
        return _kernel_input("KDA decode step", lambda: kda_step(q, k, v, g, beta, states, layer, scale=scale,
                                                                  interpret=target == "cpu"))
    return step


def kernel_target() -> str:
    """The platform being compiled for ('cpu', 'gpu' or 'tpu'): the current (abstract) mesh's device, else the
    default backend (``pallas_kernels.platform.target_platform``)."""
    return target_platform()


def expected_load(tokens: float, top_k: int, num_experts: int, local_experts: int, max_rows: int | None = None) -> dict:
    """{"rows", "groups", "idle"}: the expected routed rows and distinct experts reached on a device holding
    ``local_experts`` of ``num_experts`` when ``tokens`` tokens pick ``top_k`` each (uniform routing; an upper bound
    on the distinct experts of the average device for any router), and the chance that none is: the
    ``expected_load`` of ``mxfp4_gmm`` / ``mxfp4_glu_ffn`` / ``mxfp4_glu_ffn_rows``
    (pallas_kernels/mxfp4_matmul/cost.py); at most ``max_rows`` rows (an exchange's receive buffer)."""
    from pallas_kernels.mxfp4_matmul.cost import expected_load as load  # Pallas package, lazily (module docstring)

    out = load(tokens, top_k, num_experts, local_experts)
    return out if max_rows is None else {**out, "rows": min(out["rows"], max_rows)}


def mxfp4_gmm(x, packed, scale, group_sizes, *, platform: str | None = None, expected_load: dict | None = None):
    """Grouped MXFP4 matmul y [M, N] = x [M, K] @ W_gᵀ per expert group (packed uint8 [G, N, K/2], scale uint8
    [G, N, K/32]; rows sorted by group; output in x.dtype), with pallas_kernels/mxfp4_matmul's block sizes; its VJP
    with respect to x is the kernel's transposed form. ``platform``: whose schedule and tiles (None: the platform
    being compiled for). Compiled for a GPU/TPU target; for a CPU target a Pallas interpreter runs it (inside
    ``shard_map`` the TPU one), so ``platform="tpu"`` runs the TPU schedule on CPU, inside ``shard_map`` too
    (``ExpertParallel(packed_kernel="pallas")``). The packed experts' "sorted" dispatch never runs it on CPU: it
    takes the XLA loop of k3jax/ops/packed_experts.py. ``expected_load``: the caller's {"rows", "groups"} per call
    (``expected_load``), for the kernels' cost estimates only (None: every static tile is charged)."""
    from pallas_kernels.mxfp4_matmul import mxfp4_gmm as gmm  # Pallas, lazily (the module docstring)

    target = kernel_target()
    load = expected_load or {}
    return gmm(x, packed, scale, group_sizes, platform=platform or target, interpret=target == "cpu",
               expected_rows=load.get("rows"), expected_groups=load.get("groups"))


def mxfp4_glu_ffn(x, w1, w3, w2, group_sizes, act, *, act_quant=None, acc=None, platform: str | None = None,
                  expected_load: dict | None = None, rows=None, copies: int = 1):
    """The grouped GLU FFN of MXFP4 expert stacks (``PackedWeight`` pairs w1, w3 [G, F, P/2 | P/32], w2 [G, P, F/2 |
    F/32]) over expert-sorted rows x [R, P]: the three grouped kernels of ``mxfp4_gmm`` run in tile space, the rows
    padded into per-expert tiles once (pallas_kernels/mxfp4_matmul/ffn.py); output in x.dtype, VJP with respect to
    x by the transposed kernel. ``platform``, the interpreter on CPU, ``expected_load``: as ``mxfp4_gmm``; ``rows``,
    ``copies``: the gather form (x a table of tokens; the kernel module's docstring)."""
    import jax.numpy as jnp

    from pallas_kernels.mxfp4_matmul import mxfp4_glu_ffn as ffn  # Pallas, lazily (the module docstring)

    target = kernel_target()
    load = expected_load or {}
    return ffn(x, tuple(w1), tuple(w3), tuple(w2), group_sizes, act, act_quant=act_quant,
               acc=jnp.float32 if acc is None else acc, platform=platform or target, interpret=target == "cpu",
               expected_rows=load.get("rows"), expected_groups=load.get("groups"), rows=rows, copies=copies)


def mxfp4_glu_ffn_rows(x, ids, weights, w1, w3, w2, act, *, act_quant=None, platform: str | None = None,
                       expected_load: dict | None = None):
    """The routed experts of a small batch in one TPU kernel: Σ_a weights[n, a] · FFN_{ids[n, a]}(x[n]) → fp32
    [N, P] over ``PackedWeight`` stacks (ids ≥ G: none), the token table on chip and each selected expert over its
    routed rows, combined there (pallas_kernels/mxfp4_matmul/rows.py) — or None where it does not apply: a target
    other than TPU (the kernel has no GPU schedule), an ``act_quant`` that is not an MXFP8 rule (``mx.ActQuant``), or
    more token rows than the kernel keeps on chip (``rows.MAX_ROWS``). ``platform``, the interpreter on CPU,
    ``expected_load``: as ``mxfp4_gmm``."""
    from pallas_kernels.mxfp4_matmul import rows  # Pallas, lazily (module docstring)

    target = kernel_target()
    rule = getattr(act_quant, "rule", None)
    if (platform or target) != "tpu" or (act_quant is not None and rule is None) or x.shape[0] > rows.MAX_ROWS:
        return None
    load = expected_load or {}
    return rows.mxfp4_glu_ffn_rows(x, ids, weights, tuple(w1), tuple(w3), tuple(w2), act, act_quant_rule=rule,
                                   interpret=target == "cpu", expected_rows=load.get("rows"),
                                   expected_groups=load.get("groups"), idle=load.get("idle", 0.0))


def glu_mxfp8(a, b, act, dtype, rule: str, *, acc=None):
    """The GLU hidden act(a, b) with its MXFP8 fake-quant fused (pallas_kernels/glu_quant): h rounded to ``dtype``
    and quantized in one pass over a and b, straight-through — ``mx.ActQuant.glu``'s contract. A TPU kernel: the
    target is read where the hidden is computed (inside ``shard_map`` the mesh's device, as the packed-expert kernels
    read it); elsewhere None, and ``glu_hidden`` runs the unfused XLA form (Pallas is not imported). Also None for a
    hidden width that is not a multiple of 128 (the lane tiles its Mosaic compile is checked at; the unfused form
    takes any width, a short last block included)."""
    if kernel_target() != "tpu" or a.shape[-1] % 128:
        return None
    import jax.numpy as jnp

    from pallas_kernels.glu_quant import glu_mxfp8 as fused  # Pallas, lazily (the module docstring)

    return fused(a, b, act, dtype, rule, acc=jnp.float32 if acc is None else acc, platform="tpu")


def act_quant_mxfp8(rule: str):
    """The MoE layers' MXFP8 fake-quant of the experts' GEMM inputs (``mx.ActQuant``), carrying the fused GLU +
    quant kernel (``glu_mxfp8``) for the expert FFNs to run where the target is a TPU."""
    from k3jax.ops.mx import ActQuant

    return ActQuant(rule=rule, glu=glu_mxfp8)
