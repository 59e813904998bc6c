"""Routed experts run from MXFP4 bytes (k3jax/ops/packed_experts.py) vs the same experts dequantized: the ops function
against a float64 dense reference (forward and dz), the model with packed experts against the model with the
dequantized float experts (logits and non-expert gradients), and the compile-time memory claim."""

import importlib.util
import pathlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.config import default_run, get_preset, k3_full_attn_layers
from k3jax.layers.experts import PACKED_DISPATCH, PackedExperts
from k3jax.layers.moe import MoE
from k3jax.model import abstract_params, layer_kind, merge
from k3jax.model.functional import packed_expert_paths
from k3jax.ops import packed_experts as pe
from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import EXPERT_IMPLS, experts_dense, experts_sorted
from k3jax.pytree import key_names, path_str
from k3jax.quant import pack_experts, pack_params
from k3jax.quant.host import mxfp4_dequantize_np
from k3jax.testing import TOL, assert_close, random_params, rel_rms

ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
M, A, E, P, F = 40, 3, 6, 64, 96


def _problem(seed: int = 0):
    """z [M, P], skewed ids [M, A] (experts 4 and 5 get nothing, expert 0 every token), gate weights, and the packed
    stacks ((w1p, w1s), (w3p, w3s), (w2p, w2s)) of random float experts."""
    k = jax.random.split(jax.random.key(seed), 6)
    z = jax.random.normal(k[0], (M, P), jnp.float32)
    pack = jax.jit(pack_experts)
    dense = [0.2 * jax.random.normal(k[i], s, jnp.float32)
             for i, s in zip((1, 2, 3), ((E, P, F), (E, P, F), (E, F, P)), strict=True)]
    others = jnp.argsort(jax.random.uniform(k[4], (M, 3)), axis=1)[:, : A - 1] + 1  # distinct, in 1..3
    ids = jnp.concatenate([jnp.zeros((M, 1), jnp.int32), others.astype(jnp.int32)], axis=1)
    wts = jax.nn.softmax(jax.random.normal(k[5], (M, A), jnp.float32))
    return z, ids, wts, [pack(w) for w in dense]


def _host_dense(packed):
    """The float64 [E, in, out] stacks, decoded by the host (NumPy table) codec: independent of the jnp decode."""
    return [np.swapaxes(mxfp4_dequantize_np(np.asarray(p), np.asarray(s)), 1, 2).astype(np.float64) for p, s in packed]


def _with_grads(fn):
    """One jitted program: (fn(z, wts), d/d(z, wts) of sum(sin(fn)))."""
    def both(z, wts):
        return fn(z, wts), jax.grad(lambda z, w: jnp.sum(jnp.sin(fn(z, w))), argnums=(0, 1))(z, wts)

    return jax.jit(both)


@pytest.mark.parametrize("impl", ["tiles", "gmm"], ids=["xla-tiles", "pallas-interpret"])
def test_packed_matches_float64_and_dequantized_reference(impl, monkeypatch, x64):
    """Forward, dz and d(gate weights) of experts_sorted_packed (f32) vs the dense float64 reference on the host-decoded
    stacks, and vs experts_sorted on the float32 dequantized stacks. The XLA loop runs F = 96 in three chunks."""
    monkeypatch.setattr(pe, "FFN_CHUNK", 32)
    assert pe.ffn_chunk(F) == 32
    z, ids, wts, packed = _problem()
    flat = [a for pair in packed for a in pair]
    gmm = None
    if impl == "gmm":
        from pallas_kernels.mxfp4_matmul import mxfp4_glu_ffn

        gmm = partial(mxfp4_glu_ffn, interpret=True)

    def packed_fn(z, wts):
        return pe.experts_sorted_packed(z, ids, wts, *flat, ACT, impl=impl, gmm=gmm)

    host = _host_dense(packed)
    z64, wts64 = np.asarray(z, np.float64), np.asarray(wts, np.float64)

    def ref64(z, wts):
        return experts_dense(z, ids, wts, *(jnp.asarray(w) for w in host), ACT)

    deq32 = [jnp.asarray(w, jnp.float32) for w in host]

    def deq_fn(z, wts):
        return experts_sorted(z, ids, wts, *deq32, ACT)

    y, g = _with_grads(packed_fn)(z, wts)
    y64, g64 = _with_grads(ref64)(z64, wts64)
    y32, g32 = _with_grads(deq_fn)(z, wts)
    assert y.dtype == jnp.float32 and y64.dtype == jnp.float64
    assert_close(y, y64, TOL["fp32_shallow"], name=f"{impl} fwd vs fp64")
    assert_close(y, y32, TOL["fp32_shallow"], name=f"{impl} fwd vs dequantized fp32")
    for name, a, b, c in zip(("dz", "dweights"), g, g64, g32, strict=True):
        assert_close(a, b, TOL["fp32_shallow"], name=f"{impl} {name} vs fp64")
        assert_close(a, c, TOL["fp32_shallow"], name=f"{impl} {name} vs dequantized fp32")


@pytest.mark.slow
def test_packed_with_activation_quant_matches_dequantized():
    """MXFP8 fake-quant of the GEMM inputs (QAT "weights+acts"): the same STE as the float path, forward and dz."""
    from k3jax.ops import mx

    z, ids, wts, packed = _problem(1)
    flat = [a for pair in packed for a in pair]
    deq = [jnp.asarray(w, jnp.float32) for w in _host_dense(packed)]
    aq = partial(mx.fake_quant_mxfp8, axis=-1, rule="ceil")
    y, (dz, _) = _with_grads(lambda z, w: pe.experts_sorted_packed(z, ids, w, *flat, ACT, act_quant=aq))(z, wts)
    y32, (dz32, _) = _with_grads(lambda z, w: experts_sorted(z, ids, w, *deq, ACT, act_quant=aq))(z, wts)
    assert_close(y, y32, TOL["fp32_shallow"], name="fwd")
    assert_close(dz, dz32, TOL["fp32_shallow"], name="dz")


def test_packed_input_checks():
    assert set(PACKED_DISPATCH) == set(EXPERT_IMPLS)  # every MoE dispatch name has a packed twin
    assert set(PACKED_DISPATCH.values()) == set(pe.PACKED_IMPLS)
    z, ids, wts, packed = _problem()
    (w1p, w1s), (w3p, w3s), (w2p, w2s) = packed
    with pytest.raises(ValueError, match="w2: expected packed uint8"):
        pe.experts_sorted_packed(z, ids, wts, w1p, w1s, w3p, w3s, w1p, w1s, ACT)
    with pytest.raises(ValueError, match="needs the grouped MXFP4 GLU FFN kernel"):
        pe.experts_sorted_packed(z, ids, wts, w1p, w1s, w3p, w3s, w2p, w2s, ACT, impl="gmm")
    with pytest.raises(ValueError, match="z \\[M, P\\] has P"):
        pe.experts_sorted_packed(z[:, :32], ids, wts, w1p, w1s, w3p, w3s, w2p, w2s, ACT)


# ---------------------------------------------------------------------------------------------------------------
# the model with packed experts


def _pack_params(params):
    """(packed params, the same experts dequantized to float32) (``quant.pack_params``; the dequantized stacks by
    the host decoder)."""
    packed = pack_params(params)

    def deq(node):
        if not isinstance(node, dict):
            return node
        if "w1_packed" in node:
            return {k: jnp.asarray(np.swapaxes(mxfp4_dequantize_np(np.asarray(node[f"{k}_packed"]),
                                                                   np.asarray(node[f"{k}_scale"])), -1, -2))
                    for k in ("w1", "w3", "w2")}
        return {k: deq(v) for k, v in node.items()}

    return packed, deq(packed)


def _is_expert(path) -> bool:
    return "experts" in key_names(path)


@pytest.mark.slow  # 20 s; the default suite covers packed == dequantized at the ops level (xla-tiles, pallas)
def test_moe_block_packed_matches_dequantized():
    """One LatentMoE block (shared expert, latent norm): packed experts (frozen PackedExperts variables) vs the same
    block with the dequantized float experts — output, and gradients w.r.t. the input and every non-expert Param."""
    D = 24
    moe = MoE(d=D, num_experts=8, expert_hidden=64, num_shared=1, latent=32, latent_norm=True, rngs=nnx.Rngs(5))
    gdef, state = nnx.split(moe)
    params = state.to_pure_dict()
    params["experts"] = jax.tree.map(lambda w: 10 * w, params["experts"])
    packed_experts, deq_experts = _pack_params(params["experts"])
    moe.experts.to_packed()
    pgdef, pstate = nnx.split(moe)
    assert {type(v) for _, v in nnx.to_flat_state(pstate["experts"])} == {PackedExperts}
    assert not nnx.state(moe, nnx.Param).get("experts")
    rest = {k: v for k, v in params.items() if k != "experts"}
    x = jax.random.normal(jax.random.key(6), (2, 9, D))
    kw = dict(top_k=3, act="situ", scaling_factor=2.5)

    def run(gdef, experts):
        def out(rest, x):
            y, _ = nnx.merge(gdef, {**rest, "experts": experts})(x, **kw)
            return y

        return jax.jit(lambda r, x: (out(r, x), jax.grad(lambda r, x: jnp.sum(jnp.sin(out(r, x))),
                                                            argnums=(0, 1))(r, x)))(rest, x)

    y, (g_rest, g_x) = run(pgdef, packed_experts)
    y_ref, (r_rest, r_x) = run(gdef, deq_experts)
    assert_close(y, y_ref, TOL["fp32_shallow"], name="y")
    assert_close(g_x, r_x, TOL["fp32_shallow"], name="dx")
    ref_flat = dict(jax.tree_util.tree_flatten_with_path(r_rest)[0])
    for path, g in jax.tree_util.tree_flatten_with_path(g_rest)[0]:
        if path_str(path) == "bias":  # the QB bias: selection only, no gradient
            assert float(jnp.max(jnp.abs(g))) == 0.0
            continue
        assert_close(g, ref_flat[path], TOL["fp32_shallow"], name=path_str(path))


def _tiny(num_layers: int):
    full = k3_full_attn_layers(num_layers) if num_layers > 2 else (num_layers,)
    return get_preset("k3-tiny", num_layers=num_layers, full_attn_layers=full)


def _packed_tiny(cfg):
    """(packed, dequantized) parameters: NumPy draws (an eager or jitted init costs 30-130 s of compile on the CI
    CPU), norm weights 1, routed experts 10x larger, so that they move the logits well above the tolerance."""
    def fix(path, a):
        name = str(key_names(path)[-1])
        return np.ones_like(a) if "norm" in name else a * 10 if _is_expert(path) else a

    params = jax.tree.map(jnp.asarray, jax.tree_util.tree_map_with_path(fix, random_params(cfg, seed=3)))
    packed, deq = _pack_params(params)
    paths = packed_expert_paths(packed)
    assert len(paths) == sum(layer_kind(cfg, l)[1] == "moe" for l in range(cfg.num_layers))  # every MoE layer
    return packed, deq


def test_stacked_group_slices_packed_experts():
    """k3-tiny at 9 layers (pre 0-3, one stacked group 4-7, post 8): the packed experts of the stacked layers are
    sliced per layer like the Params, in the torch orientation; none of them is an nnx.Param."""
    cfg = _tiny(9)
    run = default_run(cfg)

    def zeros(node):  # zero-filled leaves (structure only), the experts in the loader's packed form
        if "w1" in node:
            return {f"{n}_{part}": np.zeros((*w.shape[:-2], w.shape[-1], w.shape[-2] // d), np.uint8)
                    for n, w in node.items() for part, d in (("packed", 2), ("scale", 32))}
        return {k: zeros(v) if isinstance(v, dict) else np.zeros(v.shape, v.dtype) for k, v in node.items()}

    packed = zeros(abstract_params(cfg))
    assert ("groups", "layers", 0, "moe", "experts") in packed_expert_paths(packed)
    model = merge(packed, cfg, run)
    Pl, Fh, El = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    moe_layers = [(l, layer) for l, layer in model.layers() if hasattr(layer, "moe")]
    assert [l for l, _ in moe_layers] == list(range(1, 9))
    for l, layer in moe_layers:
        ex = layer.moe.experts
        assert ex.is_packed and not hasattr(ex, "w1")
        assert isinstance(ex.w1_packed, PackedExperts) and ex.w1_packed.shape == (El, Fh, Pl // 2), l
        assert ex.w2_scale.shape == (El, Pl, Fh // 32) and ex.w2_scale.dtype == jnp.uint8, l
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param).to_pure_dict())[0]
    assert leaves and not any(_is_expert(p) for p, _ in leaves)


def test_scanned_group_reads_packed_experts_in_place(monkeypatch):
    """k3-tiny at 9 layers on the kernel path ("ragged": the grouped FFN kernel, interpreted): the scanned group
    hands each layer's kernels the whole stacks and the layer's index (``read_in_place``), and its logits equal the
    unrolled stack's, whose layers are sliced."""
    import pallas_kernels.mxfp4_matmul.api as kapi

    cfg = _tiny(9)
    packed, _ = _packed_tiny(cfg)
    tokens = jax.random.randint(jax.random.key(4), (1, 5), 0, cfg.vocab_size)
    stacked = []
    layer_groups = kapi.layer_groups
    monkeypatch.setattr(kapi, "layer_groups", lambda tg, p, s, layer: stacked.append(
        (p.ndim, layer is not None)) or layer_groups(tg, p, s, layer))

    def logits(layer_stack):
        model = merge(packed, cfg, default_run(cfg).replace(layer_stack=layer_stack, moe_impl="ragged"))
        return jax.jit(lambda m, t: m(t))(model, tokens)

    loop = logits("loop")
    assert stacked and not any(s for _, s in stacked)             # unrolled: each layer's own [E, N, K/2]
    stacked.clear()
    scan = logits("scan")
    # the stacked group (layers 4-7, all MoE): w1, w3 and w2 of each read from [groups, E, N, K/2] at a traced
    # index; the unrolled head and tail layers (1-3, 8) their own
    assert stacked.count((4, True)) == 3 * 4 and stacked.count((3, False)) == 3 * 4, stacked
    assert_close(scan, loop, TOL["fp32_shallow"], name="logits, scan vs loop")


@pytest.mark.slow
# (9, "loop"): 224 s; (9, "scan"): 195 s, manual (CI's budget, session 9)
@pytest.mark.parametrize("num_layers,layer_stack", [(2, "loop"), pytest.param(9, "scan", marks=pytest.mark.manual)])
def test_model_with_packed_experts_matches_dequantized(num_layers, layer_stack):
    """k3-tiny, experts quantized to MXFP4 with the project's codec: the packed model's logits equal the model with
    the dequantized float experts, and so do the gradients of every non-expert parameter. 2 layers (KDA + dense FFN,
    MLA + MoE) or 9 (a stacked group, run as a loop and as a scan). Slow: each case compiles two model gradients
    (2 layers: 90 s on the loaded 2-core CI CPU); the MoE block test above is the default-suite twin."""
    cfg = _tiny(num_layers)
    run = default_run(cfg).replace(layer_stack=layer_stack)
    packed, deq = _packed_tiny(cfg)
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)

    model = merge(packed, cfg, run)
    gdef, trainable, frozen = nnx.split(model, nnx.Param, ...)
    assert not any(_is_expert(p) for p, _ in jax.tree_util.tree_flatten_with_path(trainable.to_pure_dict())[0])
    assert {type(v) for _, v in nnx.to_flat_state(frozen)} == {PackedExperts}
    assert len(nnx.to_flat_state(frozen)) == 6 * len(packed_expert_paths(packed))

    def loss(trainable, frozen):
        logits = nnx.merge(gdef, trainable, frozen)(tokens)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets)), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (l, logits), g = step(trainable, frozen)
    # the experts matter: with every scale byte 0 (W = 2^-127 · codes ≈ 0) the logits move far beyond the tolerance
    tiny = jax.tree.map(lambda v: v, frozen)
    for path, v in nnx.to_flat_state(tiny):
        if path[-1].endswith("_scale"):
            v.set_value(jnp.zeros_like(v.get_value()))
    assert rel_rms(step(trainable, tiny)[0][1], logits) > 1e3 * TOL["fp32_shallow"]

    ref_model = merge(deq, cfg, run)
    rdef, rstate = nnx.split(ref_model)

    def ref_loss(state):
        logits = nnx.merge(rdef, state)(tokens)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets)), logits

    (rl, ref_logits), rg = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(rstate)
    # f32 rounding (the loops sum in another order) compounds over the MoE layers: 2 layers stay within 1e-6, 9 layers
    # measured 1.03e-6 on the logits, so the deep cases get the fp32-vs-fp64 bound the EP model test uses
    tol = TOL["fp32_shallow"] if num_layers <= 2 else TOL["fp32_vs_fp64"]
    assert_close(logits, ref_logits, tol, name="logits")
    assert_close(l, rl, tol, name="loss")
    ref_flat = {key_names(p): v for p, v in jax.tree_util.tree_flatten_with_path(rg.to_pure_dict())[0]}
    # a leaf whose gradient is ~1e-6 of the largest one (e.g. a KDA A_log at these draws) is compared absolutely
    floor = TOL["fp32_shallow"] * max(float(jnp.max(jnp.abs(v))) for v in ref_flat.values())
    checked = 0
    for path, x in jax.tree_util.tree_flatten_with_path(g.to_pure_dict())[0]:
        r = ref_flat[key_names(path)]
        if float(jnp.max(jnp.abs(r))) == 0.0:  # the QB bias: selection only, no gradient
            assert float(jnp.max(jnp.abs(x))) == 0.0
            continue
        assert_close(x, r, TOL["fp32_vs_fp64"], atol_floor=floor, name=path_str(path))  # as the EP model test
        checked += 1
    assert checked > 20


# ---------------------------------------------------------------------------------------------------------------
# memory: compile only, XLA:CPU temp bytes


def _memory_module():
    path = pathlib.Path(__file__).parents[2] / "experiments" / "packed_expert_memory.py"
    spec = importlib.util.spec_from_file_location("packed_expert_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_memory(fig: dict) -> None:
    """The packed path's temp memory stays under a quarter of the BF16 stack; dequantize-then-matmul needs it all."""
    assert fig["packed_temp_bytes"] < 0.25 * fig["bf16_stack_bytes"], fig
    assert fig["dequant_temp_bytes"] >= fig["bf16_stack_bytes"], fig


def test_packed_experts_temp_memory_k3_shapes():
    """16 local experts of K3's latent shapes (3584 → 3072 → 3584), 256 tokens, top-16, bf16 rows: see the experiment
    script (two compiles, ~3 s: no smaller stand-in needed)."""
    mod = _memory_module()
    _check_memory(mod.memory_figures(**mod.K3_SHAPES, with_grad=False))


@pytest.mark.slow
def test_checkpoint_loaded_packed_runs_like_dequantized():
    """The shipped k3-mini checkpoint (MXFP4 experts) loaded with keep_experts_packed=True runs as it is, and its
    logits equal those of the default load (experts dequantized on the host). ~2 min: two k3-mini compiles."""
    from k3jax.checkpoint import load
    from k3jax.model import forward

    path = pathlib.Path(__file__).parents[2] / "k3jax" / "assets" / "k3-mini-stdlib"
    cfg, packed = load(str(path), keep_experts_packed=True)
    _, dense = load(str(path))
    assert packed_expert_paths(packed) and not packed_expert_paths(dense)
    tokens = jax.random.randint(jax.random.key(0), (1, 32), 0, cfg.vocab_size)
    logits = jax.jit(lambda p: forward(p, tokens, cfg))(packed)
    assert_close(logits, jax.jit(lambda p: forward(p, tokens, cfg))(dense), TOL["fp32_shallow"], name="logits")
