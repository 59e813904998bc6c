"""Expert parallelism with frozen MXFP4 experts: the bucketed shard_map dispatch (8 simulated CPU devices) running
``PackedWeight`` stacks equals the single-device packed path, forward and gradients w.r.t. the rows and gates."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from k3jax.ops.activations import glu_activation
from k3jax.ops.packed_experts import PackedWeight, experts_packed
from k3jax.quant import pack_experts
from k3jax.sharding.expert_parallel import ExpertParallel
from k3jax.sharding.mesh import make_mesh
from k3jax.testing import TOL, assert_close, jaxpr_eqns

ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
M, A, E, Pd, F = 64, 2, 8, 32, 64


def _problem(seed: int = 0):
    """Rows, skewed routing (expert 5 on every token; shard 0's experts 0, 1 mostly idle), gates, packed stacks."""
    k = jax.random.split(jax.random.key(seed), 6)
    z = jax.random.normal(k[0], (M, Pd))
    pack = jax.jit(pack_experts)
    w1, w3, w2 = (PackedWeight(*pack(0.3 * jax.random.normal(k[i], s)))
                  for i, s in zip((1, 2, 3), ((E, Pd, F), (E, Pd, F), (E, F, Pd)), strict=True))
    s = jax.random.normal(k[4], (M, E)).at[:, :2].add(-3.0)
    other = jax.lax.top_k(s.at[:, 5].set(-jnp.inf), 1)[1][:, 0]
    ids = jnp.stack([jnp.full((M,), 5), other], axis=1).astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(k[5], (M, A)))
    return z, ids, wts, w1, w3, w2


def _values_and_grads(ep, z, ids, wts, ws, ct):
    """(y, (dz, dweights)) of ``ep`` under jit for the cotangent ``ct``, and the program's jaxpr as text."""
    def both(z, wts):
        loss = lambda z, w: jnp.sum(ct * ep(z, ids, w, *ws, ACT))  # noqa: E731
        return ep(z, ids, wts, *ws, ACT), jax.grad(loss, argnums=(0, 1))(z, wts)

    return jax.jit(both)(z, wts), str(jax.make_jaxpr(both)(z, wts))


@pytest.mark.parametrize("axes,rules", [({"data": 2, "expert": 4}, "ep"),
                                        pytest.param({"expert": 4, "tensor": 2}, "ep_tp", marks=pytest.mark.slow)],
                         ids=["data2-expert4", "expert4-tensor2"])
def test_ep_packed_matches_local_packed(axes, rules):
    """ep_tp shards F of the packed stacks over ``tensor`` (w1/w3 rows, w2's packed columns and scales)."""
    z, ids, wts, w1, w3, w2 = _problem()
    ct = jax.random.normal(jax.random.key(7), z.shape)  # a fixed cotangent (sin(y) put the ep_tp dweights at 1.06e-6)
    ep = ExpertParallel(make_mesh(axes), rules, impl="bucketed")

    def run(fn):
        def both(z, wts):
            loss = lambda z, w: jnp.sum(ct * fn(z, ids, w, w1, w3, w2, ACT))  # noqa: E731
            return fn(z, ids, wts, w1, w3, w2, ACT), jax.grad(loss, argnums=(0, 1))(z, wts)

        return jax.jit(both)(z, wts)

    y, (dz, dw) = run(ep)
    y_ref, (dz_ref, dw_ref) = run(partial(experts_packed, impl="tiles"))
    assert_close(y, y_ref, TOL["fp32_shallow"], name="fwd")
    assert_close(dz, dz_ref, TOL["fp32_shallow"], name="dz")
    assert_close(dw, dw_ref, TOL["fp32_shallow"], name="dweights")


@pytest.mark.parametrize("axes,rules", [({"data": 2, "expert": 4}, "ep"),
                                        pytest.param({"expert": 4, "tensor": 2}, "ep_tp", marks=pytest.mark.slow)],
                         ids=["data2-expert4", "expert4-tensor2"])
def test_ep_pallas_kernel_equals_xla_tile_loop(axes, rules):
    """The key check: under ExpertParallel (bucketed exchange) the local packed experts run by the Pallas grouped
    MXFP4 kernel — the TPU schedule in the TPU interpreter, inside shard_map: forward, and the transposed kernel for
    the rows' gradient — equal the XLA tile loop (f32, rel-RMS ≤ 1e-6; seen ~2e-7, each path ~2e-7 from float64),
    and the program really runs the kernel (its pallas_calls are in the jaxpr; the tile loop's has none). ep_tp
    splits F over ``tensor``: w2's kernel sums partial products, w1/w3's transposed kernel partial dx (psum'd)."""
    z, ids, wts, w1, w3, w2 = _problem(1)
    ct = jax.random.normal(jax.random.key(7), z.shape)  # a fixed cotangent: the VJP, not a loss's amplification
    mesh = make_mesh(axes)

    def run(kernel):
        return _values_and_grads(ExpertParallel(mesh, rules, impl="bucketed", packed_kernel=kernel), z, ids, wts,
                                 (w1, w3, w2), ct)

    (y, (dz, dw)), jaxpr = run("pallas")
    (y_ref, (dz_ref, dw_ref)), jaxpr_ref = run("tiles")
    assert jaxpr.count("name=mxfp4_gmm_tpu_fwd") >= 3 and jaxpr.count("name=mxfp4_gmm_tpu_bwd_x") >= 3
    assert "pallas_call" not in jaxpr_ref
    assert_close(y, y_ref, TOL["fp32_shallow"], name="fwd")
    assert_close(dz, dz_ref, TOL["fp32_shallow"], name="dz")
    assert_close(dw, dw_ref, TOL["fp32_shallow"], name="dweights")


def test_ep_reads_a_stacked_layer_in_place():
    """Stacks of two layers [2, E, ...] with a traced layer index (a scanned group's experts, read in place by the
    kernels) through ExpertParallel's shard_map (the stacks whole on the expert axis' shards of E, the index
    replicated): the kernel path gives the values and gradients of the same layer's unstacked weights."""
    z, ids, wts, w1, w3, w2 = _problem(4)
    ct = jax.random.normal(jax.random.key(7), z.shape)
    ep = ExpertParallel(make_mesh({"data": 2, "expert": 4}), "ep", impl="bucketed", packed_kernel="pallas")
    stacks = [PackedWeight(jnp.stack([jnp.flip(w.packed, 0), w.packed]), jnp.stack([jnp.flip(w.scale, 0), w.scale]))
              for w in (w1, w3, w2)]

    def run(weights):
        def both(z, wts, layer):
            ws = [w if layer is None else w._replace(layer=layer) for w in weights]
            loss = lambda z, w: jnp.sum(ct * ep(z, ids, w, *ws, ACT))  # noqa: E731
            return ep(z, ids, wts, *ws, ACT), jax.grad(loss, argnums=(0, 1))(z, wts)

        return both

    y, (dz, dw) = jax.jit(run(stacks))(z, wts, jnp.int32(1))
    y_ref, (dz_ref, dw_ref) = jax.jit(run((w1, w3, w2)), static_argnums=2)(z, wts, None)
    assert_close(y, y_ref, TOL["fp32_shallow"], name="fwd")
    assert_close(dz, dz_ref, TOL["fp32_shallow"], name="dz")
    assert_close(dw, dw_ref, TOL["fp32_shallow"], name="dweights")


def test_ep_kernel_path_sends_bf16_expert_outputs_back_with_the_same_values():
    """bf16 rows on the kernel path (data 2 × expert 4, no tensor split): the experts' outputs go back through the
    exchange in bf16 — the kernel's own output dtype, not the fp32 accumulation dtype — and the MoE output equals the
    single-device kernel path's (whose combine reads the same bf16 outputs in fp32): the narrower exchange changes
    no value (seen: rel-RMS 0 for y, dweights and dz). The rows' gradient is held to bf16's tolerance only: the two
    paths may sum a token's slot gradients in bf16 in different orders."""
    from pallas_kernels.mxfp4_matmul import mxfp4_glu_ffn

    z, ids, wts, w1, w3, w2 = _problem(2)
    z = z.astype(jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(7), z.shape)
    ep = ExpertParallel(make_mesh({"data": 2, "expert": 4}), "ep", impl="bucketed", packed_kernel="pallas")
    local = partial(experts_packed, impl="gmm", gmm=partial(mxfp4_glu_ffn, platform="tpu", interpret=True))

    def run(fn):
        def both(z, wts):
            loss = lambda z, w: jnp.sum(ct * fn(z, ids, w, w1, w3, w2, ACT))  # noqa: E731
            return fn(z, ids, wts, w1, w3, w2, ACT), jax.grad(loss, argnums=(0, 1))(z, wts)

        return jax.jit(both)(z, wts), str(jax.make_jaxpr(both)(z, wts))

    (y, (dz, dw)), jaxpr = run(ep)
    (y_ref, (dz_ref, dw_ref)), _ = run(local)
    exchanged = [line for line in jaxpr.splitlines() if "all_to_all" in line and f",{Pd}]" in line]
    assert exchanged and all("bf16[" in line and "f32[" not in line for line in exchanged), exchanged
    assert y.dtype == jnp.float32 and dz.dtype == jnp.bfloat16
    assert_close(y, y_ref, TOL["fp32_shallow"], name="fwd")
    assert_close(dw, dw_ref, TOL["fp32_shallow"], name="dweights")
    assert_close(dz, dz_ref, TOL["bf16"], name="dz")


@pytest.mark.parametrize("kernel", ["tiles", "pallas"])
def test_ep_quantizes_each_token_once_before_the_exchange(kernel):
    """QAT's MXFP8 fake-quant of the experts' input runs on the tokens z [M, P] before the exchange (never on the
    exchanged [X·C, P] rows: the A copies of a token are the same quantized row), then on h; the output and the
    gradients equal the single-device packed experts under the same fake-quant (data 4 × expert 2, f32: a receive
    buffer of X·C = 2 · 16 rows per device, where the tokens are M = 64)."""
    from k3jax.ops import mx

    z, ids, wts, w1, w3, w2 = _problem(3)
    ct = jax.random.normal(jax.random.key(7), z.shape)
    seen = []

    def aq(x):
        seen.append(x.shape)
        return mx.fake_quant_mxfp8(x, axis=-1)

    ep = ExpertParallel(make_mesh({"data": 4, "expert": 2}), "ep", impl="bucketed", packed_kernel=kernel)

    def run(fn):
        def both(z, wts):
            loss = lambda z, w: jnp.sum(ct * fn(z, ids, w, w1, w3, w2, ACT, act_quant=aq))  # noqa: E731
            return fn(z, ids, wts, w1, w3, w2, ACT, act_quant=aq), jax.grad(loss, argnums=(0, 1))(z, wts)

        return jax.jit(both)(z, wts)

    y, (dz, dw) = run(ep)
    x_calls = {s for s in seen if s[-1] == Pd}
    assert x_calls == {(M, Pd)}, seen  # the tokens, whole, before the shard_map; no [X·C, Pd] receive buffer
    assert any(s[-1] == F for s in seen), seen  # h
    seen.clear()
    y_ref, (dz_ref, dw_ref) = run(partial(experts_packed, impl="tiles"))
    assert {s for s in seen if s[-1] == Pd} == {(M, Pd)}, seen  # one device: z before its A copies, too
    assert_close(y, y_ref, TOL["fp32_shallow"], name="fwd")
    assert_close(dz, dz_ref, TOL["fp32_shallow"], name="dz")
    assert_close(dw, dw_ref, TOL["fp32_shallow"], name="dweights")



def test_ep_decode_kernels_charge_the_expected_load():
    """A small-batch EP decode program (2 tokens replicated over expert = 4: 2 of the 8 experts per device) runs the
    small-batch routed FFN kernel once per device, and its cost estimate — what XLA and ``k3 plan`` read — charges
    the expected selected experts of ``backends.expected_load(2 tokens, top-2, 8 experts, 2 local)`` (0.875) plus
    the chance that none is selected (the grid's one visit: (C(6, 2) / C(8, 2))^2), not both local experts, and the
    expected chunks of 16 rows for the FLOPs; the 2 rows padded to 16. Traced only (make_jaxpr): nothing runs."""
    from k3jax.layers import backends
    from pallas_kernels.mxfp4_matmul import cost

    z, ids, wts, w1, w3, w2 = (a[:2] if i < 3 else a for i, a in enumerate(_problem(3)))
    ep = ExpertParallel(make_mesh({"expert": 4}), "ep", packed_kernel="pallas", replicate_tokens=True)
    jaxpr = jax.make_jaxpr(lambda z, w: ep(z, ids, w, w1, w3, w2, ACT))(z, wts)
    calls = [e for e in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    assert [e.params["name"] for e in calls] == ["mxfp4_glu_ffn_rows"], [e.params["name"] for e in calls]
    load = backends.expected_load(2, A, E, E // 4)
    assert load == pytest.approx({"rows": 1.0, "groups": 0.875, "idle": (15 / 28) ** 2})
    tiles = cost.expected_tiles(load["rows"], load["groups"], 16)      # the chunks of 16 rows (one F block)
    want = cost.rows_ffn_cost(16, Pd, F, 4, load["groups"] + load["idle"], tiles, 16, 1)
    est = calls[0].params["cost_estimate"]
    assert (est.flops, est.bytes_accessed) == (want["flops"], want["bytes_accessed"])
    assert want["bytes_accessed"] < cost.rows_ffn_cost(16, Pd, F, 4, E // 4, 1, 16, 1)["bytes_accessed"]  # both


@pytest.mark.parametrize("axes,rules", [({"expert": 4}, "ep"),
                                        pytest.param({"expert": 4, "tensor": 2}, "ep_tp", marks=pytest.mark.slow)],
                         ids=["expert4", "expert4-tensor2"])
def test_ep_small_batch_runs_the_routed_ffn_kernel(axes, rules):
    """The small-batch rule (every token on every device) with frozen experts and ``packed_kernel="pallas"`` runs
    the small-batch routed FFN kernel (one ``mxfp4_glu_ffn_rows`` call per forward; its VJP the grouped kernels') and
    equals the XLA tile loop, forward and gradients with respect to the rows and the gates (f32). ep_tp: each
    device's F slice gives partial sums (psum'd over tensor)."""
    z, ids, wts, w1, w3, w2 = (a[:8] if i < 3 else a for i, a in enumerate(_problem(5)))
    ct = jax.random.normal(jax.random.key(7), z.shape)
    mesh = make_mesh(axes)

    def run(kernel):
        return _values_and_grads(ExpertParallel(mesh, rules, packed_kernel=kernel, replicate_tokens=True), z, ids, wts,
                                 (w1, w3, w2), ct)

    (y, (dz, dw)), jaxpr = run("pallas")
    (y_ref, (dz_ref, dw_ref)), _ = run("tiles")
    assert jaxpr.count("name=mxfp4_glu_ffn_rows") == 2 and jaxpr.count("name=mxfp4_gmm_tpu_bwd_x") >= 3  # y, grad
    assert_close(y, y_ref, TOL["fp32_shallow"], name="fwd")
    assert_close(dz, dz_ref, TOL["fp32_shallow"], name="dz")
    assert_close(dw, dw_ref, TOL["fp32_shallow"], name="dweights")
