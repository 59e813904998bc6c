"""The full network: float64 NumPy parity (docs/numerics.md §15.2), causality, dispatch equivalence, AttnRes
bookkeeping, Kimi-Linear switches, full-size shapes via eval_shape, k3-mini forward + gradient."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax.layers.attn_res as ar_block
import k3jax.model.decoder as decoder
from k3jax.config import default_run, get_preset
from k3jax.model import abstract_params, forward, init_params, lm_loss, unstack
from k3jax.reference.model import ref_forward
from k3jax.testing import TOL, assert_close


def spread(params, scale=8.0):
    """Random-init weights are tiny (std 0.02); scale matrices up so every branch matters in parity tests."""
    def f(path, a):
        name = jax.tree_util.keystr(path)
        if a.ndim >= 2 and "embed" not in name:
            return a * scale
        if name.endswith("['query']"):
            return a + 0.3 * jax.random.normal(jax.random.key(len(name)), a.shape, a.dtype)
        return a
    return jax.tree_util.tree_map_with_path(f, params)


def tiny_linear():
    """A tiny Kimi-Linear-shaped config: softplus gate, low-rank gate, no q-LoRA, no MLA gate, SwiGLU, standard
    residual, standard MoE with rsf 2.446 and one shared expert."""
    return get_preset("k3-tiny").replace(
        name="kl-tiny", kda_gate_lower_bound=None, kda_full_rank_gate=False, q_lora_rank=None, mla_output_gate=False,
        hidden_act="silu", attn_res_block_size=None, routed_expert_hidden_size=None, latent_moe_use_norm=False,
        routed_scaling_factor=2.446, num_shared_experts=1, full_attn_layers=(4, 5), expert_format="bf16")


CFGS = {"k3": lambda: get_preset("k3-tiny"), "kimi-linear": tiny_linear}


@pytest.mark.parametrize("family", [f if f == "k3" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(CFGS)])
def test_fp64_and_fp32_match_numpy_reference(family, x64):
    cfg64 = CFGS[family]()
    run64 = default_run(cfg64, param_dtype="float64", compute_dtype="float64")
    params = spread(init_params(cfg64, jax.random.key(1), run64))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg64.vocab_size, (2, 13)), jnp.int32)
    want = ref_forward(unstack(params, cfg64), toks, cfg64)
    got64 = forward(params, toks, cfg64, run64)
    assert got64.dtype == jnp.float64
    assert_close(got64, want, TOL["fp64_vs_fp64"], name="float64 logits")
    run32 = run64.replace(param_dtype="float32", compute_dtype="float32")
    got32 = forward(jax.tree.map(lambda a: a.astype(jnp.float32), params), toks, cfg64, run32)
    assert_close(got32, want, TOL["fp32_vs_fp64"], name="float32 logits")


def test_causality():
    cfg = get_preset("k3-tiny")
    params = spread(init_params(cfg, jax.random.key(2)))
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 21)), jnp.int32)
    f = jax.jit(lambda t: forward(params, t, cfg))
    base = np.asarray(f(toks))
    for t in (0, 7, 20):
        changed = np.asarray(f(toks.at[0, t].set((toks[0, t] + 1) % cfg.vocab_size)))
        np.testing.assert_array_equal(changed[:, :t], base[:, :t])
        assert not np.array_equal(changed[:, t], base[:, t])


@pytest.mark.slow  # second line: tests/ops/test_routing_moe.py compares the dispatches op by op in the default suite
def test_dense_and_sorted_dispatch_agree_in_the_model(x64):
    # float64, so that any disagreement beyond rounding shows (fp32 gradient leaves differ at ~1e-5 by order alone)
    cfg = get_preset("k3-tiny")
    run = default_run(cfg, param_dtype="float64", compute_dtype="float64")
    params = spread(init_params(cfg, jax.random.key(3), run))
    toks = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    a = forward(params, toks, cfg, run, dispatch="sorted")
    b = forward(params, toks, cfg, run, dispatch="dense")
    assert_close(a, b, TOL["fp64_vs_fp64"])
    ga = jax.grad(lambda p: lm_loss(p, toks, toks, cfg, run, dispatch="sorted"))(params)
    gb = jax.grad(lambda p: lm_loss(p, toks, toks, cfg, run, dispatch="dense"))(params)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)):
        assert_close(x, y, TOL["fp64_grad"], atol_floor=TOL["fp64_grad_floor"], name=jax.tree_util.keystr(path))


def _record_attn_res(monkeypatch):
    counts = []
    real = ar_block.attn_res

    def spy(srcs, q, g, eps, **kw):
        counts.append(len(srcs))
        return real(srcs, q, g, eps, **kw)

    monkeypatch.setattr(ar_block, "attn_res", spy)
    return counts


@pytest.mark.parametrize("L,S", [(5, 2), (25, 12), (93, 12)])
def test_attn_res_source_counts(monkeypatch, L, S):
    # docs/model.md §3.2: attention AR at l >= 1 has ceil(l/S)+1 sources, MLP AR floor(l/S)+2, output = blocks + 1.
    cfg = get_preset("k3-tiny").replace(num_layers=L, attn_res_block_size=S,
                                        full_attn_layers=tuple(sorted(set(range(4, L + 1, 4)) | {L})))
    counts = _record_attn_res(monkeypatch)
    jax.eval_shape(lambda p, t: forward(p, t, cfg), abstract_params(cfg), jax.ShapeDtypeStruct((1, 4), jnp.int32))
    want = []
    for l in range(L):
        if l >= 1:
            want.append(-(-l // S) + 1)
        want.append(l // S + 2)
    want.append(len(cfg.attn_res_boundaries) + 1)
    assert counts == want
    if L == 93:
        assert max(counts) == 9 and counts[-1] == 9 and counts[:2] == [2, 2]


def test_layer0_input_is_embedding_and_zero_queries_average(monkeypatch):
    cfg = get_preset("k3-tiny")
    params = init_params(cfg, jax.random.key(4))
    seen = {}
    real = decoder.rms_norm

    def spy(x, w, eps, **kw):
        seen.setdefault("first", x)
        return real(x, w, eps, **kw)

    monkeypatch.setattr(decoder, "rms_norm", spy)
    toks = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    forward(params, toks, cfg)
    np.testing.assert_array_equal(np.asarray(seen["first"]), np.asarray(params["embed"][toks]))


def test_full_size_kimi_k3_shapes_without_memory():
    cfg = get_preset("kimi-k3")
    out = jax.eval_shape(lambda p, t: forward(p, t, cfg), abstract_params(cfg),
                         jax.ShapeDtypeStruct((1, 16), jnp.int32))
    assert out.shape == (1, 16, 163840) and out.dtype == jnp.float32


@pytest.mark.parametrize("preset", ["k3-tiny", pytest.param("k3-mini", marks=pytest.mark.slow)])
def test_forward_and_grad_finite_and_zero_exactly_where_expected(preset):
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.key(0))
    toks = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 33)), jnp.int32)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: lm_loss(p, toks[:, :-1], toks[:, 1:], cfg)))(params)
    assert np.isfinite(float(loss)) and abs(float(loss) - np.log(cfg.vocab_size)) < 0.5
    view = unstack(grads, cfg)  # per-layer gradients (stacked leaves sliced)
    flat = jax.tree_util.tree_leaves_with_path(view)
    assert all(bool(jnp.all(jnp.isfinite(g))) for _, g in flat)
    zero = {jax.tree_util.keystr(p) for p, g in flat if float(jnp.sum(jnp.abs(g))) == 0.0}
    # No gradient reaches: the QB bias buffers (selection only); layer 0's attention AttnRes (one source: the
    # identity); and every AttnRes key-norm gain at init, because the logit is Σ κ·γ·w with zero queries w.
    expected = {f"['layers'][{l}]['moe']['bias']" for l in range(1, cfg.num_layers)}
    expected |= {f"['layers'][{l}]['{k}']['gain']" for l in range(cfg.num_layers) for k in ("attn_res", "mlp_res")}
    expected |= {"['layers'][0]['attn_res']['query']", "['out_res']['gain']"}
    assert zero == expected


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_preset("k3-tiny").hidden_size = 3


# ------------------------------------------------------------------------------------------- NNX / stacked layout

def test_layouts_of_the_presets():
    from k3jax.model import layout

    k3 = layout(get_preset("kimi-k3"))
    assert (k3.pre, k3.start, k3.period, k3.groups, k3.post) == ((0, 1, 2, 3), 4, 4, 22, (92,))
    mini = layout(get_preset("k3-mini"))
    assert (mini.pre, mini.groups, mini.post) == ((0, 1, 2, 3), 1, (8,))
    for name in ("kimi-k3", "k3-mini", "k3-tiny", "kimi-linear-48b"):
        lay = layout(get_preset(name))
        placed = sorted([*lay.pre, *lay.post, *(l for j in range(lay.period if lay.groups else 0)
                                                for l in lay.stacked_layers(j))])
        assert placed == list(range(get_preset(name).num_layers)), name


def test_stacked_leaves_lead_with_the_layers_axis():
    from k3jax.model import param_axes

    cfg = get_preset("kimi-k3")
    shapes, axes = abstract_params(cfg), param_axes(cfg)
    wq = shapes["groups"]["layers"][0]["kda"]["wq"]
    assert wq.shape == (22, 7168, 96, 128)
    assert axes["groups"]["layers"][0]["kda"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert axes["groups"]["layers"][3]["moe"]["experts"]["w1"] == ("layers", "experts", "latent", "expert_mlp")
    assert axes["pre"][0]["mlp"]["w_gate"] == ("embed", "mlp")
    for (p, s), (_, a) in zip(jax.tree_util.tree_leaves_with_path(shapes),
                              jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert len(a) == len(s.shape), jax.tree_util.keystr(p)
        assert (a[0] == "layers") == (jax.tree_util.keystr(p).startswith("['groups']")), jax.tree_util.keystr(p)


@pytest.mark.slow  # 82 s (CI's budget, session 9)
def test_unstack_restack_roundtrip_and_module_call_matches_forward():
    from flax import nnx

    from k3jax.model import K3Model, merge, restack

    cfg = get_preset("k3-mini").replace(num_experts=8, num_experts_per_token=2)
    model = K3Model(cfg, rngs=nnx.Rngs(params=jax.random.key(5)))
    params = nnx.split(model)[1].to_pure_dict()
    back = restack(unstack(params, cfg), cfg)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    toks = jnp.asarray(np.random.default_rng(4).integers(0, 256, (1, 12)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(toks)), np.asarray(forward(params, toks, cfg)))
    np.testing.assert_array_equal(np.asarray(merge(params, cfg)(toks)), np.asarray(model(toks)))
