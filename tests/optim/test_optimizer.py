"""Optimizer split (docs/model.md §9): per-head / per-expert Muon, AdamW groups, frozen QB bias, K/V split of kv_b;
stacked layer groups get one layer's rule with the ``layers`` axis as a batch axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers as MDN  # noqa: N817

from k3jax.config import PRESETS, get_preset
from k3jax.model import abstract_params, init_params, layer_view, layout, leaf_location, restack, unstack
from k3jax.optim.optimizer import MODES, OptimConfig, leaf_rule, make_optimizer
from k3jax.pytree import key_names
from k3jax.testing import TOL, assert_close

TINY = get_preset("k3-tiny")
# A model whose whole decoder is stacked: layers [KDA, MLA] × 2 groups (no dense layer, nothing pre / post).
STACKED = TINY.replace(name="k3-tiny-stacked", num_layers=4, full_attn_layers=(2, 4), first_k_dense_replace=0)


def second_update(params, grads, cfg):
    """The first schedule step has LR 0 (warmup from 0); return the second step's update."""
    tx, _ = make_optimizer(params, cfg)

    @jax.jit
    def run(params, grads):
        st = tx.init(params)
        _, st = tx.update(grads, st, params)
        return tx.update(grads, st, params)[0]

    return run(params, grads)


def rms(x):
    return float(jnp.sqrt(jnp.mean(jnp.square(x))))


def _is_rule(x):
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str)


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def at(tree, cfg, l, *names):
    """Leaf ``names`` of layer l (unstacked layers only) of a tree with the model's structure."""
    path, g = leaf_location(("layers", l, *names), cfg)
    assert g is None, "layer is stacked"
    return _get(tree, path)


def sub(p, cfg, *paths):
    """The minimal tree (the model's structure) holding only the given leaves — (layer, *names) or (name,) for a
    model-level leaf: compiles in seconds."""
    out: dict = {}
    for path in paths:
        full = ("layers", *path) if isinstance(path[0], int) else path
        where, g = leaf_location(full, cfg)
        assert g is None, "layer is stacked"
        node = out
        for k in where[:-1]:
            node = node.setdefault(k, {})
        node[where[-1]] = _get(p, where)
    return out


def put(tree, cfg, path, value):
    """``tree`` (a nested dict, changed in place) with the leaf at per-layer path ``path`` set to ``value``."""
    where, g = leaf_location(("layers", *path) if isinstance(path[0], int) else path, cfg)
    assert g is None
    _get(tree, where[:-1])[where[-1]] = value


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_parameter_has_a_rule(name):
    params = abstract_params(get_preset(name))
    rules = jax.tree_util.tree_map_with_path(lambda p, x: leaf_rule(p, x), params)
    labels = {r[0] for r in jax.tree.leaves(rules, is_leaf=_is_rule)}
    assert labels <= {"muon", "adam_decay", "adam_nodecay", "frozen"}


def test_group_table():
    assert layout(TINY).groups == 0  # every layer unstacked (the stacked case: test_stacked_leaf_*)
    p = init_params(TINY, jax.random.key(0))
    _, labels = make_optimizer(p, OptimConfig())
    L0, L3 = layer_view(labels, TINY, 0), layer_view(labels, TINY, 3)
    assert labels["embed"] == labels["lm_head"] == "adam_decay"
    assert labels["out_res"]["query"] == "adam_decay" and labels["out_res"]["gain"] == "adam_nodecay"
    assert labels["final_norm"] == "adam_nodecay"
    assert L0["attn_res"]["query"] == "adam_decay" and L0["attn_res"]["gain"] == "adam_nodecay"
    assert L0["kda"]["conv_q"] == "adam_decay" and L0["kda"]["A_log"] == L0["kda"]["dt_bias"] == "adam_nodecay"
    assert L0["kda"]["o_norm"] == L0["input_norm"] == "adam_nodecay"
    assert L0["kda"]["wq"] == L0["kda"]["wo"] == L0["mlp"]["w_gate"] == "muon"
    assert L3["mla"]["q_b"] == L3["mla"]["kv_b"] == L3["moe"]["experts"]["w2"] == L3["moe"]["router"] == "muon"
    assert L3["moe"]["bias"] == "frozen" and L3["moe"]["latent_norm"] == "adam_nodecay"


def _q_grad_with_loud_head(p, cfg, key):
    # A realistic (low-rank) gradient: a sum over 8 tokens of x_t ⊗ dy_t, with head 0's output gradient ×100.
    g = jax.tree.map(jnp.zeros_like, p)
    D, N, K = at(p, cfg, 0, "kda", "wq").shape
    kx, ky = jax.random.split(key)
    dy = jax.random.normal(ky, (8, N, K)).at[:, 0].multiply(100.0)
    put(g, cfg, (0, "kda", "wq"), jnp.einsum("td,tnk->dnk", jax.random.normal(kx, (8, D)), dy))
    return g


def test_per_head_muon_equalizes_head_update_rms():
    cfg = TINY.replace(kda_num_heads=4, kda_head_dim=16)
    p = sub(init_params(cfg, jax.random.key(0)), cfg, (0, "kda", "wq"))
    g = _q_grad_with_loud_head(p, cfg, jax.random.key(1))
    u = at(second_update(p, g, OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0)), cfg, 0, "kda", "wq")
    per_head = [rms(u[:, h]) for h in range(u.shape[1])]
    assert max(per_head) / min(per_head) < 1.1, per_head
    uf = at(second_update(p, g, OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0, mode="full")),
            cfg, 0, "kda", "wq")
    full = [rms(uf[:, h]) for h in range(u.shape[1])]
    assert max(full) / min(full) > 3.0, full  # full-matrix Muon: the loud head dominates the update


def test_per_expert_blocks_are_independent():
    p = sub(init_params(TINY, jax.random.key(0)), TINY, (1, "moe", "experts", "w1"))
    g = jax.tree.map(jnp.zeros_like, p)
    w1 = at(p, TINY, 1, "moe", "experts", "w1")
    put(g, TINY, (1, "moe", "experts", "w1"), jax.random.normal(jax.random.key(2), w1.shape).at[3].multiply(1e3))
    u = second_update(p, g, OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0))
    per_expert = [rms(x) for x in at(u, TINY, 1, "moe", "experts", "w1")]
    assert max(per_expert) / min(per_expert) < 1.1, per_expert


@pytest.mark.parametrize("split,independent", [("separate", True), ("joint", False)])
def test_kv_b_split_into_k_and_v_blocks(split, independent):
    p = sub(init_params(TINY, jax.random.key(0)), TINY, (3, "mla", "kv_b"))
    g = jax.tree.map(jnp.zeros_like, p)
    kvb = at(p, TINY, 3, "mla", "kv_b")  # [R, N, Hn + V]
    hn = kvb.shape[-1] // 2
    base = jax.random.normal(jax.random.key(3), kvb.shape)
    cfg = OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0, kvb_split=split)
    put(g, TINY, (3, "mla", "kv_b"), base)
    k_rms = rms(at(second_update(p, g, cfg), TINY, 3, "mla", "kv_b")[..., :hn])
    put(g, TINY, (3, "mla", "kv_b"), base.at[..., hn:].multiply(100.0))  # loud V block
    k_rms_loud = rms(at(second_update(p, g, cfg), TINY, 3, "mla", "kv_b")[..., :hn])
    assert (abs(k_rms_loud / k_rms - 1) < 0.05) == independent, (k_rms, k_rms_loud)


def test_frozen_bias_and_decay_groups():
    full = init_params(TINY, jax.random.key(0))
    p = sub(full, TINY, (1, "moe", "bias"), (0, "kda", "A_log"), (1, "moe", "router"), (0, "input_norm"), ("embed",))
    put(p, TINY, (1, "moe", "bias"), jnp.ones_like(at(p, TINY, 1, "moe", "bias")))
    zero = jax.tree.map(jnp.zeros_like, p)
    u = second_update(p, zero, OptimConfig(lr=1.0, total_steps=100))
    np.testing.assert_array_equal(np.asarray(at(u, TINY, 1, "moe", "bias")), 0.0)  # never touched
    assert float(jnp.max(jnp.abs(at(u, TINY, 0, "input_norm")))) == 0.0  # norms: no decay
    np.testing.assert_allclose(np.asarray(u["embed"]), -0.1 * np.asarray(p["embed"]) * 1.0, rtol=1e-5)  # decayed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["k3-mini", "kimi-k3"])
def test_stacked_leaf_gets_one_layers_rule(name, mode):
    """A stacked leaf [G, ...] is optimized per layer: whole or as a slice (path ending in its stack index), its
    rule is the rule of each of its layers as an unstacked leaf."""
    cfg = get_preset(name)
    lay = layout(cfg)
    assert lay.groups >= 1
    params = abstract_params(cfg)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    stacked = [(p, x) for p, x in flat if key_names(p)[0] == "groups"]
    assert stacked
    for path, x in stacked:
        names = key_names(path)
        assert x.shape[0] == lay.groups, names
        one = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        rule = leaf_rule(path, x, mode)
        assert leaf_rule((*names, 0), one, mode) == rule, names  # the slice make_optimizer hands the transforms
        for l in lay.stacked_layers(names[2]):  # ("groups", "layers", j, *rest): one layer's rule
            assert leaf_rule(("layers", l, *names[3:]), one, mode) == rule, names
    rule = {key_names(p)[3:]: leaf_rule(p, x, mode) for p, x in stacked if key_names(p)[2] == 0}
    if mode == "per_head":  # spelled out for the K3 group [KDA, KDA, KDA, MLA] (the MoE is in every layer)
        assert rule[("kda", "wq")][1] == MDN(reduction_axis=0, output_axis=2)
        assert rule[("kda", "wo")][1] == MDN(reduction_axis=(0, 1), output_axis=2)
        assert rule[("moe", "experts", "w1")][1] == MDN(reduction_axis=1, output_axis=2)
        assert rule[("moe", "router")][1] == MDN(reduction_axis=0, output_axis=1)
        assert rule[("moe", "bias")][0] == "frozen"
        kvb_path, kvb = next((p, x) for p, x in stacked if key_names(p)[2:] == (lay.period - 1, "mla", "kv_b"))
        _, dn, shape = leaf_rule(kvb_path, kvb)
        G, r, n, hx = kvb.shape
        assert dn == MDN(reduction_axis=0, output_axis=3) and shape == (r, n, 2, hx // 2)


def _random_like(tree, seed):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("mode", [m if m == "per_head" else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_stacked_step_equals_per_layer_steps(x64, mode):
    """Two optimizer updates of the stacked tree equal the updates of its per-layer view: the transforms run on the
    layer slices, so each layer gets its own Newton–Schulz, as unstacked.

    In float64, so that only XLA's code generation may differ (a slice at an offset in a stacked buffer vs a
    separate argument). Measured on CPU with this 2-group config: per_head 57 of 61 leaves bitwise, the rest
    rel_rms <= 1.4e-14; AdamW 61 of 61 bitwise; in float32 the same 4 leaves differ by <= 6.5e-6 (a batched
    Newton–Schulz over [G, ...], used before, left ~half the fp32 Muon leaves different by up to ~1e-5). With one
    group (k3-mini) the 20-step run is bitwise the pre-NNX one (experiments/LOG.md)."""
    lay = layout(STACKED)
    assert lay.groups == 2 and lay.pre == () and lay.post == ()
    params = jax.tree.map(lambda x: x.astype(jnp.float64), init_params(STACKED, jax.random.key(0)))
    grads = _random_like(params, 1)
    cfg = OptimConfig(lr=1.0, total_steps=100, mode=mode)
    u_stacked = second_update(params, grads, cfg)
    u_view = second_update(unstack(params, STACKED), unstack(grads, STACKED), cfg)
    flat = lambda t: {key_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}  # noqa: E731
    got, want = flat(u_stacked), flat(restack(u_view, STACKED))
    assert set(got) == set(want) and len(got) == len(jax.tree.leaves(params))
    for path, a in got.items():
        assert a.dtype == jnp.float64 and a.shape == want[path].shape, path
        assert_close(a, want[path], TOL["fp64_vs_fp64"], name=".".join(map(str, path)))


def test_bad_optimizer_config():
    with pytest.raises(ValueError, match="mode"):
        OptimConfig(mode="sgd")
    with pytest.raises(ValueError, match="--opt-state-dtype 'int8'.*float dtype"):
        OptimConfig(state_dtype="int8")
    with pytest.raises(ValueError, match="--opt-state-dtype 'fp5'"):
        OptimConfig(state_dtype="fp5")


def test_bfloat16_state_stores_the_moments_and_computes_in_float32():
    """``state_dtype="bfloat16"``: every moment (Muon momentum, AdamW mu and nu, stacked and unstacked) is stored in
    bf16; counts and Newton–Schulz coefficients are untouched; each update is the fp32 optimizer's update from the
    moments rounded to bf16 — checked against an fp32 optimizer stepped from the same (rounded) state."""
    params = init_params(STACKED, jax.random.key(0))
    g1, g2 = _random_like(params, 1), _random_like(params, 2)
    low = OptimConfig(lr=1.0, total_steps=100, state_dtype="bfloat16")
    tx_low, _ = make_optimizer(params, low)
    tx32, _ = make_optimizer(params, low.replace(state_dtype="float32"))
    s_low = tx_low.init(params)
    _, s_low = jax.jit(tx_low.update)(g1, s_low, params)
    paths = jax.tree_util.tree_flatten_with_path(s_low)[0]
    moments = [x for p, x in paths if any(getattr(k, "name", None) in ("mu", "nu") for k in p)]
    others = [x for p, x in paths if not any(getattr(k, "name", None) in ("mu", "nu") for k in p)]
    assert len(moments) > len(jax.tree.leaves(params)) and all(x.dtype == jnp.bfloat16 for x in moments)
    assert all(x.dtype != jnp.bfloat16 for x in others)
    # the same step from the widened state, by the fp32 optimizer, gives the same update; its new moments round to
    # the bf16 optimizer's
    wide = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, s_low)
    u_low, s2_low = jax.jit(tx_low.update)(g2, s_low, params)
    u32, s2_32 = jax.jit(tx32.update)(g2, wide, params)
    # the two programs differ (the widening converts), so XLA:CPU may fuse and contract the same float32 arithmetic
    # differently: updates agree to ~1e-6 (seen: 1.1e-6 rel-RMS for a Muon leaf), where bfloat16 arithmetic would
    # differ by ~1e-3
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(u_low), jax.tree.leaves(u32), strict=True):
        assert_close(a, b, TOL["fp32_vs_fp64"], name=jax.tree_util.keystr(path))  # Newton–Schulz amplifies an ulp
    for a, b in zip(jax.tree.leaves(s2_low), jax.tree.leaves(s2_32), strict=True):
        assert a.dtype == b.astype(a.dtype).dtype
        assert_close(a.astype(np.float32), b.astype(a.dtype).astype(np.float32), TOL["bf16"])
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    assert nbytes(s_low) < 0.55 * nbytes(tx32.init(params))
