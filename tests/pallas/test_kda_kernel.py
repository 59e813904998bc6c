"""Pallas chunked-KDA kernel vs the jnp chunked rung (STYLE §3.3: shared bodies, interpret + compiled classes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda
from k3jax.reference import kda as ref
from k3jax.testing import TOL, assert_close
from pallas_kernels.kda import kda_chunk

ARGS = ("q", "k", "v", "g", "beta")


class KdaKernelCases:  # no Test prefix: pytest collects only the subclasses
    interpret: bool
    K: int
    V: int
    block_v: int

    @pytest.fixture(autouse=True)
    def _ieee_f32_matmuls(self):
        # The kernel's dots are IEEE fp32; on GPU the XLA reference would otherwise be free to use TF32.
        with jax.default_matmul_precision("highest"):
            yield

    def inputs(self, seed, T, gate, B=1, N=2):  # [B, T, N, K]
        x = ref.random_inputs(seed, B=B, T=T, N=N, K=self.K, V=self.V, gate=gate)
        return {name: jnp.asarray(val, jnp.float32) for name, val in x.items()}

    def kernel(self, *args, lb, **kw):
        return kda_chunk(*args, gate_lower_bound=lb, block_v=self.block_v, interpret=self.interpret, **kw)

    @pytest.mark.parametrize("T", [17, 130])
    @pytest.mark.parametrize("gate,lb", [("safe", -5.0), ("softplus", None)])
    def test_forward_matches_chunked(self, T, gate, lb):
        j = self.inputs(T, T, gate)
        o, s = self.kernel(*(j[a] for a in ARGS), initial_state=j["h0"], lb=lb)
        o_ref, s_ref = kda.kda_chunked(*(j[a] for a in ARGS), initial_state=j["h0"], gate_lower_bound=lb)
        assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o")
        assert_close(s, s_ref, TOL["fp32_vs_fp64"], name="state")

    @pytest.mark.parametrize("gate,lb", [("safe", -5.0), ("softplus", None)])
    def test_grads_match_chunked(self, gate, lb):
        j = self.inputs(1, 40, gate)
        rng = np.random.default_rng(2)
        w_o = jnp.asarray(rng.standard_normal((1, 40, 2, self.V)), jnp.float32)
        w_s = jnp.asarray(rng.standard_normal((1, 2, self.K, self.V)), jnp.float32)

        def loss(fn, q, k, v, g, beta, h0):
            o, s = fn(q, k, v, g, beta, initial_state=h0)
            return jnp.sum(o * w_o) + jnp.sum(s * w_s)

        names = (*ARGS, "h0")
        args = [j[a] for a in names]
        ref_fn = lambda *a, **kw: kda.kda_chunked(*a, gate_lower_bound=lb, **kw)  # noqa: E731
        ker_fn = lambda *a, **kw: self.kernel(*a, lb=lb, **kw)  # noqa: E731
        g_ref = jax.grad(lambda *a: loss(ref_fn, *a), argnums=range(6))(*args)
        g_ker = jax.jit(jax.grad(lambda *a: loss(ker_fn, *a), argnums=range(6)))(*args)
        for name, a, b in zip(names, g_ker, g_ref):
            assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")

    @pytest.mark.parametrize("T", [15, 16, 17, 63, 64, 65])
    def test_causal_bit_identical(self, T):
        x, y = self.inputs(3, T, "safe"), self.inputs(4, T, "safe")
        f = jax.jit(lambda *a: self.kernel(*a, lb=-5.0)[0])
        base = np.asarray(f(*(x[a] for a in ARGS)))
        for P in sorted({1, T // 2, T - 1, 16} & set(range(1, T))):
            mixed = [jnp.concatenate([x[a][:, :P], y[a][:, P:]], axis=1) for a in ARGS]
            out = np.asarray(f(*mixed))
            assert np.array_equal(out[:, :P], base[:, :P]), f"T={T} P={P}"

    def test_bad_input_raises(self):
        j = self.inputs(5, 20, "safe")
        with pytest.raises(ValueError, match="beta"):
            self.kernel(j["q"], j["k"], j["v"], j["g"], j["beta"] * 3.0, lb=-5.0)
        # Same tiling checks as the jnp rung (k3jax.ops.kda.check_chunking).
        with pytest.raises(ValueError, match="multiple of sub_chunk"):
            self.kernel(*(j[a] for a in ARGS), lb=-5.0, chunk_size=24)
        with pytest.raises(ValueError, match="126"):
            self.kernel(*(j[a] for a in ARGS), lb=-5.0, sub_chunk=32, chunk_size=64)


class TestKdaKernelInterpret(KdaKernelCases):  # CPU, every run; K = 60 is deliberately not a power of two
    interpret = True
    K, V, block_v = 60, 32, 16


@pytest.mark.gpu
class TestKdaKernelCompiled(KdaKernelCases):  # device machine only; Triton wants power-of-two blocks
    interpret = False
    K, V, block_v = 64, 64, 64
