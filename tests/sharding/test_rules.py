"""Logical-axis rules as data: coverage, no doubled mesh axis, divisibility errors, goldens (docs/design.md §3.6)."""

import functools
import importlib.util
import json
import os

import jax
import pytest
from jax.sharding import PartitionSpec

from k3jax.config import get_preset
from k3jax.errors import InputError
from k3jax.model import abstract_params, layout, param_axes
from k3jax.notation import LOGICAL_AXES
from k3jax.sharding.mesh import MESH_AXES, make_mesh
from k3jax.sharding.rules import (
    RULES,
    STRATEGIES,
    IfDivides,
    get_rules,
    logical_to_spec,
    param_shardings,
    param_specs,
)

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "..", "golden", "sharding")
BIG = {"data": 2, "fsdp": 4, "expert": 32, "tensor": 8}
MESHES = {"kimi-k3": BIG, "k3-mini": {"fsdp": 2, "expert": 4, "tensor": 2}}  # every used mesh axis > 1


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_sharding_golden",
                                                  os.path.join(GOLDEN_DIR, "make_sharding_golden.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _abstract(preset):
    return get_preset(preset), abstract_params(get_preset(preset))


def _at(tree, prefix):
    for k in prefix:
        tree = tree[k]
    return tree


def _flat_specs(specs):
    return jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))[0]


def test_every_column_covers_every_logical_axis():
    for s in STRATEGIES:
        assert set(RULES[s]) == set(LOGICAL_AXES)
    assert all(v is None for v in RULES["single"].values())


@pytest.mark.parametrize("stem", sorted(_load_generator().GOLDENS))
def test_golden_specs(stem):
    gen = _load_generator()
    with open(os.path.join(GOLDEN_DIR, f"{stem}.json")) as f:
        want = json.load(f)
    got = gen.golden(stem)
    assert got["mesh"] == want["mesh"] and got["strategy"] == want["strategy"]
    assert set(got["specs"]) == set(want["specs"]), set(got["specs"]) ^ set(want["specs"])
    diff = {k: (got["specs"][k], v) for k, v in want["specs"].items() if got["specs"][k] != v}
    assert not diff, f"{len(diff)} specs changed, e.g. {list(diff.items())[:5]}; rerun make_sharding_golden.py"
    # spot checks of intent: experts over the expert axis, expert hidden over tensor; a stacked leaf leads with
    # its replicated ``layers`` axis
    assert want["specs"]["pre.3.moe.experts.w1"][0] == "expert"
    assert want["specs"]["pre.3.moe.experts.w2"][1] == "tensor"
    assert want["specs"]["groups.layers.3.moe.experts.w1"][:2] == [None, "expert"]
    assert want["specs"]["groups.layers.3.moe.experts.w2"][:3] == [None, "expert", "tensor"]


@pytest.mark.parametrize("preset", ["kimi-k3", "k3-mini"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stacked_leaf_spec_is_one_layers_spec_behind_a_replicated_layers_axis(preset, strategy):
    cfg, params = _abstract(preset)
    assert layout(cfg).groups >= 1
    assert RULES[strategy]["layers"] is None
    mesh = MESHES[preset]
    specs, axes = param_specs(cfg, strategy, mesh, params), param_axes(cfg)
    n = 0
    for prefix, layers, stacked in layout(cfg).slots():
        if not stacked:
            continue
        leaves = jax.tree_util.tree_flatten_with_path(_at(params, prefix))[0]
        slot_specs = jax.tree.leaves(_at(specs, prefix), is_leaf=lambda s: isinstance(s, PartitionSpec))
        slot_axes = jax.tree.leaves(_at(axes, prefix), is_leaf=lambda a: isinstance(a, tuple))
        for (path, x), spec, logical in zip(leaves, slot_specs, slot_axes, strict=True):
            assert logical[0] == "layers" and x.shape[0] == len(layers), (prefix, path)
            one = logical_to_spec(logical[1:], x.shape[1:], strategy, mesh)
            assert spec == (PartitionSpec(None, *one) if len(one) else PartitionSpec()), (prefix, path, spec, one)
            n += 1
    assert n


@pytest.mark.parametrize("preset", ["kimi-k3", "kimi-linear-48b"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_mesh_axis_twice_and_all_leaves_covered(preset, strategy):
    cfg, params = _abstract(preset)
    specs = param_specs(cfg, strategy, BIG, params)
    flat = _flat_specs(specs)
    assert len(flat) == len(jax.tree.leaves(params))
    for path, spec in flat:
        axes = [a for p in spec for a in ((p,) if isinstance(p, str) else (p or ()))]
        assert len(axes) == len(set(axes)), (path, spec)
        assert set(axes) <= set(MESH_AXES)
        if strategy == "single":
            assert spec == PartitionSpec()


def test_contested_axis_goes_to_first_dim():
    # moe.down [embed, latent] under fsdp: both map to fsdp; the first dim keeps it
    cfg = get_preset("k3-mini")
    specs = param_specs(cfg, "fsdp", {"fsdp": 4})
    assert specs["pre"][1]["moe"]["down"] == PartitionSpec("fsdp")
    assert specs["pre"][1]["moe"]["up"] == PartitionSpec("fsdp")
    assert specs["groups"]["layers"][0]["moe"]["down"] == PartitionSpec(None, "fsdp")  # stacked: [layers, ...]
    assert specs["groups"]["layers"][0]["moe"]["up"] == PartitionSpec(None, "fsdp")
    rules = dict(RULES["ep_tp"], head_dim="tensor")  # heads and head_dim both → tensor
    assert logical_to_spec(("embed", "heads", "head_dim"), (8, 4, 4), rules, {"tensor": 2}) == \
        PartitionSpec(None, "tensor")


def test_expert_axis_not_dividing_experts_is_an_error():
    cfg = get_preset("k3-tiny")  # 8 experts
    with pytest.raises(ValueError, match=r"'experts', size 8\).*'expert'.*3"):
        param_specs(cfg, "ep", {"data": 1, "expert": 3})


def test_rule_table_missing_an_axis_is_an_error():
    rules = {k: v for k, v in RULES["ep"].items() if k != "latent"}
    with pytest.raises(ValueError, match=r"custom rules.*'latent'"):
        get_rules(rules)
    with pytest.raises(ValueError, match="custom rules.*'latent'"):
        param_specs(get_preset("k3-tiny"), rules, {"expert": 2})
    with pytest.raises(ValueError, match="unknown logical axes"):
        get_rules(dict(RULES["ep"], bogus=None))
    with pytest.raises(ValueError, match="unknown sharding strategy"):
        get_rules("nope")


def test_parameter_without_rule_is_an_error():
    cfg = get_preset("k3-tiny")
    params = abstract_params(cfg)
    params["pre"][0]["kda"]["mystery"] = jax.ShapeDtypeStruct((4,), "float32")
    with pytest.raises(ValueError, match=r"no parameter pre\.0\.kda\.mystery in the model"):
        param_specs(cfg, "single", {}, params)


def test_make_mesh_and_shardings():
    mesh = make_mesh({"data": 2, "expert": 4})
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "context": 1, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert all(t == jax.sharding.AxisType.Explicit
               for t in make_mesh({"expert": 2}, axis_types="explicit").axis_types)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh({"pipeline": 2})
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh({"data": 4, "expert": 4})
    cfg = get_preset("k3-tiny")
    sh = param_shardings(cfg, "ep", mesh)
    w1 = sh["pre"][1]["moe"]["experts"]["w1"]
    assert w1.spec == PartitionSpec("expert") and w1.mesh is mesh


# The serve column (k3 plan's serving layouts): every projection of the non-expert weights over all chips of a
# tensor x expert mesh (heads / FFN hidden / vocab over tensor, the width over expert), the routed stacks as ep_tp
SERVE_MESHES = {"kimi-k3": [{"tensor": 4, "expert": 16}, {"tensor": 8, "expert": 8}, {"expert": 64}],
                "k3-mini": [{"tensor": 2, "expert": 4}, {"expert": 8}]}
_WIDE = ("heads", "mlp", "vocab")  # the dimensions serve puts on tensor, beside embed on expert


@pytest.mark.parametrize("preset", ["kimi-k3", "k3-mini"])
def test_serve_splits_every_projection_over_all_chips_and_divides(preset):
    cfg, params = _abstract(preset)
    axes = param_axes(cfg)
    for mesh in SERVE_MESHES[preset]:
        full = {a: mesh.get(a, 1) for a in MESH_AXES}
        specs = dict((tuple(k.key for k in p), s) for p, s in _flat_specs(param_specs(cfg, "serve", mesh, params)))
        ep_tp = dict((tuple(k.key for k in p), s) for p, s in _flat_specs(param_specs(cfg, "ep_tp", mesh, params)))
        n = 0
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
            names = tuple(k.key for k in path)
            logical, spec = _at(axes, names), specs[names]
            ways = 1
            for p in spec:
                for a in (p,) if isinstance(p, str) else (p or ()):
                    ways *= full[a]
            if "experts" in names:  # the routed stacks: as ep_tp places them
                assert spec == ep_tp[names], (names, spec)
            elif "embed" in logical and any(a in logical for a in _WIDE):
                assert ways == full["tensor"] * full["expert"], (mesh, names, spec)  # every chip holds a share
                n += 1
            elif "embed" in logical or "latent" in logical:
                assert ways % full["expert"] == 0, (mesh, names, spec)
        assert n >= 5, n


def test_serve_cannot_place_heads_over_64_tensor_ways_and_says_which_axis():
    cfg, params = _abstract("kimi-k3")
    with pytest.raises(InputError, match=r"'heads'.*'tensor'"):
        param_specs(cfg, "serve", {"tensor": 64}, params)


def test_serve_splits_the_embedding_rows_over_expert_only_where_the_vocabulary_divides():
    """Serve's vocab row is tensor, then expert where the vocabulary divides (``IfDivides``): kimi-k3's embedding on
    expert=64 has its rows split (its width slice [163840, 112] would be relaid out per step for the token gather)
    and lm_head keeps its width on expert; k3-tiny's 97 rows stay whole on expert=8 and its width takes the axis.
    A plain mesh axis on an indivisible dimension is still an error, and so is an IfDivides axis before a plain one."""
    cfg, params = _abstract("kimi-k3")
    specs = param_specs(cfg, "serve", {"expert": 64}, params)
    assert specs["embed"] == PartitionSpec("expert") and specs["lm_head"] == PartitionSpec("expert")
    assert param_specs(cfg, "serve", {"expert": 16, "tensor": 4}, params)["embed"] == PartitionSpec(
        ("tensor", "expert"))
    tiny, tiny_params = _abstract("k3-tiny")
    assert param_specs(tiny, "serve", {"expert": 8}, tiny_params)["embed"] == PartitionSpec(None, "expert")
    rules = {**RULES["serve"], "vocab": ("expert",)}
    with pytest.raises(InputError, match=r"'vocab', size 97"):
        param_specs(tiny, rules, {"expert": 8}, tiny_params)
    with pytest.raises(ValueError, match="IfDivides axis before a plain one"):
        get_rules({**RULES["serve"], "vocab": (IfDivides("expert"), "tensor")})
