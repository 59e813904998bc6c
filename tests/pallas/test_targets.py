"""Every Pallas kernel builds for every target at K3's shapes, on a CPU-only machine (docs/numerics.md §14.3):

  * cuda: Triton lowering for an abstract NVIDIA H200 (jax.export; the module must hold the Triton custom call);
  * tpu:  Mosaic, compiled by libtpu for deviceless TPU v5p / v6e topologies (one chip of each).

Shapes: expert matrices in the latent space (torch [out, in]: w1 / w3 [3072, 3584], w2 [3584, 3072]), M = 256 rows
(the grouped entry point also through its VJP: the forward kernel, then the transposed one for the rows' gradient);
KDA with 96 heads, K = V = 128, chunk 64, T = 256 (four chunks), also with packed documents (segment_ids: the
kernel's three mask inputs); MLA decode with 96 heads over an 8192-key bf16 cache (T = 1, and T = 8 over a cache
stacked over layers) and the MLA flash kernel at T = S = 2048 (forward; its VJP and packed documents in the slow
pass; each MLA kernel compiled for v5p in the default pass, v6e in the slow one), and the fused GLU + MXFP8 kernel
over f32 a, b [256, 3072] (v5p default, v6e slow). The platform comes from the mesh
each test enters (``pallas_kernels.platform.target_platform``), as it would for a caller. Default suite: each entry
point lowered for cuda once and compiled once per TPU generation (v5p and v6e take different orientations; KDA with
K3's bounded gate); the other combinations run in the slow pass. The TPU schedules' numerics are checked here too
(slow pass), in interpret mode against the jnp references.
"""

import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.cli.main import jax_platforms_override
from k3jax.ops import kda
from k3jax.ops.activations import glu_activation
from k3jax.quant import mxfp4_pack
from k3jax.reference import kda as kda_ref
from k3jax.testing import TOL, assert_close
from pallas_kernels.glu_quant import glu_mxfp8
from pallas_kernels.kda import kda_chunk
from pallas_kernels.kda.step import kda_step as kda_decode_step
from pallas_kernels.mla import mla_decode, mla_flash
from pallas_kernels.mxfp4_matmul import mxfp4_gmm, mxfp4_matmul
from pallas_kernels.mxfp4_matmul.reference import mxfp4_gmm_loop_reference, mxfp4_matmul_reference
from pallas_kernels.mxfp4_matmul.rows import mxfp4_glu_ffn_rows
from pallas_kernels.platform import target_platform

M, G = 256, 8  # rows, experts in the grouped call
M_TRAIN = 8192  # a training-sized grouped call: ceil(M/bm) = 32 > 2·G = 16 row tiles, the static ("parallel") TPU grid
# (N, K) in torch orientation: w1 / w3 map 3584 -> 3072 (K = 3584), w2 maps 3072 -> 3584
WEIGHTS = {"w13": (3072, 3584), "w2": (3584, 3072)}
B, T, H, DK = 1, 256, 96, 128  # KDA: batch, tokens, heads, K = V
TOPOLOGIES = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
TRITON_CALL = "__gpu$xla.gpu.triton"
MLA = {"N": 96, "Hn": 128, "Hr": 64, "R": 512, "V": 128, "S": 8192}  # K3's MLA decode, B = 1: a cache of 8192 keys
MLA_T = 2048  # MLA flash (prefill / training): T = S = 2048
GLU_ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)


def _mxfp4_args(N, K, grouped, sharding=None, rows=M):
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    lead = (G,) if grouped else ()
    args = [S((rows, K), jnp.bfloat16), S((*lead, N, K // 2), jnp.uint8), S((*lead, N, K // 32), jnp.uint8)]
    return args + [S((G,), jnp.int32)] if grouped else args


def _kda_args(sharding=None, segments=False):
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    qkv = [S((B, T, H, DK), jnp.bfloat16) for _ in range(3)]
    seg = [S((B, T), jnp.int32)] if segments else []
    return qkv + [S((B, T, H, DK), jnp.float32), S((B, T, H), jnp.float32), S((B, H, DK, DK), jnp.float32), *seg]


def _dense(x, packed, scale):
    return mxfp4_matmul(x, packed, scale)


def _grouped(x, packed, scale, group_sizes):
    return mxfp4_gmm(x, packed, scale, group_sizes)


def _grouped_bwd(x, packed, scale, group_sizes):
    """The rows' gradient through the grouped kernel: the forward, then the transposed kernel (cotangent y)."""
    y, vjp = jax.vjp(lambda x: mxfp4_gmm(x, packed, scale, group_sizes), x)
    return vjp(y)[0]


def _mla_decode_args(T, layers=None, sharding=None):
    """K3 decode of T query tokens (1, or 8 = a speculative verify) over a bf16 latent cache, stacked over ``layers``
    (then indexed by an int32 layer, scalar-prefetched on TPU) or one layer's."""
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    d, lead, bf = MLA, (() if layers is None else (layers,)), jnp.bfloat16
    args = [S((1, T, d["N"], d["Hn"]), bf), S((1, T, d["N"], d["Hr"]), bf), S((*lead, 1, d["S"], d["R"]), bf),
            S((*lead, 1, d["S"], d["Hr"]), bf), S((d["R"], d["N"], d["Hn"]), bf), S((d["R"], d["N"], d["V"]), bf),
            S((1, T), jnp.int32), S((1,), jnp.int32)]
    return args + ([S((), jnp.int32)] if layers else [])


def _mla_decode(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos, kv_len, layer=None):
    return mla_decode(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos=q_pos, kv_len=kv_len,
                      scale=(MLA["Hn"] + MLA["Hr"]) ** -0.5, layer=layer)


def _mla_flash_args(sharding=None, segments=False):
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    d, bf = MLA, jnp.bfloat16
    args = [S((1, MLA_T, d["N"], d["Hn"] + d["Hr"]), bf), S((1, MLA_T, d["R"]), bf), S((1, MLA_T, d["Hr"]), bf),
            S((d["R"], d["N"], d["Hn"]), bf), S((d["R"], d["N"], d["V"]), bf)]
    return args + [S((1, MLA_T), jnp.int32)] if segments else args


def _mla_flash(vjp, segments=False):
    def f(q, c_kv, k_rope, w_uk, w_uv, *seg):
        fwd = lambda *x: mla_flash(*x, scale=(MLA["Hn"] + MLA["Hr"]) ** -0.5,  # noqa: E731
                                   segment_ids=seg[0] if segments else None)
        if not vjp:
            return fwd(q, c_kv, k_rope, w_uk, w_uv)
        (o, m), back = jax.vjp(fwd, q, c_kv, k_rope, w_uk, w_uv)
        return back((o, jnp.zeros_like(m)))          # the gradients: outputs shaped like the five inputs
    return f


ENTRY = {"dense": _dense, "grouped": _grouped, "grouped_bwd": _grouped_bwd, "grouped_bwd_train": _grouped_bwd}


def _kda(lb, segments=False):
    def f(q, k, v, g, beta, h0):
        return kda_chunk(q, k, v, g, beta, initial_state=h0, gate_lower_bound=lb)

    def f_segments(q, k, v, g, beta, h0, segment_ids):
        return kda_chunk(q, k, v, g, beta, initial_state=h0, gate_lower_bound=lb, segment_ids=segment_ids)
    return f_segments if segments else f


ROWS = {"A": 16, "G": 14, "L": 2}  # the small-batch routed FFN: top-16 decode rows on one chip's experts, 2 layers


def _rows_ffn_case(F, N, sharding):
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    P, (A, G, L) = WEIGHTS["w13"][1], ROWS.values()
    stack = lambda n, k: (S((L, G, n, k // 2), jnp.uint8), S((L, G, n, k // 32), jnp.uint8))  # noqa: E731

    def f(x, ids, wts, w1, w3, w2, layer):
        return mxfp4_glu_ffn_rows(x, ids, wts, (*w1, layer), (*w3, layer), (*w2, layer), GLU_ACT,
                                  act_quant_rule="ceil", expected_groups=9.6)

    return f, [S((N, P), jnp.bfloat16), S((N, A), jnp.int32), S((N, A), jnp.float32), stack(F, P), stack(F, P),
               stack(P, F), S((), jnp.int32)]


STEP_ROWS, STEP_LAYERS = 4, 22   # the KDA decode step: a chip's rows (decode B = 64 on serve expert=16) and a stack


def _kda_step_case(sharding):
    S = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)  # noqa: E731
    vec = (STEP_ROWS, H, DK)

    def f(q, k, v, g, beta, states, layer):
        return kda_decode_step(q, k, v, g, beta, states, layer, scale=DK ** -0.5)

    return f, [S(vec), S(vec), S(vec), S(vec), S(vec[:2]), S((STEP_LAYERS, *vec, DK)),
               jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)]


# ---------------------------------------------------------------------------------------------------------------
# cuda: Triton lowering (seconds)


@pytest.fixture(scope="module")
def h200_mesh():
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)


def _lower_cuda(mesh, f, args) -> str:
    with jax.sharding.use_abstract_mesh(mesh):
        assert target_platform() == "gpu"
        exported = jax.export.export(jax.jit(f), platforms=["cuda"],
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("kind,weight", [
    ("dense", "w13"), ("grouped", "w2"), ("grouped_bwd", "w13"), pytest.param("dense", "w2", marks=pytest.mark.slow),
    pytest.param("grouped", "w13", marks=pytest.mark.slow), pytest.param("grouped_bwd", "w2", marks=pytest.mark.slow)],
    ids=["dense-w13", "grouped-w2", "grouped_bwd-w13", "dense-w2", "grouped-w13", "grouped_bwd-w2"])
def test_mxfp4_lowers_for_cuda(h200_mesh, kind, weight):
    text = _lower_cuda(h200_mesh, ENTRY[kind], _mxfp4_args(*WEIGHTS[weight], kind != "dense"))
    assert f"stablehlo.custom_call @{TRITON_CALL}" in text
    assert "mxfp4_gmm_fwd" in text  # the GPU default for both entry points: the loop schedule
    assert ("mxfp4_gmm_bwd_x" in text) == (kind == "grouped_bwd")  # the rows' gradient: the transposed kernel


@pytest.mark.parametrize("lb,segments", [
    (-5.0, False), (-5.0, True), pytest.param(None, False, marks=pytest.mark.slow)],
    ids=["bounded", "bounded-segments", "softplus"])
def test_kda_lowers_for_cuda(h200_mesh, lb, segments):
    text = _lower_cuda(h200_mesh, _kda(lb, segments), _kda_args(segments=segments))
    assert f"stablehlo.custom_call @{TRITON_CALL}" in text and "kda_chunk_fwd" in text


# ---------------------------------------------------------------------------------------------------------------
# tpu: Mosaic compiled by libtpu for deviceless topologies, in a child process
#
# libtpu lets one process at a time load it (/tmp/libtpu_lockfile) and keeps the lock until that process exits, so
# the compiles run in one child python per test, one test at a time (an flock around the child), and the pytest
# worker never loads libtpu. The xdist_group mark is not enough on its own: pytest-xdist 3.8 tags grouped node ids
# through `item._nodeid`, which pytest 9 no longer reads, so `--dist loadgroup` spreads a group over the workers.

# case -> (entry point, generation, weight or gate lower bound)
TPU_CASES = {
    "dense-v5p-w13": ("dense", "v5p", "w13"), "dense-v6e-w2": ("dense", "v6e", "w2"),
    "grouped-v5p-w2": ("grouped", "v5p", "w2"), "grouped-v6e-w13": ("grouped", "v6e", "w13"),
    "kda-v5p-bounded": ("kda", "v5p", -5.0), "kda-v6e-bounded": ("kda", "v6e", -5.0),  # K3's gate (kimi-k3: -5)
    "grouped_bwd-v5p-w13": ("grouped_bwd", "v5p", "w13"),
    "kda_segments-v5p-bounded": ("kda_segments", "v5p", -5.0),  # packed documents (~4 s)
    "dense-v5p-w2": ("dense", "v5p", "w2"), "dense-v6e-w13": ("dense", "v6e", "w13"),
    "grouped-v5p-w13": ("grouped", "v5p", "w13"), "grouped-v6e-w2": ("grouped", "v6e", "w2"),
    "kda-v5p-softplus": ("kda", "v5p", None), "kda-v6e-softplus": ("kda", "v6e", None),
    "grouped_bwd-v6e-w2": ("grouped_bwd", "v6e", "w2"), "kda_segments-v6e-softplus": ("kda_segments", "v6e", None),
    # MLA decode: (T, stacked layers or None); MLA flash: (the VJP too, packed documents)
    "mla_decode-v5p-T8-stacked": ("mla_decode", "v5p", (8, 2)), "mla_decode-v6e-T1": ("mla_decode", "v6e", (1, None)),
    "mla_flash-v5p": ("mla_flash", "v5p", (False, False)), "mla_flash-v6e": ("mla_flash", "v6e", (False, False)),
    "mla_decode-v5p-T1": ("mla_decode", "v5p", (1, None)), "mla_decode-v6e-T8-stacked": ("mla_decode", "v6e", (8, 2)),
    "mla_flash_segments-v5p": ("mla_flash", "v5p", (False, True)),
    "mla_flash_bwd-v5p": ("mla_flash", "v5p", (True, False)), "mla_flash_bwd-v6e": ("mla_flash", "v6e", (True, False)),
    "grouped_bwd_train-v5p-w13": ("grouped_bwd_train", "v5p", "w13"),  # the static grid's transposed kernel (~18 s)
    # the fused GLU + MXFP8 of the experts' hidden: f32 a, b [M, F] -> bf16 h (default: v5p; v6e in the slow pass)
    "glu_mxfp8-v5p": ("glu_mxfp8", "v5p", None), "glu_mxfp8-v6e": ("glu_mxfp8", "v6e", None),
    # the small-batch routed FFN: (F, token rows), top-16 over a chip's 14 experts of a 2-layer stack read in place;
    # F = 3072 (expert = 64) and F = 768 (its F over tensor = 4); 64 rows (decode B = 64), 512 (its MAX_ROWS: verify)
    "rows_ffn-v5p": ("rows_ffn", "v5p", (3072, 64)), "rows_ffn-v6e": ("rows_ffn", "v6e", (768, 64)),
    "rows_ffn-v5p-512rows": ("rows_ffn", "v5p", (3072, 512)),
    # KDA's decode step, the state updated in place in a 22-layer stack (donated: no copy of the stack)
    "kda_step-v5p": ("kda_step", "v5p", None), "kda_step-v6e": ("kda_step", "v6e", None),
}
# default suite: every kernel entry point once per generation (~35 s on an idle 2-core machine, KDA most of it), and
# KDA with packed documents once (~4 s more)
# ... and each MLA kernel once (v5p: decode 3.3 s, the flash forward ~6 s; v6e in the slow pass)
_DEFAULT = list(TPU_CASES)[:8] + ["mla_decode-v5p-T8-stacked", "mla_flash-v5p", "glu_mxfp8-v5p", "rows_ffn-v5p",
                                  "kda_step-v5p"]
TPU_TIERS = {"default": _DEFAULT, "slow": [c for c in TPU_CASES if c not in _DEFAULT]}
_LOCK = "/tmp/k3jax_libtpu_tests.lock"


def _tpu_compile(name) -> dict:
    """In the child: compile one case for one chip of its topology; sizes and seconds as a dict."""
    from jax.experimental import topologies

    kind, generation, arg = TPU_CASES[name]
    topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[generation], platform="tpu")
    # One chip: a Mosaic kernel is not auto-partitioned (several chips would need a shard_map around it).
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if kind == "mla_decode":
        tokens, layers = arg
        f, args = _mla_decode, _mla_decode_args(tokens, layers, sharding)
        out_bytes = tokens * MLA["N"] * MLA["V"] * 4  # o [1, T, N, V] fp32
    elif kind == "mla_flash":
        vjp, segments = arg
        f, args = _mla_flash(vjp, segments), _mla_flash_args(sharding, segments)
        out_bytes = sum(a.size * a.dtype.itemsize for a in args[:5]) if vjp else \
            MLA_T * MLA["N"] * MLA["V"] * 2 + MLA["N"] * 4      # o [1, T, N, V] bf16, max_logit [1, N] fp32
    elif kind == "glu_mxfp8":
        F = WEIGHTS["w13"][0]
        f = lambda a, b: glu_mxfp8(a, b, GLU_ACT, jnp.bfloat16)  # noqa: E731
        args = [jax.ShapeDtypeStruct((M, F), jnp.float32, sharding=sharding) for _ in range(2)]
        out_bytes = M * F * 2
    elif kind == "rows_ffn":
        f, args = _rows_ffn_case(*arg, sharding)
        out_bytes = arg[1] * WEIGHTS["w13"][1] * 4                    # y [N, P] fp32
    elif kind == "kda_step":
        f, args = _kda_step_case(sharding)
        out_bytes = STEP_ROWS * H * DK * 4 + STEP_LAYERS * STEP_ROWS * H * DK * DK * 4   # o, the stack (aliased)
    elif kind in ("kda", "kda_segments"):
        segments = kind == "kda_segments"
        f, args = _kda(arg, segments), _kda_args(sharding, segments)
        out_bytes = B * T * H * DK * 2 + B * H * DK * DK * 4
    else:
        N, K = WEIGHTS[arg]
        rows = M_TRAIN if kind == "grouped_bwd_train" else M
        f, args = ENTRY[kind], _mxfp4_args(N, K, kind != "dense", sharding, rows=rows)
        out_bytes = rows * (K if kind.startswith("grouped_bwd") else N) * 2
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # also what Mosaic reads the TPU version from
        platform = target_platform()
        donate = (5,) if kind == "kda_step" else ()                      # the stacked state, updated in place
        compiled = jax.jit(f, donate_argnums=donate).lower(*args).compile()
    mem = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes",
              "alias_size_in_bytes")
    return {"platform": platform, "compile_s": round(time.perf_counter() - t0, 2),
            "input_bytes": sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(args)),
            "want_output_bytes": out_bytes,
            "mosaic": compiled.as_text().count('custom_call_target="tpu_custom_call"')
            >= 1 + kind.startswith("grouped_bwd"),
            **{k: getattr(mem, k) for k in fields}}


def _child_main(names) -> None:
    for name in names:
        try:
            result = {"name": name, **_tpu_compile(name)}
        except Exception as e:  # reported per case by the parent
            result = {"name": name, "error": f"{type(e).__name__}: {e}"[:2000]}
        print("RESULT " + json.dumps(result), flush=True)


def _compile_in_child(names) -> dict:
    import fcntl
    import subprocess
    import sys

    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one libtpu child at a time, across pytest workers
        proc = subprocess.run([sys.executable, __file__, *names], capture_output=True, text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r.pop("name")] = r
    assert set(results) == set(names), f"child exit {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}"
    return results


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("tier", ["default", pytest.param("slow", marks=pytest.mark.slow)])
def test_kernels_compile_for_tpu(tier):
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[tpu]')")
    results = _compile_in_child(TPU_TIERS[tier])
    print(json.dumps(results, indent=1))  # compile seconds and memory_analysis per case: pytest -rP shows them
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not errors, errors
    for name, r in results.items():
        assert r["platform"] == "tpu" and r["mosaic"], name
        assert r["argument_size_in_bytes"] >= r["input_bytes"], name  # every input reaches the chip, maybe padded
        assert r["output_size_in_bytes"] >= r["want_output_bytes"], name
        if name.startswith("kda_step"):   # the donated stack is the output's buffer, and no copy of it is made
            stack = STEP_LAYERS * STEP_ROWS * H * DK * DK * 4
            assert r["alias_size_in_bytes"] >= stack and r["temp_size_in_bytes"] < stack // STEP_LAYERS, (name, r)


# ---------------------------------------------------------------------------------------------------------------
# the TPU schedules' numerics, in interpret mode on CPU (small shapes; TPU tiling rules respected). Slow pass: the
# Pallas interpreter takes 15-25 s per case on the shared 2-core machine, more than the compiles above.


@pytest.mark.slow
def test_mxfp4_tpu_schedule_matches_reference():
    k = jax.random.split(jax.random.key(0), 3)
    packed, scale = mxfp4_pack(jax.random.normal(k[0], (3, 128, 512)))
    x = jax.random.normal(k[1], (40, 512))
    blocks = {"block_n": 128, "block_k": 256, "platform": "tpu", "interpret": True}  # two k steps
    y = mxfp4_matmul(x, packed[0], scale[0], **blocks)
    assert_close(y, mxfp4_matmul_reference(x, packed[0], scale[0]), TOL["fp32_vs_fp64"], name="dense")
    gs = jnp.array([5, 0, 23], jnp.int32)  # an empty expert, unused tail tiles, rows past the groups
    y = mxfp4_gmm(x, packed, scale, gs, block_m=16, **blocks)
    assert_close(y, mxfp4_gmm_loop_reference(x, packed, scale, gs), TOL["fp32_vs_fp64"], name="grouped")
    np.testing.assert_array_equal(np.asarray(y)[28:], 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("gate,lb", [("safe", -5.0), ("softplus", None)])
def test_kda_tpu_schedule_matches_chunked(gate, lb):
    j = {n: jnp.asarray(v, jnp.float32) for n, v in kda_ref.random_inputs(3, B=1, T=100, N=1, K=64, V=128,
                                                                           gate=gate).items()}
    args = [j[a] for a in ("q", "k", "v", "g", "beta")]
    with jax.default_matmul_precision("highest"):
        o, s = kda_chunk(*args, initial_state=j["h0"], gate_lower_bound=lb, platform="tpu", interpret=True)
        o_ref, s_ref = kda.kda_chunked(*args, initial_state=j["h0"], gate_lower_bound=lb)
    assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o")
    assert_close(s, s_ref, TOL["fp32_vs_fp64"], name="state")


def test_tpu_blocks_are_checked():
    packed, scale = jnp.zeros((256, 512), jnp.uint8), jnp.zeros((256, 32), jnp.uint8)
    with pytest.raises(ValueError, match="TPU blocks"):
        mxfp4_matmul(jnp.ones((8, 1024)), packed, scale, block_k=128, platform="tpu", interpret=True)
    with pytest.raises(ValueError, match="'grid' on TPU"):
        mxfp4_matmul(jnp.ones((8, 1024)), packed, scale, schedule="loop", platform="tpu", interpret=True)
    assert target_platform() == "cpu" and target_platform("cuda") == "gpu"
    with pytest.raises(ValueError, match="platform must be"):
        target_platform("metal")


# ---------------------------------------------------------------------------------------------------------------
# `k3` picks JAX_PLATFORMS so libtpu's one-process lock is not taken on machines without a TPU


@pytest.mark.parametrize("env,devices,libtpu,want", [
    ({}, set(), True, "cpu"),                                   # CPU machine with libtpu: keep off the lock
    ({}, set(), False, None),                                   # no libtpu: nothing to avoid
    ({"JAX_PLATFORMS": "tpu"}, set(), True, None),              # the caller's choice stands
    ({"JAX_PLATFORMS": ""}, set(), True, None),
    ({}, {"/dev/accel*"}, True, None),                          # TPU VM (v4 / v5e / v6e)
    ({}, {"/dev/vfio/[0-9]*"}, True, None),                     # TPU VM (v5p / vfio)
    ({}, {"/dev/nvidia0"}, True, None),                         # GPU machine: JAX finds the GPU as usual
])
def test_cli_jax_platforms_override(env, devices, libtpu, want):
    assert jax_platforms_override(env, lambda pattern: pattern in devices, libtpu) == want


if __name__ == "__main__":  # the libtpu child of test_kernels_compile_for_tpu
    import sys

    _child_main(sys.argv[1:])


def test_training_case_takes_the_static_grid():
    """The training-sized compile case runs the static ("parallel": both v5p cores) grid, the others the dynamic one
    (only the used row tiles)."""
    from pallas_kernels.mxfp4_matmul import kernel

    assert kernel.static_tpu_grid(-(-M_TRAIN // 256) + G + 1, G)  # TPU bm = 256
    assert not kernel.static_tpu_grid(-(-M // 256) + G + 1, G)
