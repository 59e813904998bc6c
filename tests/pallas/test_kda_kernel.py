"""Pallas chunked-KDA kernel vs the jnp chunked rung (docs/design.md §3.3: shared bodies, interpret + compiled
classes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda
from k3jax.reference import kda as ref
from k3jax.testing import TOL, assert_close
from pallas_kernels.kda import kda_chunk

ARGS = ("q", "k", "v", "g", "beta")
# Packed rows for the segment tests, T = 150 (chunks of 64: boundaries at 64 and 128; the tail chunk is padded):
# row 0: a document inside chunk 0, a length-1 document exactly at the chunk-1 start, a length-1 document at the last
# token; row 1: other ids (any labelling works), a boundary exactly at the chunk-2 start and one inside chunk 1.
SEG_T = 150
SEG_STARTS = ([0, 30, 64, 65, 149], [0, 10, 100, 128])
SEG_IDS = np.stack([np.repeat(ids, np.diff([*starts, SEG_T]))
                    for ids, starts in zip(([3, 1, 2, 5, 4], [7, 0, 7, 2]), SEG_STARTS, strict=True)]).astype(np.int32)


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

    def scheduled(self, schedule, *args, lb, **kw):
        """The kernel on the default schedule (fori_loop over chunks) or the TPU one (interpret only; block_v = V)."""
        if schedule == "tpu":
            if not self.interpret:
                pytest.skip("the TPU schedule runs here in interpret mode only")
            return kda_chunk(*args, gate_lower_bound=lb, platform="tpu", interpret=True, **kw)
        return self.kernel(*args, lb=lb, **kw)

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
        self._grads_match(self.inputs(1, 40, gate), lb, seed=2)

    def _grads_match(self, j, lb, *, seed, **kw):
        """The kernel's gradients (its custom VJP) equal the jnp chunked path's, every input and h0 (``kw``: e.g.
        ``segment_ids``), through a loss of random weights on the output and the final state."""
        B, T, N = j["q"].shape[:3]
        rng = np.random.default_rng(seed)
        w_o = jnp.asarray(rng.standard_normal((B, T, N, self.V)), jnp.float32)
        w_s = jnp.asarray(rng.standard_normal((B, N, self.K, self.V)), jnp.float32)

        def loss(fn, q, k, v, g, beta, h0):
            o, s = fn(q, k, v, g, beta, initial_state=h0, **kw)
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

    @pytest.mark.parametrize("schedule", ["default", "tpu"])
    @pytest.mark.parametrize("gate,lb", [("safe", -5.0), ("softplus", None)])
    def test_segments_match_chunked_and_per_document(self, gate, lb, schedule):
        j = self.inputs(6, SEG_T, gate, B=2, N=1)
        # Row 1 decays slowly (a chunk keeps ~e^-3 of its state, not e^-100): a state leaking across a boundary
        # would show (e.g. an unmasked state decay at a chunk that ends in a new document).
        j["g"] = j["g"] * jnp.asarray([1.0, 0.02])[:, None, None, None]
        args = [j[a] for a in ARGS]
        seg = jnp.asarray(SEG_IDS)
        o, s = self.scheduled(schedule, *args, initial_state=j["h0"], lb=lb, segment_ids=seg)
        o_ref, s_ref = kda.kda_chunked(*args, initial_state=j["h0"], gate_lower_bound=lb, segment_ids=seg)
        assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o vs chunked")
        assert_close(s, s_ref, TOL["fp32_vs_fp64"], name="state vs chunked")
        assert float(jnp.max(jnp.abs(o - o_ref))) <= 1e-5 and float(jnp.max(jnp.abs(s - s_ref))) <= 1e-5
        # Each document on its own (the float64 oracle, no masks): a zero state, but the row's first document
        # continues the initial state; the final state is the last document's.
        o, s = np.asarray(o), np.asarray(s)
        for b, starts in enumerate(SEG_STARTS):
            ends = [*starts[1:], SEG_T]
            for d, (t0, t1) in enumerate(zip(starts, ends, strict=True)):
                h0 = j["h0"][b:b + 1] if t0 == 0 else None
                o_doc, s_doc = ref.kda_recurrent(*(x[b:b + 1, t0:t1] for x in args), initial_state=h0)
                assert_close(o[b:b + 1, t0:t1], o_doc, TOL["fp32_vs_fp64"], name=f"o row {b} doc {d}")
                assert np.max(np.abs(o[b:b + 1, t0:t1] - o_doc)) <= 1e-5, (b, d)
            assert_close(s[b:b + 1], s_doc, TOL["fp32_vs_fp64"], name=f"state row {b}")
            assert np.max(np.abs(s[b:b + 1] - s_doc)) <= 1e-5, b

    @pytest.mark.parametrize("schedule", ["default", "tpu"])
    def test_one_segment_is_bit_identical(self, schedule):
        # All-ones masks multiply by exact ones: a single document changes no bit of the output or the state.
        j = self.inputs(7, 70, "safe")
        args = [j[a] for a in ARGS]
        o, s = self.scheduled(schedule, *args, initial_state=j["h0"], lb=-5.0)
        o1, s1 = self.scheduled(schedule, *args, initial_state=j["h0"], lb=-5.0,
                                segment_ids=jnp.full((1, 70), 4, jnp.int32))
        assert np.array_equal(np.asarray(o1), np.asarray(o)) and np.array_equal(np.asarray(s1), np.asarray(s))

    def test_segments_are_static_extra_inputs(self):
        # segment_ids=None traces the kernel without the three mask inputs (the unsegmented kernel is unchanged).
        j = self.inputs(8, 20, "safe")
        args = [j[a] for a in ARGS]

        def kernel_inputs(jaxpr):  # input counts of the pallas_calls, nested jaxprs (custom_vjp, jit) included
            found = []
            for e in jaxpr.eqns:
                if e.primitive.name == "pallas_call":
                    found.append(len(e.invars))
                    continue
                for p in e.params.values():
                    for sub in p if isinstance(p, (tuple, list)) else (p,):
                        sub = getattr(sub, "jaxpr", sub)
                        if hasattr(sub, "eqns"):
                            found += kernel_inputs(sub)
            return found

        def n_kernel_inputs(**kw):
            return kernel_inputs(jax.make_jaxpr(lambda *a: self.kernel(*a, lb=-5.0, **kw))(*args).jaxpr)

        assert n_kernel_inputs() == [10]
        assert n_kernel_inputs(segment_ids=jnp.zeros((1, 20), jnp.int32)) == [13]

    # the bounded gate's case in the slow pass (14 s); the softplus gate's stays in the default one
    @pytest.mark.parametrize("gate,lb", [pytest.param("safe", -5.0, marks=pytest.mark.slow), ("softplus", None)])
    def test_segment_grads_match_chunked(self, gate, lb):
        seg = jnp.asarray(np.stack([np.repeat([0, 1, 2], [1, 63, 6]), np.repeat([5, 6], [33, 37])]), jnp.int32)
        self._grads_match(self.inputs(9, 70, gate, B=2, N=1), lb, seed=3, segment_ids=seg)

    def test_bad_input_raises(self):
        j = self.inputs(5, 20, "safe")
        with pytest.raises(ValueError, match="beta"):
            self.kernel(j["q"], j["k"], j["v"], j["g"], j["beta"] * 3.0, lb=-5.0)
        # Same tiling checks as the jnp rung (k3jax.ops.kda.check_chunking).
        with pytest.raises(ValueError, match="multiple of sub_chunk"):
            self.kernel(*(j[a] for a in ARGS), lb=-5.0, chunk_size=24)
        with pytest.raises(ValueError, match="126"):
            self.kernel(*(j[a] for a in ARGS), lb=-5.0, sub_chunk=32, chunk_size=64)
        with pytest.raises(ValueError, match="segment_ids shape"):
            self.kernel(*(j[a] for a in ARGS), lb=-5.0, segment_ids=jnp.zeros((1, 19), jnp.int32))


class TestKdaKernelInterpret(KdaKernelCases):  # CPU, every run; K = 60 is deliberately not a power of two
    interpret = True
    K, V, block_v = 60, 32, 16


@pytest.mark.gpu
class TestKdaKernelCompiled(KdaKernelCases):  # device machine only; Triton wants power-of-two blocks
    interpret = False
    K, V, block_v = 64, 64, 64


def test_lowers_for_cuda_inside_shard_map():
    """Context parallelism on GPUs: inside ``shard_map`` over an abstract 2-GPU (H200) mesh the kernel's outputs
    declare the varying mesh axes (check_vma), and the forward and its VJP lower to the Triton call. (Run on CPU
    shards in tests/sharding/test_context_parallel_kernels.py.)"""
    from jax.sharding import PartitionSpec as P

    triton = "__gpu$xla.gpu.triton"
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((2,), ("context",), abstract_device=dev)
    B, T, N, K = 1, 256, 2, 128
    split = jax.sharding.NamedSharding(mesh, P(None, "context"))
    args = [jax.ShapeDtypeStruct((B, T, N, K), dt, sharding=split) for dt in (jnp.bfloat16,) * 3 + (jnp.float32,)]
    args.append(jax.ShapeDtypeStruct((B, T, N), jnp.float32, sharding=split))

    def local(q, k, v, g, beta):                 # a zero start state as varying as the shard's inputs
        h0 = jnp.zeros((B, N, K, K), jnp.float32) + jnp.sum(g[:0])
        return kda_chunk(q, k, v, g, beta, initial_state=h0, gate_lower_bound=-5.0)[0]

    def f(*a):
        o, vjp = jax.vjp(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "context"),) * 5,
                                       out_specs=P(None, "context")), *a)
        return o, vjp(o)

    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(f), platforms=["cuda"],
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
    text = exported.mlir_module()
    assert f"stablehlo.custom_call @{triton}" in text and "kda_chunk_fwd" in text
