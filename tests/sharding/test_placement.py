"""Placement of a whole train state from the rules table (k3jax/sharding/placement.py), without compiling.

The full-size case places kimi-k3's optimizer state abstractly (eval_shape; no memory) on the mesh the compile
issue plans for, and checks that every parameter moment is sharded exactly like its parameter (slices of stacked
leaves included), so the optimizer never holds a replica of what the rules shard.
"""

import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from k3jax.config import get_preset
from k3jax.model import abstract_params
from k3jax.optim.optimizer import OptimConfig, make_optimizer
from k3jax.pytree import key_names
from k3jax.sharding import param_specs
from k3jax.sharding.placement import (
    batch_sharding,
    bytes_per_device,
    default_strategy,
    format_mesh,
    opt_specs,
    parse_mesh,
    token_parallel,
)
from k3jax.train.step import init_state


def test_parse_and_format_mesh():
    assert parse_mesh("data=2,expert=4") == {"data": 2, "fsdp": 1, "expert": 4, "context": 1, "tensor": 1}
    assert format_mesh(parse_mesh(" fsdp=2 , tensor=2")) == "fsdp=2,tensor=2"
    assert format_mesh(parse_mesh("data=1")) == "data=1"
    for bad, msg in [("data", "expected axis=size"), ("data=2,data=2", "given twice"), ("gpu=2", "unknown mesh"),
                     ("data=0", ">= 1"), ("data=-1", "expected axis=size")]:
        with pytest.raises(ValueError, match=msg):
            parse_mesh(bad)


@pytest.mark.parametrize("mesh, strategy", [("data=8", "fsdp"), ("fsdp=8", "fsdp"), ("data=2,expert=4", "ep"),
                                            ("expert=4,tensor=2", "ep_tp"), ("fsdp=2,expert=2,tensor=2", "fsdp_ep_tp"),
                                            ("fsdp=2,expert=4", "fsdp_ep_tp"), ("data=1", "fsdp")])
def test_default_strategy(mesh, strategy):
    assert default_strategy(parse_mesh(mesh)) == strategy


def _fraction(spec: PartitionSpec, sizes) -> int:
    return math.prod(sizes[a] for p in spec for a in ((p,) if isinstance(p, str) else (p or ())))


def test_full_size_optimizer_state_is_sharded_like_its_parameters():
    cfg = get_preset("kimi-k3")
    sizes = parse_mesh("fsdp=8,expert=64")
    params = abstract_params(cfg)
    state = jax.eval_shape(lambda p: init_state(p, make_optimizer(p, OptimConfig())[0]), params)
    p_specs = param_specs(cfg, "fsdp_ep_tp", sizes, params)
    o_specs = opt_specs(cfg, "fsdp_ep_tp", sizes, state["opt"], params)
    by_name = {key_names(path): (s, tuple(x.shape)) for (path, s), (_, x) in
               zip(jax.tree_util.tree_leaves_with_path(p_specs, is_leaf=lambda s: isinstance(s, PartitionSpec)),
                   jax.tree_util.tree_leaves_with_path(params))}
    covered, expert_moments = set(), 0
    o_leaves = jax.tree_util.tree_leaves_with_path(o_specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    for (path, spec), (_, x) in zip(o_leaves, jax.tree_util.tree_leaves_with_path(state["opt"])):
        names = key_names(path)
        hit = next(((names[i:], by_name[names[i:]]) for i in range(len(names)) if names[i:] in by_name), None)
        if hit is None:  # step counts, Newton–Schulz coefficients (per layer of the stacked group: [G, ...])
            per_layer = x.shape[1:] if names[0] == "stacked" else x.shape
            assert math.prod(per_layer) <= 64, f"{names}: unmatched and not tiny"
            continue
        pspec, pshape = hit[1]
        want = _fraction(pspec, sizes)
        assert _fraction(spec, sizes) == want, f"{names}: moment 1/{_fraction(spec, sizes)}, parameter 1/{want}"
        covered.add(hit[0])
        if "experts" in names and len(x.shape) >= 3 and x.size == math.prod(pshape):
            assert want == 512, names  # [(G,) E, latent, F]: experts over expert (64) x latent over fsdp (8)
            expert_moments += x.shape[0] if names[0] == "stacked" else 1  # layers covered by this moment
    # one Muon momentum per routed-expert stack (w1, w3, w2) of each of the 92 MoE layers (stacked ones [G, ...])
    assert expert_moments == 3 * (cfg.num_layers - cfg.first_k_dense_replace)
    # every parameter but the QB biases (no optimizer state: "frozen") has its moments placed and checked
    assert covered == {n for n in by_name if n[-2:] != ("moe", "bias")}


def test_batch_sharding_and_bytes_per_device():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    from k3jax.sharding import make_mesh

    mesh = make_mesh(parse_mesh("data=2,expert=2,tensor=2"))
    assert token_parallel("ep_tp", mesh) == 4
    sh = batch_sharding("ep_tp", mesh, 3, batch_dim=1)
    x = jax.device_put(np.zeros((2, 8, 5), np.float32), sh)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 2, 5)}
    # 2·2·5 floats of x on each device, plus a replicated 3-float vector on each; a 1-float array on device 0 only
    from jax.sharding import NamedSharding

    r = jax.device_put(np.zeros(3, np.float32), NamedSharding(mesh, PartitionSpec()))
    one = jax.device_put(np.zeros(1, np.float32), jax.devices()[0])
    assert bytes_per_device({"x": x, "r": r}) == 2 * 2 * 5 * 4 + 12
    assert bytes_per_device({"x": x, "r": r, "one": one}) == 2 * 2 * 5 * 4 + 12 + 4


def test_zero3_splits_every_weight_with_a_model_dimension_over_fsdp_and_expert():
    """zero3_ep_tp on kimi-k3, fsdp 8 x expert 64: every parameter with an embed, latent or MLA low-rank dimension
    is split 512 ways (fsdp_ep_tp splits the non-expert ones 8 ways, or not at all), the routed experts stay 512
    ways; what is left whole (KDA's f_b [rank 64, H, K] and conv taps, norms, AttnRes vectors) is 0.124 B
    parameters. The fp32 master weights per device drop from 53.2 GB to 22.2 GB, 21.3 GB of it routed experts."""
    from k3jax.model import param_axes

    cfg = get_preset("kimi-k3")
    sizes = parse_mesh("fsdp=8,expert=64")
    params = abstract_params(cfg)
    flat = lambda t: jax.tree.leaves(t, is_leaf=lambda s: isinstance(s, PartitionSpec | tuple))  # noqa: E731
    z3, fe = (flat(param_specs(cfg, s, sizes, params)) for s in ("zero3_ep_tp", "fsdp_ep_tp"))
    axes = flat(param_axes(cfg))
    per_device = {"zero3_ep_tp": 0.0, "fsdp_ep_tp": 0.0}
    whole = 0
    for x, a, s3, sf in zip(jax.tree.leaves(params), axes, z3, fe, strict=True):
        if {"embed", "latent", "q_lora", "kv_lora"} & set(a):
            assert _fraction(s3, sizes) == 512, (a, s3)
        else:
            whole += x.size
        per_device["zero3_ep_tp"] += 4 * x.size / _fraction(s3, sizes)
        per_device["fsdp_ep_tp"] += 4 * x.size / _fraction(sf, sizes)
    assert whole < 0.13e9
    experts = 4 * 2_722_740_830_208 / 512
    assert experts < per_device["zero3_ep_tp"] < experts + 1e9
    assert 53e9 < per_device["fsdp_ep_tp"] < 54e9
