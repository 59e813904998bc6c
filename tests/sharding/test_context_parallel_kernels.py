"""Context parallelism with the Pallas kernels (k3jax/sharding/context_parallel.py) on simulated CPU devices: the
chunked-KDA kernel as each shard's core (vs the XLA chunked core, same split), and MLA flash attention per shard over
the gathered latent, contiguous and mirror-balanced (vs one device's attention over the built keys), forward and
gradients, with packed documents; and the flash kernel per device under a row split (no context axis,
k3jax/sharding/row_split.py). The kernels run in the TPU interpreter (``pltpu.InterpretParams``): the one that keeps
the varying mesh axes inside ``shard_map``."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import kda as kda_ops
from k3jax.ops.attention import causal_attention
from k3jax.sharding.context_parallel import ContextParallel, causal_block_pairs
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.row_split import RowSplit, latent_cache_rows
from k3jax.testing import TOL, assert_close
from pallas_kernels.kda import kda_chunk
from pallas_kernels.mla.flash import causal_pairs, mla_flash
from pallas_kernels.mla.flash_reference import build_kv

N, HN, HR, V, R = 2, 8, 4, 8, 16  # small MLA: heads, nope, rope slice, value, latent
SCALE = 1.0 / math.sqrt(HN + HR)


@pytest.fixture(autouse=True)
def _ieee_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _docs(B, T):
    """Packed rows: boundaries inside shards and exactly at the half and shard edges of a 2- and 4-way split."""
    seg = np.zeros((B, T), np.int32)
    seg[0, 3:] = 1
    seg[0, T // 2:] = 2
    seg[-1, T // 4 + 1:] = 5
    seg[-1, T - 2:] = 4
    return jnp.asarray(seg)


def _grads(f, args, ct, grads=True):
    """jit'd (o, max_logit, grads of <o, ct> w.r.t. every argument (none unless ``grads``))."""
    def run(*a):
        if not grads:
            return (*f(*a), ())
        (o, m), vjp = jax.vjp(f, *a)
        return o, m, vjp((ct, jnp.zeros_like(m)))
    return jax.jit(run)(*args)


def _close(got, want, names):
    assert_close(got[0], want[0], TOL["fp32_vs_fp64"], name="o")
    assert_close(got[1], want[1], TOL["fp32_vs_fp64"], name="max_logit")
    assert len(got[2]) == len(want[2])
    for name, a, b in zip(names, got[2], want[2], strict=False):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")


# ------------------------------------------------------------------------------------------------------------- KDA
def _kda_inputs(B, T, Nh=1, K=8, Vk=8, Wc=4):
    k = jax.random.split(jax.random.key(7), 7)
    us = tuple(jax.random.normal(k[i], (B, T, Nh * d)) for i, d in enumerate((K, K, Vk)))
    ws = tuple(jax.random.normal(k[3 + i], (Nh * d, Wc)) / 2 for i, d in enumerate((K, K, Vk)))
    g = -jax.nn.softplus(jax.random.normal(k[6], (B, T, Nh, K)))               # log decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(k[5], (B, T, Nh)))
    return us, ws, g, beta, Nh


@pytest.mark.parametrize("n,platform", [(2, None), pytest.param(4, None, marks=pytest.mark.slow),
                                        pytest.param(2, "tpu", marks=pytest.mark.slow)])
def test_kda_kernel_under_context_equals_chunked_core(n, platform):
    """``ContextParallel.kda`` with the Pallas kernel as each shard's core gives the XLA chunked core's output, final
    state and gradients (same split, packed documents): the kernel declares its outputs' varying mesh axes. Both
    schedules: the loop one (CPU / GPU) and the TPU chunk grid."""
    B, T = 2, 6 * n                                           # 6 tokens per shard: not whole chunks (4)
    us, ws, g, beta, Nh = _kda_inputs(B, T)
    seg = _docs(B, T)
    cp = ContextParallel(make_mesh({"context": n}), "fsdp", batch=B)
    assert cp.n == n
    kw = dict(chunk_size=4, sub_chunk=4, gate_lower_bound=None)
    sched = {"block_v": 8} if platform is None else {"platform": platform, "interpret": True}  # TPU: block_v = V
    cores = {"pallas": functools.partial(kda_chunk, **sched, **kw), "chunked": functools.partial(
        kda_ops.kda_chunked, **kw)}
    ct = jax.random.normal(jax.random.key(9), (B, T, Nh, 8))

    def run(core):
        def f(us, g, beta):
            o, s, _ = cp.kda(core, us, ws, g, beta, heads=Nh, segment_ids=seg)
            return o, s
        (o, s), vjp = jax.vjp(f, us, g, beta)
        return o, s, vjp((ct, jnp.zeros_like(s)))

    got, want = (jax.jit(functools.partial(run, cores[c]))() for c in ("pallas", "chunked"))
    assert_close(got[0], want[0], TOL["fp32_vs_fp64"], name="o")
    assert_close(got[1], want[1], TOL["fp32_vs_fp64"], name="final state")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[2]), jax.tree.leaves(want[2]), strict=True):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{jax.tree_util.keystr(path)}")


@pytest.mark.slow
def test_model_with_the_kda_kernel_on_a_context_mesh():
    """k3-tiny's logits with ``kda_impl="pallas"`` split over context 2 (the layer runs the kernel per shard) equal
    the chunked core's under the same split (~30 s: the interpreter)."""
    from k3jax.config import default_run, get_preset
    from k3jax.model import forward, init_params

    cfg = get_preset("k3-tiny")
    runs = {impl: default_run(cfg, kda_chunk_size=16, kda_impl=impl) for impl in ("pallas", "chunked")}
    params = init_params(cfg, jax.random.key(0), runs["chunked"])
    tok = jax.random.randint(jax.random.key(1), (1, 24), 0, cfg.vocab_size)
    cp = ContextParallel(make_mesh({"context": 2}), "fsdp", batch=1)
    got, want = (jax.jit(lambda p, t, run=runs[i]: forward(p, t, cfg, run, dispatch=cp))(params, tok)
                 for i in ("pallas", "chunked"))
    assert_close(got, want, TOL["fp32_mesh_vs_single"], name="logits")


# ------------------------------------------------------------------------------------------------------------- MLA
def _mla_inputs(B, T):
    k = jax.random.split(jax.random.key(4), 6)
    return [jax.random.normal(k[0], (B, T, N, HN + HR)), jax.random.normal(k[1], (B, T, R)) / 3,
            jax.random.normal(k[2], (B, T, HR)), jax.random.normal(k[3], (R, N, HN)) / 3,
            jax.random.normal(k[4], (R, N, V)) / 3], jax.random.normal(k[5], (B, T, N, V))


def _attention(q, c_kv, k_rope, w_uk, w_uv, **kw):
    """One device's MLA attention over the built keys / values (the XLA path's math); also a flash stand-in (its
    cost estimate's offset has no meaning here)."""
    kw.pop("cost_offset", None)
    k, v = build_kv(c_kv, k_rope, w_uk, w_uv, jnp.float32)
    return causal_attention(q, k, v, scale=SCALE, block_size=8, **kw)


def _latent_flash(n, flash, balance, B, T, docs, grads=True):
    args, ct = _mla_inputs(B, T)
    seg = _docs(B, T) if docs else None
    mesh = make_mesh({"context": n})
    cp = ContextParallel(mesh, "fsdp", batch=B)
    want = _grads(lambda *a: _attention(*a, segment_ids=seg), args, ct, grads)
    with jax.set_mesh(mesh):
        got = _grads(lambda *a: cp.latent_flash(flash, *a, segment_ids=seg, balance=balance), args, ct, grads)
    _close(got, want, ("q", "c_kv", "k_rope", "w_uk", "w_uv"))


def test_latent_flash_kernel_mirror_balanced_equals_one_device():
    """The Pallas flash kernel per shard (2 shards, mirror-balanced: each attends for its first half and the other
    shard's second half) over the gathered latent, with packed documents: one device's output, max logit and the
    gradients of all five inputs."""
    flash = functools.partial(mla_flash, scale=SCALE, block_q=8, block_k=8, interpret=pltpu.InterpretParams())
    _latent_flash(2, flash, True, 2, 16, docs=True)


@pytest.mark.slow
@pytest.mark.parametrize("n,balance,T", [(4, True, 32), (4, False, 32), (2, False, 32)])
def test_latent_flash_kernel_more_splits(n, balance, T):
    flash = functools.partial(mla_flash, scale=SCALE, block_q=8, block_k=8, interpret=pltpu.InterpretParams())
    _latent_flash(n, flash, balance, 2, T, docs=True)


@pytest.mark.parametrize("n,balance,T,grads", [(4, True, 20, False),
                                               pytest.param(4, True, 20, True, marks=pytest.mark.slow),
                                               pytest.param(4, False, 16, True, marks=pytest.mark.slow),
                                               pytest.param(2, True, 10, True, marks=pytest.mark.slow)])
def test_latent_flash_split_with_an_xla_flash(n, balance, T, grads):
    """The split's bookkeeping (swap, offsets, document ids, pmax; with ``grads`` the transposes) with XLA attention
    as the per-shard flash: 4 shards balanced with odd halves (5 tokens per shard: 2 kept, 3 swapped), contiguous,
    and 2 shards."""
    _latent_flash(n, _attention, balance, 2, T, docs=True, grads=grads)


@pytest.mark.parametrize("axes,rows,heads", [({"data": 2}, ("data",), ()), ({"tensor": 2}, (), ("tensor",))],
                         ids=["rows", "heads"])
def test_latent_flash_per_device_under_a_row_split(axes, rows, heads):
    """Without a context axis (whole sequences per device, k3jax/sharding/row_split.py): the Pallas flash kernel (TPU
    schedule and Pallas backward, in the TPU interpreter) per device on its rows or its heads, with packed documents,
    20 tokens in blocks of 8: one device's output, max logit and the gradients of all five inputs (the weights' summed
    over the rows by shard_map)."""
    B, T = 2, 20
    args, ct = _mla_inputs(B, T)
    seg = _docs(B, T)
    mesh = make_mesh(axes)
    flash = functools.partial(mla_flash, scale=SCALE, block_q=8, block_k=8, platform="tpu",
                              interpret=pltpu.InterpretParams())
    want = _grads(lambda *a: _attention(*a, segment_ids=seg), args, ct)
    with jax.set_mesh(mesh):
        got = _grads(lambda *a: RowSplit(mesh, rows, heads).latent_flash(flash, *a, segment_ids=seg), args, ct)
    _close(got, want, ("q", "c_kv", "k_rope", "w_uk", "w_uv"))


def test_causal_block_pairs_count_the_kernels_pairs_and_balance():
    """Per shard, the kernel's own count (``causal_pairs``) of each query piece; the mirror split is exactly balanced
    when the half-shard is whole blocks, and a contiguous split's last shard does 2n - 1 times the first's."""
    for T, n, bq, bk in [(64, 2, 8, 8), (96, 4, 8, 4), (40, 4, 4, 8), (256, 8, 16, 8)]:
        L = T // n
        for balance in (True, False):
            h0 = L // 2 if balance else L
            want = [causal_pairs(h0, T, bq, bk, p * L) + (causal_pairs(L - h0, T, bq, bk, (n - 1 - p) * L + h0)
                                                          if h0 < L else 0) for p in range(n)]
            assert causal_block_pairs(T, n, bq, bk, balance=balance) == want
    for n in (2, 4, 8):
        mirror = causal_block_pairs(n * 256, n, 32, 32)
        contiguous = causal_block_pairs(n * 256, n, 32, 32, balance=False)
        m = 256 // 32                                     # blocks per shard: shard p sees m p + 1, …, m p + m keys
        assert contiguous == [m * m * p + m * (m + 1) // 2 for p in range(n)]
        assert max(mirror) == min(mirror) == sum(contiguous) / n
        # the cost estimate of each shard's two calls, charged at their offsets' means over the shards: its own work
        L = 256
        charged = causal_pairs(L // 2, n * L, 32, 32, (n - 1) * L // 2) + \
            causal_pairs(L // 2, n * L, 32, 32, (n - 1) * L // 2 + L // 2)
        assert charged == mirror[0]


@pytest.mark.parametrize("B,stacked", [(4, False), (4, True), (2, False)],
                         ids=["cache-over-heads", "stacked-cache-over-heads", "cache-over-rows"])
def test_latent_decode_and_cached_flash_per_device_under_a_row_split(B, stacked):
    """Serving under a row split (rows over ``data``, heads over ``tensor``; the caches' rows over both where B
    divides — each device then swaps queries and outputs over ``tensor`` — else over ``data``): the split-KV decode
    kernel (TPU schedule, in the TPU interpreter) per device on a verify-sized piece of 3 queries per row with ragged
    cache lengths equals the float reference on one device; and the flash kernel on a prefill piece with per-row
    offsets equals one device's call."""
    from pallas_kernels.mla.decode import mla_decode
    from pallas_kernels.mla.decode_reference import mla_decode_reference

    S, T = 256, 3                                       # two key blocks of 128 (the TPU tile of an f32 cache)
    rng = np.random.default_rng(7)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    c_kv, k_rope = f(2, B, S, R), f(2, B, S, HR)
    w_uk, w_uv = f(R, N, HN) / 4, f(R, N, V) / 4
    q_nope, q_rope = f(B, T, N, HN), f(B, T, N, HR)
    kv_len = jnp.asarray([256, 140, 9, 97][:B], jnp.int32)
    q_pos = kv_len[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]
    layer = jnp.int32(1) if stacked else None
    cache = (c_kv, k_rope) if stacked else (c_kv[1], k_rope[1])
    decode = functools.partial(mla_decode, scale=SCALE, block_kv=128, platform="tpu",
                               interpret=pltpu.InterpretParams())
    want = mla_decode_reference(q_nope, q_rope, c_kv[1], k_rope[1], w_uk, w_uv, q_pos=q_pos, kv_len=kv_len,
                                scale=SCALE)
    mesh = make_mesh({"data": 2, "tensor": 2})
    split = RowSplit(mesh, ("data",), ("tensor",))
    assert latent_cache_rows(mesh, ("data",), ("tensor",), B) == (("data", "tensor") if B == 4 else ("data",))
    with jax.set_mesh(mesh):
        got = split.latent_decode(decode, q_nope, q_rope, *cache, w_uk, w_uv, q_pos=q_pos, kv_len=kv_len, layer=layer)
    assert_close(got, want, TOL["fp32_shallow"], name="decode under a row split")
    if stacked:
        return
    flash = functools.partial(mla_flash, scale=SCALE, block_q=8, block_k=8, platform="tpu",
                              interpret=pltpu.InterpretParams())
    q = jnp.concatenate([f(B, 12, N, HN), f(B, 12, N, HR)], axis=-1)
    start = jnp.asarray([200, 0, 5, 244][:B], jnp.int32)
    one = flash(q, c_kv[0], k_rope[0], w_uk, w_uv, q_offset=start)
    with jax.set_mesh(mesh):
        per = split.latent_flash(flash, q, c_kv[0], k_rope[0], w_uk, w_uv, q_offset=start)
    for a, b, name in zip(per, one, ("o", "max logit"), strict=True):
        assert_close(a, b, TOL["fp32_shallow"], name=f"cached flash under a row split: {name}")
