"""MLA flash kernel (interpret mode) vs its jnp rungs: ``causal_attention`` over the built keys / values and the
dense twin (``flash_reference.mla_attention_dense``); forward, max logit and the gradients of all five inputs
(fp32). Both schedules: the loop one (CPU / GPU; jnp backward) and the TPU grid one (``platform="tpu"``: key blocks
on a grid axis, and the Pallas backward ``flash_bwd_kernel``). Also: block skipping above the diagonal, the cost
estimate's causal count, and the Triton lowering for an abstract H200 at K3's shapes (forward and VJP)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.attention import causal_attention
from k3jax.ops.segments import runs
from k3jax.testing import TOL, assert_close
from pallas_kernels.mla import flash as flash_api
from pallas_kernels.mla.flash import causal_pairs, mla_flash
from pallas_kernels.mla.flash_bwd_kernel import BWD_TILE_BYTES, backward_blocks, backward_costs, query_block_bounds
from pallas_kernels.mla.flash_kernel import pair_flops
from pallas_kernels.mla.flash_reference import build_kv, key_block_bounds, mla_attention_dense, pairs_visited
from pallas_kernels.platform import target_platform

N, HN, HR, V, R = 2, 16, 8, 16, 32  # small MLA: heads, nope, rope slice, value, latent
SCALE = 1.0 / math.sqrt(HN + HR)
NAMES = ("q", "c_kv", "k_rope", "w_uk", "w_uv")


def inputs(seed, B, T, S):
    k = jax.random.split(jax.random.key(seed), 6)
    return (jax.random.normal(k[0], (B, T, N, HN + HR)), jax.random.normal(k[1], (B, S, R)) / 3,
            jax.random.normal(k[2], (B, S, HR)), jax.random.normal(k[3], (R, N, HN)) / 3,
            jax.random.normal(k[4], (R, N, V)) / 3, jax.random.normal(k[5], (B, T, N, V)))


def via_attention(q, c_kv, k_rope, w_uk, w_uv, **kw):
    k, v = build_kv(c_kv, k_rope, w_uk, w_uv, jnp.float32)
    return causal_attention(q, k, v, scale=SCALE, block_size=8, **kw)


def value_and_grads(f, args, ct):
    """(o, max_logit, grads of <o, ct> w.r.t. the five inputs)."""
    (o, m), vjp = jax.vjp(f, *args)
    return o, m, vjp((ct, jnp.zeros_like(m)))


def check(f, ref, args, ct):
    """One jit around each side: the interpreter's grid loop compiles once instead of dispatching op by op."""
    o, m, g = jax.jit(lambda *a: value_and_grads(f, a, ct))(*args)
    o_ref, m_ref, g_ref = jax.jit(lambda *a: value_and_grads(ref, a, ct))(*args)
    assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o")
    assert_close(m, m_ref, TOL["fp32_vs_fp64"], name="max_logit")
    for name, a, b in zip(NAMES, g, g_ref, strict=True):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")
    return o, m


@pytest.fixture(autouse=True)
def _ieee_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("T,bq,bk", [(20, 8, 16), pytest.param(33, 16, 8, marks=pytest.mark.slow),
                                     pytest.param(24, 8, 8, marks=pytest.mark.slow)])
def test_matches_attention_and_dense(T, bq, bk):
    """Blocks that do not divide T (20 = 2·8 + 4 queries, 16-key blocks: the last one padded)."""
    *args, ct = inputs(0, 2, T, T)
    o, m = check(lambda *a: mla_flash(*a, scale=SCALE, block_q=bq, block_k=bk), via_attention, args, ct)
    o_dense, m_dense = mla_attention_dense(*args, scale=SCALE)
    assert_close(o, o_dense, TOL["fp32_vs_fp64"], name="o vs dense")
    assert_close(m, m_dense, TOL["fp32_vs_fp64"], name="max_logit vs dense")


def test_documents_and_offset():
    """A context shard's view: T = 12 queries at a traced offset 9 among S = 28 keys, packed documents (a boundary
    inside the queries, one in the keys before them, labels not sorted)."""
    B, T, S, off = 2, 12, 28, 9
    *args, ct = inputs(1, B, T, S)
    keys = jnp.asarray(np.stack([np.repeat([4, 1, 7], [5, 10, 13]), np.repeat([2, 0], [14, 14])]), jnp.int32)
    seg = keys[:, off:off + T]
    kw = dict(segment_ids=seg, key_segment_ids=keys)

    @jax.jit
    def flash(off, *a):
        return mla_flash(*a, scale=SCALE, q_offset=off, block_q=8, block_k=8, **kw)

    check(lambda *a: flash(jnp.int32(off), *a), lambda *a: via_attention(*a, q_offset=off, **kw), args, ct)
    run, krun = runs(keys)[:, off:off + T], runs(keys)
    o_dense, _ = mla_attention_dense(*args, scale=SCALE, run=run, krun=krun, q_offset=off)
    assert_close(flash(jnp.int32(off), *args)[0], o_dense, TOL["fp32_vs_fp64"], name="o vs dense")
    # query block 1 (positions 17..20: a document that starts at key 15, row 1: 14) skips key block 0
    bounds = np.asarray(key_block_bounds(B, T, S, 8, 8, jnp.int32(off), run, krun))
    np.testing.assert_array_equal(bounds, [[[0, 3], [1, 3]], [[0, 3], [1, 3]]])


def test_segments_square():
    T = 20
    *args, ct = inputs(2, 2, T, T)
    seg = jnp.asarray(np.stack([np.repeat([3, 1, 2], [7, 8, 5]), np.repeat([0, 5], [16, 4])]), jnp.int32)
    check(lambda *a: mla_flash(*a, scale=SCALE, segment_ids=seg, block_q=8, block_k=8),
          lambda *a: via_attention(*a, segment_ids=seg), args, ct)


def test_blocks_above_the_diagonal_are_skipped():
    """Keys at positions past every query (T = 16 at offset 8 of S = 64: keys 24..63) are NaN: a kernel or backward
    that visited their blocks would turn 0 · NaN into NaN (p · v, dsᵀ q); skipping leaves every output finite."""
    B, T, S, off = 1, 16, 64, 8
    *args, ct = inputs(3, B, T, S)
    poison = lambda x: x.at[:, 24:].set(jnp.nan)  # noqa: E731
    args[1], args[2] = poison(args[1]), poison(args[2])
    clean = [a[:, :24] if i in (1, 2) else a for i, a in enumerate(args)]
    o, m, g = value_and_grads(lambda *a: mla_flash(*a, scale=SCALE, q_offset=off, block_q=8, block_k=8), args, ct)
    o_ref, m_ref, g_ref = value_and_grads(lambda *a: via_attention(*a, q_offset=off), clean, ct)
    assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o")
    assert_close(m, m_ref, TOL["fp32_vs_fp64"], name="max_logit")
    for name, a, b in zip(NAMES, g, g_ref, strict=True):
        if name in ("c_kv", "k_rope"):
            np.testing.assert_array_equal(np.asarray(a)[:, 24:], 0.0)
            a = a[:, :24]
        assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")


def per_row(offsets):
    """The reference for per-row offsets: ``via_attention`` row by row at each row's own (scalar) offset."""
    def f(q, c_kv, k_rope, w_uk, w_uv):
        outs = [via_attention(q[b:b + 1], c_kv[b:b + 1], k_rope[b:b + 1], w_uk, w_uv, q_offset=int(off))
                for b, off in enumerate(offsets)]
        return jnp.concatenate([o for o, _ in outs]), jnp.concatenate([m for _, m in outs])
    return f


@pytest.mark.parametrize("platform,grads", [("cpu", False), pytest.param("cpu", True, marks=pytest.mark.slow),
                                            pytest.param("tpu", True, marks=pytest.mark.slow)])
def test_per_row_offsets(platform, grads):
    """q_offset [B] (cached prefill pieces): rows at offsets 0, 13 and 24 of S = 30 keys (the last row's queries
    run past the keys, as a piece's padding does), traced, blocks that divide neither T nor S: forward, max logit
    and all five gradients (``grads``; the default pass: the forward only) against each row's scalar-offset
    reference; the forward also against the dense twin. "tpu": the grid forward and the Pallas backward in the
    interpreter."""
    B, T, S = 3, 10, 30
    offsets = np.array([0, 13, 24], np.int32)
    *args, ct = inputs(7, B, T, S)
    flash = jax.jit(lambda *a, off: mla_flash(*a, scale=SCALE, q_offset=off, block_q=4, block_k=8,
                                              platform=platform, interpret=True))
    if grads:
        o, _ = check(lambda *a: flash(*a, off=jnp.asarray(offsets)), per_row(offsets), args, ct)
    else:   # the default pass: the forward only (the gradients' compile is most of the time)
        o, m = flash(*args, off=jnp.asarray(offsets))
        o_ref, m_ref = jax.jit(per_row(offsets))(*args)
        assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o")
        assert_close(m, m_ref, TOL["fp32_vs_fp64"], name="max_logit")
    o_dense, _ = mla_attention_dense(*args, scale=SCALE, q_offset=jnp.asarray(offsets))
    assert_close(o, o_dense, TOL["fp32_vs_fp64"], name="o vs dense")
    bounds = np.asarray(key_block_bounds(B, T, S, 4, 8, jnp.asarray(offsets)))
    for b, off in enumerate(offsets):   # each row's bounds are its own scalar-offset bounds
        np.testing.assert_array_equal(bounds[b], np.asarray(key_block_bounds(1, T, S, 4, 8, jnp.int32(off)))[0])


def test_per_row_offset_shape_is_checked():
    *args, _ = inputs(7, 2, 4, 8)
    with pytest.raises(ValueError, match="q_offset"):
        mla_flash(*args, scale=SCALE, q_offset=jnp.zeros((3,), jnp.int32))


# ---------------------------------------------------------------------------------------------------------------
# TPU schedule in the interpreter: the key-block grid axis (forward) and the two Pallas backward kernels


def test_tpu_grid_schedule_and_pallas_backward():
    """Many key blocks per row (S = 40 in 5-key blocks at offset 16: 8 key blocks, 3 query blocks), packed documents
    (so lo > 0 for the later query blocks): forward and all five gradients against ``causal_attention``."""
    B, T, S, off = 1, 24, 40, 16
    *args, ct = inputs(5, B, T, S)
    keys = jnp.asarray(np.repeat([2, 0, 1], [12, 15, 13])[None], jnp.int32)
    kw = dict(segment_ids=keys[:, off:], key_segment_ids=keys)
    check(lambda *a: mla_flash(*a, scale=SCALE, block_q=8, block_k=5, platform="tpu", interpret=True, **kw),
          lambda *a: via_attention(*a, q_offset=off, **kw), args, ct)


def test_backward_blocks_fit_the_tile_budget():
    """bf16 keeps the TPU default (512, 256) and K3's (512, 512); fp32 halves block_q past the budget (fp32 (512,
    512) ran out of scoped VMEM in mla_flash_dq); a block_q that would stop being a multiple of 8 is kept."""
    assert backward_blocks(512, 256, 2) == (512, 256) and backward_blocks(512, 512, 2) == (512, 512)
    assert backward_blocks(512, 512, 4) == (256, 512) and backward_blocks(512, 256, 4) == (512, 256)
    assert backward_blocks(1024, 1024, 4) == (128, 1024)
    assert backward_blocks(24, 1 << 20, 4) == (24, 1 << 20)
    for bq, bk, size in [(512, 512, 4), (2048, 128, 2), (96, 4096, 4)]:
        q, k = backward_blocks(bq, bk, size)
        assert k == bk and bq % q == 0 and q % 8 == 0 and (q * k * size <= BWD_TILE_BYTES or q % 16)


def test_pallas_backward_takes_its_own_query_blocks(monkeypatch):
    """A tile budget that halves block_q for the backward only (forward 16-query blocks, backward 8): the five
    gradients still equal ``causal_attention``'s, with an offset and a T that no block size divides."""
    seen = []
    launch = flash_api.flash_bwd_pallas
    monkeypatch.setattr(flash_api, "flash_bwd_pallas", lambda *a, **kw: seen.append(kw["bq"]) or launch(*a, **kw))
    monkeypatch.setattr("pallas_kernels.mla.flash_bwd_kernel.BWD_TILE_BYTES", 8 * 5 * 4)
    B, T, S = 1, 21, 30
    *args, ct = inputs(7, B, T, S)
    check(lambda *a: mla_flash(*a, scale=SCALE, block_q=16, block_k=5, platform="tpu", interpret=True),
          lambda *a: via_attention(*a, q_offset=S - T), args, ct)
    assert seen == [8]


@pytest.mark.slow
@pytest.mark.parametrize("T,S,bq,bk,segments", [(20, 20, 8, 16, False), (40, 72, 8, 4, False), (33, 33, 16, 8, True)])
def test_tpu_grid_schedule_slow(T, S, bq, bk, segments):
    B = 2
    *args, ct = inputs(6, B, T, S)
    kw = {}
    if segments:
        kw = dict(segment_ids=jnp.asarray(np.stack([np.repeat([3, 1, 2], [7, 14, 12]), np.repeat([0, 5], [20, 13])]),
                                          jnp.int32))
    check(lambda *a: mla_flash(*a, scale=SCALE, block_q=bq, block_k=bk, platform="tpu", interpret=True, **kw),
          lambda *a: via_attention(*a, q_offset=S - T, **kw), args, ct)


def test_query_block_bounds_invert_key_block_bounds():
    """Key block j's query blocks [i0, i1) are exactly those whose [lo, hi) holds j (documents, an offset)."""
    B, T, S, bq, bk, off = 2, 12, 28, 4, 4, 9
    keys = jnp.asarray(np.stack([np.repeat([4, 1, 7], [5, 10, 13]), np.repeat([2, 0], [14, 14])]), jnp.int32)
    krun = runs(keys)
    bounds = np.asarray(key_block_bounds(B, T, S, bq, bk, jnp.int32(off), krun[:, off:off + T], krun))
    qb = np.asarray(query_block_bounds(jnp.asarray(bounds), S // bk))
    for b in range(B):
        for j in range(S // bk):
            want = [i for i in range(T // bq) if bounds[b, i, 0] <= j < bounds[b, i, 1]]
            got = list(range(qb[b, j, 0], qb[b, j, 1]))
            assert got == want, (b, j, got, want)


@pytest.mark.parametrize("T,S,bq,bk,off", [(20, 20, 8, 16, 0), (2048, 2048, 512, 256, 0), (100, 300, 16, 32, 150),
                                           (64, 64, 16, 16, 0)])
def test_cost_counts_the_causal_pairs(T, S, bq, bk, off):
    """The kernel's visits (``key_block_bounds``) and its cost estimate count exactly the block pairs holding a
    causal (query, key) pair, brute-forced over positions."""
    qpos = np.arange(T) + off
    want = sum(bool(np.any(np.arange(j * bk, min(j * bk + bk, S))[None, :] <= qpos[i * bq:i * bq + bq, None]))
               for i in range(-(-T // bq)) for j in range(-(-S // bk)))
    assert pairs_visited(key_block_bounds(1, T, S, bq, bk, jnp.int32(off))) == want == causal_pairs(T, S, bq, bk, off)
    if T == S == 64:  # square, bq = bk: the lower triangle with its diagonal
        assert want == 4 * 5 // 2
    K3 = dict(R=512, Hn=128, Hr=64, V=128)
    flops = want * pair_flops(bq, bk, **K3)
    if (T, bq) == (2048, 512):  # per head: 4 query blocks x (2, 4, 6, 8) key blocks of 256
        assert want == 20 and flops == 20 * (2 * 256 * 512 * 256 + 2 * 512 * 256 * 320)


@pytest.mark.parametrize("T,S,bq,bk,off", [(20, 20, 8, 16, 0), (100, 300, 16, 32, 150), (64, 64, 16, 16, 0),
                                           (40, 96, 8, 16, 56)])
def test_backward_costs_count_each_kernels_grid(T, S, bq, bk, off):
    """``backward_costs`` equals a walk over each backward kernel's grid: per step, the dots its body runs when the
    step is inside its visible range, and the blocks its index maps fetch when they change (dq: grid (n, b, i, j),
    key blocks clamped to [lo, hi); dkv: grid (b, j, n, i), query blocks clamped to [i0, i1))."""
    B, N, R, Hn, Hr, V, it = 2, 3, 16, 8, 4, 8, 2
    bounds = np.asarray(key_block_bounds(B, T, S, bq, bk, jnp.int32(off)))
    nq, nk = bounds.shape[1], -(-S // bk)
    qb = np.asarray(query_block_bounds(jnp.asarray(bounds), nk))
    up, q_rows = 2 * bk * R * (Hn + V), bq * (Hn + Hr + V) * it + 2 * bq * 4
    fl = by = 0                                                           # dq
    for _n in range(N):
        by += R * (Hn + V) * (it + 4)                                     # the head's weights in, dw out
        for b in range(B):
            for i in range(nq):
                lo, hi = bounds[b, i]
                by += q_rows + bq * (Hn + Hr) * 4                         # q, do, lse, Δ in; dq out
                for j in range(nk):
                    if lo <= j < hi:
                        fl += up + 2 * bq * bk * (Hn + Hr) + 2 * bq * bk * V + 2 * 2 * bq * bk * R + 2 * bq * bk * Hr
                        by += bk * (R + Hr) * it
                fl += 2 * bq * R * Hn * 2 + 2 * bq * R * V
    fl2 = by2 = 0                                                         # dkv
    for b in range(B):
        for j in range(nk):
            i0, i1 = qb[b, j]
            by2 += bk * (R + Hr) * (it + 4)                               # latent block in, dc_kv / dk_rope out
            for _n in range(N):
                by2 += R * (Hn + V) * it
                fl2 += 2 * up if i0 < i1 else 0                           # up-projection, then the fold
                for _i in range(i0, i1):
                    fl2 += 2 * bq * bk * (2 * Hn + 2 * Hr + 2 * V)
                    by2 += q_rows
    pairs = B * causal_pairs(T, S, bq, bk, off)
    dq, dkv = backward_costs(pairs, B=B, N=N, T=T, S=S, R=R, Hn=Hn, Hr=Hr, V=V, bq=bq, bk=bk, itemsize=it, qoff=off)
    assert (dq.flops, dq.bytes_accessed) == (fl, by)
    assert (dkv.flops, dkv.bytes_accessed) == (fl2, by2)


# ---------------------------------------------------------------------------------------------------------------
# cuda: Triton lowering for an abstract H200 at K3's shapes (N = 96, Hn = V = 128, Hr = 64, R = 512, T = S = 2048)

TRITON_CALL = "__gpu$xla.gpu.triton"


def _k3_args(segments=False):
    B, T, N3 = 1, 2048, 96
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = [S((B, T, N3, 192), bf), S((B, T, 512), bf), S((B, T, 64), bf), S((512, N3, 128), bf),
            S((512, N3, 128), bf)]
    return args + [S((B, T), jnp.int32)] if segments else args


@pytest.mark.parametrize("vjp,segments", [(False, False), (True, False), pytest.param(True, True,
                                                                                       marks=pytest.mark.slow)])
def test_lowers_for_cuda(vjp, segments):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)

    def f(*a):
        seg = a[5] if segments else None
        fwd = lambda *x: mla_flash(*x, scale=1 / math.sqrt(192), segment_ids=seg)  # noqa: E731
        if not vjp:
            return fwd(*a[:5])
        (o, m), back = jax.vjp(fwd, *a[:5])
        return back((o, jnp.zeros_like(m)))

    with jax.sharding.use_abstract_mesh(mesh):
        assert target_platform() == "gpu"
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*_k3_args(segments)).mlir_module()
    assert f"stablehlo.custom_call @{TRITON_CALL}" in text and "mla_flash_fwd" in text


# ---------------------------------------------------------------------------------------------------------------
# context parallelism: inside shard_map (check_vma), each shard's queries at a traced offset over the whole latent.
# Runs the TPU layout (SMEM bounds, [bq, 1] / [1, Sp] document runs) under pltpu.InterpretParams, the interpreter
# that keeps the varying mesh axes (interpret=True loses them inside shard_map: README_flash.md "Limits").


@pytest.mark.slow
def test_context_parallel_shard_map():
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P

    B, T, shards = 2, 32, 2
    L = T // shards
    *args, ct = inputs(4, B, T, T)
    seg = jnp.asarray(np.stack([np.repeat([3, 1, 2], [7, 14, 11]), np.repeat([0, 5], [20, 12])]), jnp.int32)
    mesh = jax.make_mesh((shards,), ("s",))

    def local(q, c_kv, k_rope, w_uk, w_uv, seg):
        off = jax.lax.axis_index("s") * L
        o, m = mla_flash(q, c_kv, k_rope, w_uk, w_uv, scale=SCALE, q_offset=off, block_q=8, block_k=8,
                         segment_ids=jax.lax.dynamic_slice_in_dim(seg, off, L, axis=1), key_segment_ids=seg,
                         platform="tpu", interpret=pltpu.InterpretParams())
        return o, jax.lax.pmax(jax.lax.stop_gradient(m), "s")

    want = value_and_grads(lambda *a: via_attention(*a, segment_ids=seg), args, ct)
    sharded = jax.shard_map(local, mesh=mesh, check_vma=True, in_specs=(P(None, "s"), P(), P(), P(), P(), P()),
                            out_specs=(P(None, "s"), P()))
    with jax.set_mesh(mesh):
        args[0] = jax.device_put(args[0], jax.sharding.NamedSharding(mesh, P(None, "s")))
        got = jax.jit(lambda *a: value_and_grads(lambda *x: sharded(*x, seg), a, ct))(*args)
    assert_close(got[0], want[0], TOL["fp32_vs_fp64"], name="o")
    assert_close(got[1], want[1], TOL["fp32_vs_fp64"], name="max_logit")
    for name, a, b in zip(NAMES, got[2], want[2], strict=True):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")
