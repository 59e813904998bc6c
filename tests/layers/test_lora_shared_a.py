"""Shared-A routed-expert LoRA (``LoRAConfig.experts_shared_a``; k3jax/layers/lora.py): one A [in, r] per routed
stack, B per expert. The MoE block with it equals the per-expert block whose A is that one tiled over the experts
(forward and every gradient), its merged weight is every expert's, and its leaves get a matrix optimizer rule and a
sharding without the expert axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.config import ConfigError, LoRAConfig, get_preset
from k3jax.layers.lora import adapter_names, add_adapters
from k3jax.layers.moe import MoE
from k3jax.ops.lora import lora_weight, shares_a
from k3jax.optim.optimizer import leaf_rule
from k3jax.testing import TOL, assert_close

D, E, F, R, TOP_K = 32, 8, 48, 4, 2
STACKS = ("w1", "w3", "w2")


def _moe(shared_a: bool):
    moe = MoE(d=D, num_experts=E, expert_hidden=F, num_shared=1, latent=None, latent_norm=False,
              rngs=nnx.Rngs(0))
    add_adapters(moe.experts, rank=R, scale=2.0, rngs=nnx.Rngs(1), shared_a=shared_a)
    return moe


def test_shared_a_leaves_and_init():
    per, shared = _moe(False).experts, _moe(True).experts
    for name in STACKS:
        na, nb = adapter_names(name)
        a, a_e = getattr(shared, na), getattr(per, na)
        w = getattr(shared, name)
        assert a.shape == a_e.shape[1:] == (w.shape[1], R)                       # one expert's A, no expert axis
        assert tuple(a.get_metadata()["axes"]) == tuple(a_e.get_metadata()["axes"])[1:]
        assert getattr(shared, nb).shape == getattr(per, nb).shape == (E, R, w.shape[2])
        bound = 1 / np.sqrt(w.shape[1])                                         # PEFT's kaiming bound, per expert
        assert 0.5 * bound < float(jnp.max(jnp.abs(a[...]))) <= bound
        assert not np.any(np.asarray(getattr(shared, nb)[...]))                 # B = 0: a fresh adapter is the base


def _pair():
    """(shared-A block, per-expert block with that A tiled over E), both with the same random nonzero B."""
    shared, per = _moe(True), _moe(False)
    rng = np.random.default_rng(3)
    for name in STACKS:
        na, nb = adapter_names(name)
        b = jnp.asarray(0.3 * rng.standard_normal(getattr(shared.experts, nb).shape), jnp.float32)
        getattr(shared.experts, nb)[...] = b
        getattr(per.experts, nb)[...] = b
        a = getattr(shared.experts, na)[...]
        getattr(per.experts, na)[...] = jnp.broadcast_to(a, (E, *a.shape))
    return shared, per


def _fwd_grad(moe, x, ct):
    """y and the VJP of ``ct`` w.r.t. x and the block's parameters (a pure dict)."""
    graph, state = nnx.split(moe)

    def f(x, params):
        return nnx.merge(graph, params)(x, top_k=TOP_K, act="situ")[0]

    y, vjp = jax.vjp(f, x, state.to_pure_dict())
    return y, vjp(ct)


def test_shared_a_equals_per_expert_a_tiled():
    """The same products (each row's x A, then its expert's B), so the forward and dx, dB and the base's gradients
    agree, and the shared A's gradient is the sum of the tiled A's over the experts. Not bit for bit: the shared
    A's x A is one [rows, in] x [in, r] product where the per-expert path runs one product per row tile, and
    XLA:CPU's dot sums those in another order (max |diff| seen 2.1e-7 on y, 9.5e-7 on dB; 0 everywhere but dA
    when A is broadcast per tile instead). Tolerance fp32_shallow (1e-6 rel-RMS)."""
    shared, per = _pair()
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 16, D)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((2, 16, D)), jnp.float32)
    y_s, (dx_s, g_s) = jax.jit(lambda x, ct: _fwd_grad(shared, x, ct))(x, ct)
    y_t, (dx_t, g_t) = jax.jit(lambda x, ct: _fwd_grad(per, x, ct))(x, ct)
    base = nnx.merge(*nnx.split(_moe(True)))(x, top_k=TOP_K, act="situ")[0]   # B = 0
    assert float(jnp.max(jnp.abs(y_s - base))) > 1e-2                             # the adapters do something
    tol = TOL["fp32_shallow"]
    assert_close(y_s, y_t, tol, name="y")
    assert_close(dx_s, dx_t, tol, name="dx")
    ex_s, ex_t = g_s["experts"], g_t["experts"]
    for name in STACKS:
        na, nb = adapter_names(name)
        assert_close(ex_s[nb], ex_t[nb], tol, name=f"d{nb}")
        assert_close(ex_s[name], ex_t[name], tol, name=f"d{name}")
        assert ex_s[na].shape == ex_t[na].shape[1:]
        assert_close(ex_s[na], ex_t[na].sum(0), tol, name=f"d{na}")
    for k in ("router", "shared"):
        for a, b in zip(jax.tree.leaves(g_s[k]), jax.tree.leaves(g_t[k]), strict=True):
            assert_close(a, b, tol, name=k)


@pytest.mark.parametrize("lead", [(), (3,)], ids=["layer", "stacked-group"])
def test_merged_weight_of_a_shared_a_is_every_experts(lead):
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((*lead, E, D, F)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((*lead, D, R)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((*lead, E, R, F)), jnp.float32)
    assert shares_a(w.shape, a.shape, b.shape)
    tiled = jnp.broadcast_to(a[..., None, :, :], (*lead, E, D, R))
    assert not shares_a(w.shape, tiled.shape, b.shape)
    np.testing.assert_array_equal(lora_weight(w, a, b, 0.5), lora_weight(w, tiled, b, 0.5))
    # a per-leaf factorisation (a KDA projection [D, N, H]) is never read as shared
    assert not shares_a((D, 4, 8), (D, R), (R, 4, 8))


def test_shared_a_is_a_matrix_for_muon_and_not_split_over_experts():
    """Muon (non-LoRA optimizers would see it too) orthogonalizes the shared A as one matrix, and the per-expert B
    per expert; the sharding rules keep the expert axis off A (the k3-tiny tree, strategy ep on expert=4)."""
    from k3jax.config import default_run
    from k3jax.model import abstract_params
    from k3jax.sharding.rules import param_specs

    path = lambda *k: tuple(jax.tree_util.DictKey(x) for x in k)  # noqa: E731
    a = jax.ShapeDtypeStruct((D, R), jnp.float32)
    assert leaf_rule(path("layers", "moe", "experts", "w1_lora_a"), a)[:2] == leaf_rule(path("mlp", "w_up"), a)[:2]
    b = jax.ShapeDtypeStruct((E, R, F), jnp.float32)
    assert leaf_rule(path("layers", "moe", "experts", "w1_lora_b"), b)[1].reduction_axis == 1
    cfg = get_preset("k3-tiny")
    lora = LoRAConfig(rank=R, targets=("experts",), experts_shared_a=True)
    params = abstract_params(cfg, default_run(cfg).replace(lora=lora))
    specs = param_specs(cfg, "ep", {"data": 2, "expert": 4}, params)
    leaves = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda s: isinstance(s, P))}
    a_specs = [s for k, s in leaves.items() if k.endswith("['w1_lora_a']")]
    b_specs = [s for k, s in leaves.items() if k.endswith("['w1_lora_b']")]
    assert a_specs and all("expert" not in jax.tree.leaves(tuple(s)) for s in a_specs), a_specs
    assert b_specs and all(s[0] == "expert" for s in b_specs), b_specs


@pytest.mark.parametrize("kw,msg", [
    ({"targets": ("attn",), "experts_shared_a": True}, "experts_shared_a"),
    ({"experts_shared_a": "yes"}, "experts_shared_a"),
], ids=["no-experts-target", "not-a-bool"])
def test_bad_shared_a_config_names_the_field(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        LoRAConfig(**kw)


def test_plan_counts_the_smaller_a_and_the_same_adapter_flops(monkeypatch):
    """``k3 plan``'s estimate counts the leaves it is given: a shared A holds 1/E of the per-expert A's parameters,
    but each of a token's top-k rows still runs an [in, r] A, so the active adapter parameters (the FLOPs) match."""
    from k3jax.config import default_run
    from k3jax.model import abstract_params
    from k3jax.plan import estimate

    cfg = get_preset("k3-tiny")
    trees = {s: abstract_params(cfg, default_run(cfg).replace(lora=LoRAConfig(rank=R, experts_shared_a=s)))
             for s in (False, True)}
    size = {s: sum(np.prod(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(t)
                   if jax.tree_util.keystr(p).endswith("_lora_a']") and "experts" in jax.tree_util.keystr(p))
            for s, t in trees.items()}
    assert size[False] == cfg.num_experts * size[True]
    active = {}
    for s, t in trees.items():
        monkeypatch.setattr(estimate, "plan_params", lambda cfg, spec, t=t: t)
        active[s] = estimate.lora_active_params(cfg, None)
    assert active[True] == active[False]
