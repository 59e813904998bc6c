"""The shared seed init: a parameter with the same path, shape and kind of init starts from the same values in every
arm; a leaf whose init differs by arm (KDA's A_log: safe vs softplus gate) keeps each arm's own; arms with different
layer kinds share the layers they have in common."""

import jax
import numpy as np

from k3jax.ablate.resolve import load_spec
from k3jax.ablate.same_init import arm_params, init_summary, same_kind, sharing_plan, write_seed_checkpoint
from k3jax.model import init_params
from k3jax.model.layout import unstack
from k3jax.pytree import key_names

HEAD = """
seeds = 1
[base]
preset = "k3-tiny"
model = { num_layers = 2, full_attn_layers = [2], attn_res_block_size = 1 }
train = { batch = 4, seq_len = 32 }
[budget]
steps = 1
[data]
max_bytes = 100000
[eval]
windows = 4
"""


def _spec(tmp_path, factor):
    p = tmp_path / "s.toml"
    p.write_text(HEAD + factor)
    return load_spec(str(p))


def _view(params, cfg):
    return {key_names(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(unstack(params, cfg))[0]}


def _inits(spec, tmp_path, seed=0):
    plan = sharing_plan(spec.runs)
    path = str(tmp_path / f"seed-{seed}.npz")
    write_seed_checkpoint(path, spec.runs, plan, seed)
    with np.load(path) as z:
        return plan, {rid: arm_params(a, plan, z) for rid, a in spec.runs.items()}


def test_kda_gate_arms_share_everything_but_a_log(tmp_path):
    spec = _spec(tmp_path, '[[factor]]\nname = "kda_gate"\n')
    plan, p = _inits(spec, tmp_path)
    base, soft = spec.runs["base"], spec.runs["kda_gate=softplus"]
    vb, vs = _view(p["base"], base.cfg), _view(p["kda_gate=softplus"], soft.cfg)
    differ = sorted(k for k in vb if not np.array_equal(vb[k], vs[k]))
    assert differ == [("layers", 0, "kda", "A_log")]
    assert not vb[differ[0]].any()  # safe gate: A_log = 0
    # the softplus arm keeps its own A_log draw (log U(1, 16)), and the base is exactly its native init
    native_soft = _view(init_params(soft.cfg, jax.random.key(0), soft.run), soft.cfg)
    np.testing.assert_array_equal(vs[differ[0]], native_soft[differ[0]])
    assert np.all((vs[differ[0]] > 0) & (vs[differ[0]] < np.log(16)))
    native_base = init_params(base.cfg, jax.random.key(0), base.run)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p["base"]), jax.tree.leaves(native_base)))
    # without the shared init the softplus arm's extra draw would shift every later leaf of its own stream
    assert not np.array_equal(native_soft[("layers", 0, "kda", "w_beta")], vb[("layers", 0, "kda", "w_beta")])
    s = init_summary(spec.runs, plan, soft)
    assert s["own_leaves"] == ["layers/0/kda/A_log"] and s["from_base"] == s["params"] - 2


def test_different_layer_kinds_share_the_common_layers(tmp_path):
    body = """
[[factor]]
name = "mix"
keys = ["model.full_attn_layers"]
varies = ["params", "active_params"]
[factor.levels]
k3 = {}
all_kda = { model = { full_attn_layers = [] } }
"""
    spec = _spec(tmp_path, body)
    _, p = _inits(spec, tmp_path, seed=3)
    a, b = spec.runs["base"], spec.runs["mix=all_kda"]
    va, vb = _view(p["base"], a.cfg), _view(p["mix=all_kda"], b.cfg)
    common = set(va) & set(vb)
    assert ("layers", 1, "kda", "wq") in vb and ("layers", 1, "mla", "kv_a") in va
    assert ("embed",) in common and ("layers", 0, "kda", "wq") in common and ("layers", 1, "moe", "router") in common
    assert all(np.array_equal(va[k], vb[k]) for k in common)
    # the structure is the arm's own (its stacked layout), so the train loop can take it as it is
    assert jax.tree.structure(p["mix=all_kda"]) == jax.tree.structure(init_params(b.cfg, jax.random.key(0), b.run))


def test_same_kind():
    rng = np.random.default_rng(0)
    assert same_kind(("constant", "ab"), ("constant", "ab")) and not same_kind(("constant", "ab"), ("constant", "b"))
    assert not same_kind(("constant", "ab"), ("random", 0.0, 1.0, 10))
    x, y, z = (s * rng.standard_normal(4000) for s in (0.02, 0.02, 0.05))
    sig = [("random", float(v.mean()), float(v.std()), v.size) for v in (x, y, z)]
    assert same_kind(sig[0], sig[1]) and not same_kind(sig[0], sig[2])
