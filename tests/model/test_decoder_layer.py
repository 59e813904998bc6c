"""The decoder layer owns its residual (``DecoderLayer.__call__`` over the carries of k3jax/model/residual.py): on the
plain stream it is the pre-norm residual written out by hand, bit for bit; the unrolled (list) and scanned (buffer)
AttnRes forms give the same layer output and commits; and the unrolled stack, the scanned one and the cached
``extend`` all run through it (traced only: eval_shape)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import default_run, get_preset
from k3jax.model import cache as C  # noqa: N812
from k3jax.model.decoder import DecoderLayer
from k3jax.model.network import K3Model
from k3jax.model.residual import Blocks, Stream
from k3jax.ops.norms import rms_norm
from k3jax.testing import TOL, assert_close

B, T = 1, 8


def _layer(cfg):
    """An MLA + dense-FFN layer (the lightest to run eagerly); which index it runs as is the caller's."""
    return DecoderLayer(cfg, ("mla", "mlp"), jnp.float32, rngs=nnx.Rngs(0))


def _x(cfg, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, cfg.hidden_size)), jnp.float32)


def test_stream_layer_is_the_pre_norm_residual():
    cfg = get_preset("k3-tiny", attn_res_block_size=None)
    run = default_run(cfg)
    layer, h, eps, cdt = _layer(cfg), _x(cfg, 0), cfg.rms_norm_eps, jnp.dtype(run.compute_dtype)
    got, (ax, fx) = layer(Stream(h), 1, lambda lay, x: lay.mixer(x, cfg, run), cfg, run, run.moe_impl)
    a, _ = layer.mixer(rms_norm(h, layer.input_norm[...], eps, out_dtype=cdt), cfg, run)
    h1 = h + a.astype(h.dtype)
    f, want_fx = layer.ffn(rms_norm(h1, layer.post_norm[...], eps, out_dtype=cdt), cfg, run, run.moe_impl)
    np.testing.assert_array_equal(got.h, h1 + f.astype(h.dtype))
    assert set(fx) == set(want_fx)


@pytest.mark.parametrize("l", [3, 4])  # blocks of 3: layer 3 commits a block, layer 4 does not
def test_list_and_buffer_forms_give_one_layer(l):
    cfg = get_preset("k3-tiny", attn_res_block_size=3)
    run = default_run(cfg)
    layer = _layer(cfg)
    mixer = lambda lay, x: lay.mixer(x, cfg, run)  # noqa: E731
    carry = Blocks(_x(cfg, 1), tuple(_x(cfg, 2 + i) for i in range(-(-l // 3))))   # the blocks committed before l
    listed, _ = layer(carry, l, mixer, cfg, run, run.moe_impl)
    buffered, _ = layer(carry.buffered(3), jnp.int32(l), mixer, cfg, run, run.moe_impl)
    commits = len(carry.blocks) + (l % 3 == 0)
    assert len(listed.blocks) == commits
    got = buffered.listed(commits)
    for a, b in zip(got.blocks, listed.blocks, strict=True):
        np.testing.assert_array_equal(a, b)
    assert_close(got.part, listed.part, TOL["fp32_shallow"], name=f"layer {l} running sum")


def test_unrolled_scanned_and_cached_stacks_call_the_layer(monkeypatch):
    cfg = get_preset("k3-tiny", first_k_dense_replace=0)       # one scanned group (layers 0-3), the tail layer 4
    calls = []
    real = DecoderLayer.__call__
    monkeypatch.setattr(DecoderLayer, "__call__",
                        lambda self, carry, l, *a, **kw: calls.append(l) or real(self, carry, l, *a, **kw))
    toks = jnp.zeros((B, T), jnp.int32)
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    jax.eval_shape(lambda: model(toks))
    assert calls == list(range(5))                                   # the loop: every layer, in order
    calls.clear()
    scanned = K3Model(cfg, default_run(cfg, layer_stack="scan"), rngs=nnx.Rngs(0))
    jax.eval_shape(lambda: scanned(toks))
    assert len(calls) == 5 and calls[-1] == 4 and all(isinstance(l, jax.core.Tracer) for l in calls[:4])
    calls.clear()
    cache = C.init_cache(cfg, B, T, stacked=True)
    jax.eval_shape(lambda: scanned.extend(toks, dict(cache["layers"]), group_caches=cache["groups"],
                                          start=jnp.zeros((B,), jnp.int32), lengths=jnp.full((B,), T, jnp.int32)))
    assert len(calls) == 5
