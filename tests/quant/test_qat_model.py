"""QAT in the full model (docs/numerics.md §10.7) on k3-tiny: gradients reach the expert weights, "off" is the plain
model, the fake-quant touches exactly the expert stacks (along `in`), and exporting the trained experts is lossless."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import quant
from k3jax.config import default_run, get_preset
from k3jax.model import forward, init_params, layer_view, lm_loss, restack, unstack


def _moe_layers(params, cfg):
    return [i for i, layer in enumerate(unstack(params, cfg)["layers"]) if "moe" in layer]


def _with_experts(params, cfg, fn):
    """A copy of params with every MoE layer's expert dict (one layer's [E, in, out] stacks) replaced by
    fn(experts)."""
    view = unstack(params, cfg)
    layers = [dict(layer, moe=dict(layer["moe"], experts=fn(layer["moe"]["experts"]))) if "moe" in layer else layer
              for layer in view["layers"]]
    return restack(dict(view, layers=layers), cfg)


@pytest.fixture(scope="module")
def tiny():
    # F = 32 so the down projection's `in` axis is whole MX blocks (export needs them; fake-quant alone would not)
    cfg = get_preset("k3-tiny")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    assert _moe_layers(params, cfg)
    return cfg, params, tokens


def test_qat_off_is_the_plain_model(tiny):
    cfg, params, tokens = tiny
    plain = forward(params, tokens, cfg)
    off = forward(params, tokens, cfg, default_run(cfg, qat="off"))
    np.testing.assert_array_equal(np.asarray(off), np.asarray(plain))
    on = forward(params, tokens, cfg, default_run(cfg, qat="weights"))
    assert not np.array_equal(np.asarray(on), np.asarray(plain))  # the fake-quant is really in the path


def test_qat_weights_quantizes_exactly_the_expert_stacks(tiny):
    # qdq is idempotent, so on pre-quantized experts qat="weights" must reproduce qat="off" bit for bit; quantizing
    # any other tensor, or the experts along another axis, would change the logits.
    cfg, params, tokens = tiny
    preq = _with_experts(params, cfg, lambda e: {k: quant.fake_quant_mxfp4(v, axis=1) for k, v in e.items()})
    off = forward(preq, tokens, cfg)
    on = forward(preq, tokens, cfg, default_run(cfg, qat="weights"))
    np.testing.assert_array_equal(np.asarray(on), np.asarray(off))


def test_qat_gradient_reaches_expert_weights(tiny):
    cfg, params, tokens = tiny
    targets = jnp.roll(tokens, -1, axis=1)
    qrun = default_run(cfg, qat="weights+acts")
    grads = jax.jit(jax.grad(lambda p: lm_loss(p, tokens, targets, cfg, qrun)))(params)
    for li in _moe_layers(params, cfg):
        for key in ("w1", "w2", "w3"):
            g = np.asarray(layer_view(grads, cfg, li)["moe"]["experts"][key], np.float64)
            assert np.isfinite(g).all(), (li, key)
            assert np.abs(g).max() > 0, (li, key)


def test_export_of_qat_experts_reproduces_qat_logits(tiny):
    cfg, params, tokens = tiny
    qat_logits = forward(params, tokens, cfg, default_run(cfg, qat="weights"))

    def round_trip(experts):
        return {k: quant.unpack_experts(*quant.pack_experts(w, name=k), dtype=w.dtype, name=k)
                for k, w in experts.items()}

    served = _with_experts(params, cfg, round_trip)
    np.testing.assert_array_equal(np.asarray(forward(served, tokens, cfg)), np.asarray(qat_logits))
