"""Optimizer split (SPEC §9): per-head / per-expert Muon, AdamW groups, frozen QB bias, K/V split of kv_b."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import PRESETS, get_preset
from k3jax.model import abstract_params, init_params
from k3jax.train.optim import OptimConfig, leaf_rule, make_optimizer


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


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_parameter_has_a_rule(name):
    params = abstract_params(get_preset(name))
    rules = jax.tree_util.tree_map_with_path(lambda p, x: leaf_rule(p, x), params)
    labels = {r[0] for r in jax.tree.leaves(rules, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3)}
    assert labels <= {"muon", "adam_decay", "adam_nodecay", "frozen"}


def test_group_table():
    p = init_params(get_preset("k3-tiny"), jax.random.key(0))
    _, labels = make_optimizer(p, OptimConfig())
    L0, L3 = labels["layers"][0], labels["layers"][3]
    assert labels["embed"] == labels["lm_head"] == "adam_decay"
    assert L0["attn_res"]["query"] == "adam_decay" and L0["attn_res"]["gain"] == "adam_nodecay"
    assert L0["kda"]["conv_q"] == "adam_decay" and L0["kda"]["A_log"] == L0["kda"]["dt_bias"] == "adam_nodecay"
    assert L0["kda"]["o_norm"] == L0["input_norm"] == "adam_nodecay"
    assert L0["kda"]["wq"] == L0["kda"]["wo"] == L0["mlp"]["w_gate"] == "muon"
    assert L3["mla"]["q_b"] == L3["mla"]["kv_b"] == L3["moe"]["experts"]["w2"] == L3["moe"]["router"] == "muon"
    assert L3["moe"]["bias"] == "frozen" and L3["moe"]["latent_norm"] == "adam_nodecay"


def _q_grad_with_loud_head(p, key):
    # A realistic (low-rank) gradient: a sum over 8 tokens of x_t ⊗ dy_t, with head 0's output gradient ×100.
    g = jax.tree.map(jnp.zeros_like, p)
    D, N, K = p["layers"][0]["kda"]["wq"].shape
    kx, ky = jax.random.split(key)
    dy = jax.random.normal(ky, (8, N, K)).at[:, 0].multiply(100.0)
    g["layers"][0]["kda"]["wq"] = jnp.einsum("td,tnk->dnk", jax.random.normal(kx, (8, D)), dy)
    return g


def sub(p, *paths):
    """The minimal tree holding only the given (layer, block, leaf) parameters: compiles in seconds."""
    out = {"layers": [{} for _ in p["layers"]]}
    for l, blk, leaf in paths:
        out["layers"][l].setdefault(blk, {})[leaf] = p["layers"][l][blk][leaf]
    return out


def test_per_head_muon_equalizes_head_update_rms():
    p = init_params(get_preset("k3-tiny").replace(kda_num_heads=4, kda_head_dim=16), jax.random.key(0))
    p = sub(p, (0, "kda", "wq"))
    g = _q_grad_with_loud_head(p, jax.random.key(1))
    u = second_update(p, g, OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0))["layers"][0]["kda"]["wq"]
    per_head = [rms(u[:, h]) for h in range(u.shape[1])]
    assert max(per_head) / min(per_head) < 1.1, per_head
    uf = second_update(p, g, OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0, mode="full"))
    full = [rms(uf["layers"][0]["kda"]["wq"][:, h]) for h in range(u.shape[1])]
    assert max(full) / min(full) > 3.0, full  # full-matrix Muon: the loud head dominates the update


def test_per_expert_blocks_are_independent():
    p = init_params(get_preset("k3-tiny"), jax.random.key(0))
    p = {"layers": [{}, {"moe": {"experts": {"w1": p["layers"][1]["moe"]["experts"]["w1"]}}}]}
    g = jax.tree.map(jnp.zeros_like, p)
    w1 = p["layers"][1]["moe"]["experts"]["w1"]
    g["layers"][1]["moe"]["experts"]["w1"] = jax.random.normal(jax.random.key(2), w1.shape).at[3].multiply(1e3)
    u = second_update(p, g, OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0))
    per_expert = [rms(x) for x in u["layers"][1]["moe"]["experts"]["w1"]]
    assert max(per_expert) / min(per_expert) < 1.1, per_expert


@pytest.mark.parametrize("split,independent", [("separate", True), ("joint", False)])
def test_kv_b_split_into_k_and_v_blocks(split, independent):
    p = sub(init_params(get_preset("k3-tiny"), jax.random.key(0)), (3, "mla", "kv_b"))
    g = jax.tree.map(jnp.zeros_like, p)
    kvb = p["layers"][3]["mla"]["kv_b"]  # [R, N, Hn + V]
    hn = kvb.shape[-1] // 2
    base = jax.random.normal(jax.random.key(3), kvb.shape)
    cfg = OptimConfig(lr=1.0, total_steps=100, weight_decay=0.0, kvb_split=split)
    g["layers"][3]["mla"]["kv_b"] = base
    k_rms = rms(second_update(p, g, cfg)["layers"][3]["mla"]["kv_b"][..., :hn])
    g["layers"][3]["mla"]["kv_b"] = base.at[..., hn:].multiply(100.0)  # loud V block
    k_rms_loud = rms(second_update(p, g, cfg)["layers"][3]["mla"]["kv_b"][..., :hn])
    assert (abs(k_rms_loud / k_rms - 1) < 0.05) == independent, (k_rms, k_rms_loud)


def test_frozen_bias_and_decay_groups():
    full = init_params(get_preset("k3-tiny"), jax.random.key(0))
    p = sub(full, (1, "moe", "bias"), (0, "kda", "A_log"), (1, "moe", "router"))
    p["layers"][0]["input_norm"] = full["layers"][0]["input_norm"]
    p["embed"] = full["embed"]
    p["layers"][1]["moe"]["bias"] = jnp.ones_like(p["layers"][1]["moe"]["bias"])
    zero = jax.tree.map(jnp.zeros_like, p)
    u = second_update(p, zero, OptimConfig(lr=1.0, total_steps=100))
    np.testing.assert_array_equal(np.asarray(u["layers"][1]["moe"]["bias"]), 0.0)  # never touched
    assert float(jnp.max(jnp.abs(u["layers"][0]["input_norm"]))) == 0.0  # norms: no decay
    np.testing.assert_allclose(np.asarray(u["embed"]), -0.1 * np.asarray(p["embed"]) * 1.0, rtol=1e-5)  # decayed


def test_bad_optimizer_config():
    with pytest.raises(ValueError, match="mode"):
        OptimConfig(mode="sgd")
