"""LoRA dropout's arithmetic (k3jax/ops/lora.py, k3jax/ops/lora_experts.py): with a given keep mask, one adapted
projection and the routed experts' adapter tiles equal float64 NumPy references of x W + s ((x ⊙ m / (1 − p)) A) B;
the masks ``LoraDropout`` draws keep 1 − p of the inputs, are fixed by the key and differ under ``fold``; inverted
scaling keeps the adapter's output unbiased."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.grouped_matmul import tile_rows
from k3jax.ops.lora import LoraDropout, dropped, lora_einsum
from k3jax.ops.lora_experts import adapter_tiles
from k3jax.testing import TOL, assert_close

P_DROP = 0.3


@pytest.mark.parametrize("eq,x_shape,w_shape,n_in", [("btd,dnk->btnk", (2, 5, 16), (16, 3, 4), 1),
                                                     ("btnv,nvd->btd", (2, 5, 3, 4), (3, 4, 16), 2),
                                                     ("...d,df->...f", (7, 16), (16, 24), 1)],
                         ids=["kda-qkv", "mla-wo", "glu"])
def test_adapted_projection_with_a_mask_equals_float64_reference(eq, x_shape, w_shape, n_in):
    """y = x W + s ((x ⊙ m / (1 − p)) A) B: the base sees x whole, the adapter the dropped x (fp32_vs_fp64);
    ``n_in``: W's input dims (those it shares with x)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape) / 4
    a = rng.standard_normal((*w_shape[:n_in], 3)) / 4
    b = rng.standard_normal((3, *w_shape[n_in:]))
    keep = rng.random(x_shape) >= P_DROP
    scale = 2.0
    ins = int(np.prod(w_shape[:n_in]))
    xf = x.reshape(*x_shape[:len(x_shape) - n_in], ins)
    xd = np.where(keep, x / (1 - P_DROP), 0.0).reshape(xf.shape)
    want = xf @ w.reshape(ins, -1) + scale * (xd @ a.reshape(ins, 3)) @ b.reshape(3, -1)
    want = want.reshape(*x_shape[:len(x_shape) - n_in], *w_shape[n_in:])
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    got = jax.jit(lambda x, w, a, b, k: lora_einsum(eq, x, w, a, b, scale=scale, acc=jnp.float32,
                                                    x_lora=dropped(x, k, P_DROP)))(f32(x), f32(w), f32(a), f32(b),
                                                                                   jnp.asarray(keep))
    assert_close(got, want, TOL["fp32_vs_fp64"], name=eq)
    undropped = lora_einsum(eq, f32(x), f32(w), f32(a), f32(b), scale=scale, acc=jnp.float32)
    assert not np.allclose(got, undropped, atol=1e-3)


def test_masks_keep_one_minus_p_follow_the_key_and_fold_apart():
    drop = LoraDropout(jax.random.key(0), P_DROP)
    keep = np.asarray(drop.keep_mask((64, 256)))
    assert abs(keep.mean() - (1 - P_DROP)) < 0.01                   # 16384 draws: 4.4 standard deviations
    assert np.array_equal(keep, drop.keep_mask((64, 256)))
    assert not np.array_equal(keep, drop.fold(1).keep_mask((64, 256)))
    assert not np.array_equal(drop.fold(1).keep_mask((64, 256)), drop.fold(2).keep_mask((64, 256)))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 256)), jnp.float32)
    assert np.array_equal(drop(x), dropped(x, keep, P_DROP))       # __call__ = the mask it draws, applied
    raw = LoraDropout(jax.random.key_data(jax.random.key(0)), P_DROP)  # a raw uint32 key (a train state's) works too
    assert np.array_equal(raw.keep_mask((64, 256)), keep)


def _tiles_problem(shared_a: bool):
    rng = np.random.default_rng(2)
    E, R, n_in, n_out, r, tile = 4, 22, 8, 6, 3, 4
    group_sizes = jnp.asarray([7, 0, 11, 4], jnp.int32)          # an expert with no rows; sizes not tile multiples
    xs = rng.standard_normal((R, n_in))
    a = rng.standard_normal((n_in, r) if shared_a else (E, n_in, r)) / 3
    b = rng.standard_normal((E, r, n_out))
    return xs, a, b, group_sizes, tile


@pytest.mark.parametrize("shared_a", [False, True], ids=["per-expert-A", "shared-A"])
def test_adapter_tiles_with_dropout_equals_float64_reference(shared_a):
    """Each sorted row r of expert e: (x_r ⊙ m_r / (1 − p)) A_e B_e with m_r the row's slot of the mask drawn over
    the tiles [V, t, in] (the mask ``dropout.keep_mask`` gives: one bit per (row, feature)), fp32_vs_fp64."""
    xs, a, b, group_sizes, tile = _tiles_problem(shared_a)
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    tiled = tile_rows(f32(xs), group_sizes, tile)
    drop = LoraDropout(jax.random.key(3), P_DROP)
    got = jax.jit(lambda t, a, b: adapter_tiles(t, a, b, jnp.float32, drop))(tiled, f32(a), f32(b))
    keep = np.asarray(drop.keep_mask(tiled[0].shape)).reshape(-1, xs.shape[1])
    back = np.asarray(tiled[2])
    expert = np.repeat(np.arange(len(group_sizes)), np.asarray(group_sizes))
    want = np.stack([(np.where(keep[back[i]], xs[i] / (1 - P_DROP), 0.0) @ (a if shared_a else a[e])) @ b[e]
                     for i, e in enumerate(expert)])
    assert_close(got, want, TOL["fp32_vs_fp64"], name="adapter tiles")
    assert len(set(back.tolist())) == len(back)                  # one slot per row: masks are per (row, feature)


def test_inverted_dropout_keeps_the_adapter_unbiased():
    """The adapter's product is linear in its input, so its mean over keys is the undropped product: over 512 keys
    the mean lands within 5 standard errors of it (a fixed draw: the check is deterministic)."""
    xs, a, b, group_sizes, tile = _tiles_problem(False)
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    tiled = tile_rows(f32(xs), group_sizes, tile)
    plain = np.asarray(adapter_tiles(tiled, f32(a), f32(b), jnp.float32), np.float64)
    keys = jax.random.split(jax.random.key(4), 512)
    runs = np.asarray(jax.jit(jax.vmap(lambda k: adapter_tiles(tiled, f32(a), f32(b), jnp.float32,
                                                               LoraDropout(k, P_DROP))))(keys), np.float64)
    sem = runs.std(axis=0) / np.sqrt(len(keys))
    assert np.all(np.abs(runs.mean(axis=0) - plain) <= 5 * sem + 1e-6)
    assert np.all(runs.std(axis=0)[np.abs(plain) > 1e-3] > 0)       # and the masks do vary
