"""Per-expert LoRA under expert parallelism: ``ExpertParallel`` on 8 simulated CPU devices running
``LoraWeight`` stacks — over the packed MXFP4 bytes (QLoRA) or a float base — equals the one-device ``experts_lora``
and LoRA over the dequantized experts: forward and the gradients w.r.t. the rows and every adapter factor."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.ops.activations import glu_activation
from k3jax.ops.lora import LoraDropout, LoraWeight
from k3jax.ops.lora_experts import experts_lora
from k3jax.ops.packed_experts import PackedWeight, dequantize_stack
from k3jax.sharding.expert_parallel import ExpertParallel
from k3jax.sharding.mesh import make_mesh
from k3jax.testing import TOL, assert_close, emulated_ragged_all_to_all

ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
M, A, E, Pd, F, R = 64, 2, 8, 32, 64, 4


def packed_stacks(rng, shapes):
    """Random MXFP4 stacks (``PackedWeight``: any fp4 codes, E8M0 scales 2^-5 … 2^-3) for float shapes [E, in, out],
    and their dequantized floats: the bytes straight from NumPy (as tests/ops/test_lora_experts.py)."""
    packed = tuple(PackedWeight(jnp.asarray(rng.integers(0, 256, (e, o, i // 2), np.uint8)),
                                jnp.asarray(rng.integers(122, 125, (e, o, i // 32), np.uint8))) for e, i, o in shapes)
    return packed, jax.jit(lambda ws: tuple(dequantize_stack(w) for w in ws))(packed)


@pytest.fixture(scope="module")
def problem():
    """Rows, skewed routing (expert 5 on every token; shard 0's experts 0, 1 idle), gates, packed stacks, their
    dequantized floats, factors A [E, in, r] / B [E, r, out] (B nonzero), a fixed cotangent — and the one-device
    references (``experts_lora`` over the packed bytes and over the dequantized floats, the CPU tile loop)."""
    rng = np.random.default_rng(0)
    shapes = ((E, Pd, F), (E, Pd, F), (E, F, Pd))
    packed, floats = packed_stacks(rng, shapes)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    a = tuple(f32(rng.standard_normal((E, s[1], R)) / np.sqrt(s[1])) for s in shapes)
    b = tuple(f32(0.5 * rng.standard_normal((E, R, s[2]))) for s in shapes)
    ids = jnp.asarray(np.stack([np.full(M, 5), rng.choice([2, 3, 4, 6, 7], M)], axis=1), jnp.int32)
    g = np.exp(rng.standard_normal((M, A)))
    p = dict(z=f32(rng.standard_normal((M, Pd))), ids=ids, wts=f32(g / g.sum(-1, keepdims=True)), packed=packed,
             floats=floats, a=a, b=b, ct=f32(rng.standard_normal((M, Pd))))
    p["ref_packed"] = _run(partial(experts_lora, impl="tiles"), p, packed)
    p["ref_float"] = _run(partial(experts_lora, impl="tiles"), p, floats)
    return p


def _run(fn, p, ws, a=None, b=None):
    """fn's output and the VJP of p["ct"] w.r.t. the rows z and the factors A, B (jit; inputs as given)."""
    a, b = a or p["a"], b or p["b"]

    def f(z, a, b):
        return fn(z, p["ids"], p["wts"], *(LoraWeight(*t) for t in zip(ws, a, b, strict=True)), ACT)

    def both(z, a, b):
        y, vjp = jax.vjp(f, z, a, b)
        return y, vjp(p["ct"])

    return jax.jit(both)(p["z"], a, b)


def _compare(got, ref, tol, what):
    (y, (dz, da, db)), (y_ref, (dz_ref, da_ref, db_ref)) = got, ref
    assert_close(y, y_ref, tol, name=f"{what} fwd")
    assert_close(dz, dz_ref, tol, name=f"{what} dz")
    for i in range(3):
        assert_close(da[i], da_ref[i], tol, name=f"{what} dA{i}")
        assert_close(db[i], db_ref[i], tol, name=f"{what} dB{i}")


# (mesh, rules, ExpertParallel options): every exchange path the adapters ride
CASES = {
    "data2-expert4-bucketed": ({"data": 2, "expert": 4}, "ep", {"impl": "bucketed"}),
    "data2-expert4-replicated": ({"data": 2, "expert": 4}, "ep", {"replicate_tokens": True}),
    "expert4-tensor2": ({"expert": 4, "tensor": 2}, "ep_tp", {"impl": "bucketed"}),
    "data2-expert4-pallas": ({"data": 2, "expert": 4}, "ep", {"impl": "bucketed", "packed_kernel": "pallas"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ep_qlora_equals_one_device(problem, case):
    """Packed MXFP4 base + adapters under ExpertParallel (8 devices) against the one-device ``experts_lora`` over the
    bytes and over the dequantized floats (the same numbers: the tile loop decodes exactly). Tolerance fp32_shallow
    (1e-6): the per-row products are the same, only the gradient sums over rows run in another order (per-device
    partial sums, then a psum over the token axes; ep_tp also splits F: two partial sums per output, psum'd; the
    Pallas kernel sums its products in its own order; seen ≤ 2.4e-7). "replicated" is the small-batch rule
    (every device holds every row: no exchange)."""
    axes, rules, kw = CASES[case]
    ep = ExpertParallel(make_mesh(axes), rules, **kw)
    got = _run(ep, problem, problem["packed"])
    if kw.get("packed_kernel") == "pallas":  # the local experts' base products really run the grouped MXFP4 kernel
        stacks = (LoraWeight(*t) for t in zip(problem["packed"], problem["a"], problem["b"], strict=True))
        jaxpr = str(jax.make_jaxpr(partial(ep, act=ACT))(problem["z"], problem["ids"], problem["wts"], *stacks))
        assert jaxpr.count("name=mxfp4_gmm_tpu_fwd") >= 3
    _compare(got, problem["ref_packed"], TOL["fp32_shallow"], f"{case} vs one-device QLoRA")
    _compare(got, problem["ref_float"], TOL["fp32_shallow"], f"{case} vs LoRA over dequantized")


def test_ep_lora_ragged_path_with_emulated_collective(problem, monkeypatch):
    """The GPU/TPU exchange (impl="ragged", the collective emulated: XLA:CPU cannot run it) with adapters."""
    import k3jax.sharding.expert_parallel as ep_mod

    monkeypatch.setattr(ep_mod, "_ragged_all_to_all", emulated_ragged_all_to_all)
    ep = ExpertParallel(make_mesh({"data": 2, "expert": 4}), "ep", impl="ragged")
    _compare(_run(ep, problem, problem["packed"]), problem["ref_packed"], TOL["fp32_shallow"], "ragged")


def test_ep_lora_float_base_width_split_gathers_inside(problem):
    """``fsdp_ep_tp``: a float base and the factors along P (A1/A3 [E, P, r], B2 [E, r, P]) stored split over fsdp
    enter the shard_map so and are all-gathered inside; their gradients leave in that sharding (the gather's
    transpose, a reduce-scatter). Values and gradients equal the one-device float LoRA (fp32_shallow)."""
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    ep = ExpertParallel(mesh, "fsdp_ep_tp")
    assert ep.width_axes == ("fsdp",)
    put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))  # noqa: E731
    ws = tuple(put(w, "expert", *s) for w, s in zip(problem["floats"], (("fsdp",), ("fsdp",), (None, "fsdp"))))
    a_specs = (("expert", "fsdp"), ("expert", "fsdp"), ("expert",))
    b_specs = (("expert",), ("expert",), ("expert", None, "fsdp"))
    a = tuple(put(x, *s) for x, s in zip(problem["a"], a_specs, strict=True))
    b = tuple(put(x, *s) for x, s in zip(problem["b"], b_specs, strict=True))
    got = _run(ep, problem, ws, a, b)
    _compare(got, problem["ref_float"], TOL["fp32_shallow"], "fsdp width split")
    _, (_, da, db) = got
    for g, s in zip((*da, *db), (*a_specs, *b_specs), strict=True):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(*s)), g.ndim), (g.sharding, s)


@pytest.fixture(scope="module")
def shared_a(problem):
    """One A [in, r] per stack shared by the experts (``LoRAConfig.experts_shared_a``: expert 0's), and the
    one-device ``experts_lora`` over the packed bytes with it."""
    a = tuple(x[0] for x in problem["a"])
    return a, _run(partial(experts_lora, impl="tiles"), problem, problem["packed"], a=a)


@pytest.mark.parametrize("case", ["data2-expert4-bucketed", "data2-expert4-replicated", "expert4-tensor2"])
def test_ep_shared_a_equals_one_device(problem, shared_a, case):
    """A shared A enters every expert shard whole (never split over the expert axis; ep_tp splits A2's F over the
    tensor axis as the base's); its gradient, each shard's partial sum over its own experts' rows, comes back summed
    over the expert axis: equal to the one-device shared-A LoRA's, forward and every gradient (fp32_shallow)."""
    a, ref = shared_a
    axes, rules, kw = CASES[case]
    ep = ExpertParallel(make_mesh(axes), rules, **kw)
    got = _run(ep, problem, problem["packed"], a=a)
    assert all(g.shape == x.shape for g, x in zip(got[1][1], a, strict=True))   # dA [in, r]
    _compare(got, ref, TOL["fp32_shallow"], f"{case} shared A")


def test_ep_shared_a_width_split_gathers_inside(problem, shared_a):
    """``fsdp_ep_tp``: a shared A1/A3 [P, r] stored split over fsdp (its dim 0) is gathered inside the shard_map and
    its gradient leaves in that sharding; values and gradients equal the one-device shared-A LoRA's."""
    a, ref = shared_a
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    ep = ExpertParallel(mesh, "fsdp_ep_tp")
    put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))  # noqa: E731
    a_specs = (("fsdp",), ("fsdp",), ())
    a_put = tuple(put(x, *s) for x, s in zip(a, a_specs, strict=True))
    got = _run(ep, problem, problem["packed"], a=a_put)
    _compare(got, ref, TOL["fp32_shallow"], "fsdp width split, shared A")
    for g, s in zip(got[1][1], a_specs, strict=True):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(*s)), g.ndim), (g.sharding, s)


def _run_dropped(fn, p, ws, key, b=None):
    """``_run`` with LoRA dropout (rate 0.3) on every stack: stack i's ``LoraDropout`` key is ``key`` folded with i,
    as the model hands each projection its own; the key is an argument (one compile for every key)."""
    b = b or p["b"]

    def both(z, a, b, key):
        def f(z, a, b):
            drops = (LoraDropout(jax.random.fold_in(key, i), 0.3) for i in range(3))
            return fn(z, p["ids"], p["wts"], *(LoraWeight(*t) for t in zip(ws, a, b, drops, strict=True)), ACT)

        y, vjp = jax.vjp(f, z, a, b)
        return y, vjp(p["ct"])

    return jax.jit(both)(p["z"], p["a"], b, key)


# the bucketed exchange in the default suite; the small-batch rule and the tensor split in the slow pass (~8 s each)
DROPOUT_CASES = ["data2-expert4-bucketed", pytest.param("data2-expert4-replicated", marks=pytest.mark.slow),
                 pytest.param("expert4-tensor2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", DROPOUT_CASES)
def test_ep_lora_dropout_is_deterministic_and_reaches_every_factor(problem, case):
    """Under EP a device draws the masks of the rows it holds from the key folded with its index over the token axes
    (the expert axis alone on the small-batch path, whose other axes hold the same rows; w2's key also folds the
    tensor index): not the one-device draws, but the same key gives the same outputs and gradients bit for bit,
    another key others, and the gradients reach every A and B."""
    axes, rules, kw = CASES[case]
    ep = ExpertParallel(make_mesh(axes), rules, **kw)
    one = _run_dropped(ep, problem, problem["floats"], jax.random.key(1))
    again = _run_dropped(ep, problem, problem["floats"], jax.random.key(1))
    other = _run_dropped(ep, problem, problem["floats"], jax.random.key(2))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(again), strict=True))
    assert not np.allclose(one[0], other[0], atol=1e-3)
    assert not np.allclose(one[0], problem["ref_float"][0], atol=1e-3)
    for g in (*one[1][1], *one[1][2]):
        assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0)


@pytest.mark.slow  # two EP compiles per case, ~8 s each
@pytest.mark.parametrize("case", ["data2-expert4-bucketed", "data2-expert4-replicated", "expert4-tensor2"])
def test_ep_lora_dropout_leaves_the_base_rows_whole(problem, case):
    """B = 0: the adapters add exactly 0 whatever their input, so the dropped run's output is the undropped
    experts' bit for bit — the base products read the exchanged rows whole."""
    axes, rules, kw = CASES[case]
    ep = ExpertParallel(make_mesh(axes), rules, **kw)
    zero = tuple(jnp.zeros_like(x) for x in problem["b"])
    y0, _ = _run_dropped(ep, problem, problem["floats"], jax.random.key(1), b=zero)
    np.testing.assert_array_equal(y0, _run(ep, problem, problem["floats"], b=zero)[0])
