"""KDA's decode-step kernel (pallas_kernels/kda/step.py) in Pallas' interpreter: the layer's slice of a stacked state
advanced as the jnp step (``k3jax.ops.kda.kda_step``) and the float64 recurrence advance it, the other layers left
bit for bit, the heads in blocks or whole; its input checks. The Mosaic compile (in place in a donated stack) is
``tests/pallas/test_targets.py``'s ``kda_step`` cases; the model's decode through it, ``tests/sharding``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda as kda_ops
from k3jax.reference import kda as kda_ref
from k3jax.testing import TOL, assert_close
from pallas_kernels.kda.step import kda_step, step_cost


def _inputs(B, N, K, V, L, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, N, K))
    k = kda_ops.l2norm(jax.random.normal(ks[1], (B, N, K)))
    v = jax.random.normal(ks[2], (B, N, V))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, N, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, N)))
    states = jax.random.normal(ks[5], (L, B, N, K, V))
    return q, k, v, g, beta, states


@pytest.mark.parametrize("B,N,K,V,block_heads", [(2, 16, 128, 128, 8), (3, 3, 16, 32, None)])
def test_the_kernel_advances_its_layer_as_the_step_does(B, N, K, V, block_heads):
    q, k, v, g, beta, states = _inputs(B, N, K, V, L=3)
    scale = K ** -0.5
    o, new = kda_step(q, k, v, g, beta, states, jnp.int32(1), scale=scale, block_heads=block_heads, interpret=True)
    o_ref, s_ref = kda_ops.kda_step(q, k, v, g, beta, states[1], scale=scale)
    assert_close(o, o_ref, TOL["fp32_shallow"], name="o")
    assert_close(new[1], s_ref, TOL["fp32_shallow"], name="state")
    assert (np.asarray(new[0]) == np.asarray(states[0])).all() and (np.asarray(new[2]) == np.asarray(states[2])).all()
    # the float64 recurrence over one token
    o64, s64 = kda_ref.kda_recurrent(*(np.asarray(a)[:, None] for a in (q, k, v, g, beta)), scale=scale,
                                     initial_state=np.asarray(states[1]))
    assert_close(o, o64[:, 0], TOL["fp32_vs_fp64"], name="o vs fp64")
    assert_close(new[1], s64, TOL["fp32_vs_fp64"], name="state vs fp64")


def test_inputs_it_cannot_take_are_refused():
    q, k, v, g, beta, states = _inputs(1, 16, 128, 128, L=2)
    with pytest.raises(ValueError, match="stacked"):
        kda_step(q, k, v, g, beta, states[0], 0, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="fp32 state"):
        kda_step(q, k, v, g, beta, states.astype(jnp.bfloat16), 0, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="tiles heads by 6 \\(on TPU a multiple of 8 sublanes, or all heads\\)"):
        kda_step(q[:, :12], k[:, :12], v[:, :12], g[:, :12], beta[:, :12], states[:, :, :12], 0, scale=1.0,
                 block_heads=6)
    with pytest.raises(ValueError, match="k shape .* must equal q shape"):                # the jnp step's checks
        kda_step(q, k[..., :64], v, g, beta, states, 0, scale=1.0, interpret=True)


def test_cost_is_every_operand_once():
    """The declared bytes are the kernel's operands as it takes them (q, k, beta k, g [B, N, K], v, o [B, N, V], fp32)
    plus the state read and written once, counted here from the arrays rather than restated."""
    q, k, v, g, beta, states = _inputs(4, 16, 128, 128, L=3)
    o, _ = kda_step(q, k, v, g, beta, states, 0, scale=1.0, interpret=True)
    layer = states[0]
    want = sum(a.size * 4 for a in (q, k, beta[..., None] * k, g, v, o)) + 2 * layer.size * 4
    assert step_cost(*q.shape, v.shape[-1])["bytes_accessed"] == want
