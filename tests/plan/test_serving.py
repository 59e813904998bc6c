"""Serving plans (`k3 plan --compile --mode prefill | decode`, k3jax/plan/aot.py ``serving_program``): the program a
plan compiles is the real one — on 8 simulated CPU devices its prefill and its decode steps equal one device's
``cache.prefill`` / ``cache.decode_step`` (f32, packed MXFP4 experts), with the batch split over the token axes and
under the small-batch rule (rows replicated, each device's local experts on every row, one psum); and the plan's
figures: the cache in the arguments, the MLA key loops counted at the planned context, tokens/s."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import default_run, get_preset, k3_full_attn_layers
from k3jax.model import cache as C  # noqa: N812
from k3jax.model.layout import layout
from k3jax.plan import aot, estimate, hardware
from k3jax.plan import spec as plan_spec
from k3jax.pytree import key_names
from k3jax.quant import pack_params
from k3jax.sharding import placement as place
from k3jax.sharding.expert_parallel import ExpertParallel
from k3jax.sharding.mesh import make_mesh
from k3jax.testing import TOL, assert_close, random_params

# k3-tiny widths, 13 layers: unrolled head 0-3, two scanned groups 4-7 and 8-11 (the plans' cache layout carries
# their caches through the scan), tail 12; vocab 97 and expert F = 32 (one MXFP4 scale block) do not split over
# ep_tp's tensor axis: 96 and 64 do
TINY = get_preset("k3-tiny", num_layers=13, full_attn_layers=k3_full_attn_layers(13), attn_res_block_size=3,
                  vocab_size=96, moe_intermediate_size=64)
RUN = default_run(TINY)  # float32: the mesh and the single device differ by summation order only
T, CONTEXT, STEPS = 20, 40, 3  # prompt, context (the tiny MLA key block is 8: 3 and 5 key blocks), decode steps


@pytest.fixture(scope="module")
def params():
    """Packed k3-tiny parameters (NumPy draws; norms 1 and routed experts 10x larger, so the experts move the
    logits well above the tolerance)."""
    def fix(path, a):
        names = key_names(path)
        return np.ones_like(a) if "norm" in str(names[-1]) else a * 10 if "experts" in names else a

    p = jax.tree.map(jnp.asarray, jax.tree_util.tree_map_with_path(fix, random_params(TINY, seed=5)))
    return pack_params(p)


def _program(params, mesh_axes, mode, batch, *, small=False, packed_kernel="auto", run=RUN, strategy=None):
    sizes, strategy = place.resolve_mesh(mesh_axes, devices=8, strategy=strategy)
    mesh = make_mesh(sizes)
    spec = plan_spec.PlanSpec(mode=mode, mesh=mesh_axes, batch=batch, seq_len=T if mode == "prefill" else 1,
                              context=CONTEXT, capacity_factor=-1.0, strategy=strategy)
    whole = mode == "decode" and place.whole_rows(strategy, mesh, batch)       # as aot.build_program decides
    ep = ExpertParallel(mesh, strategy, replicate_tokens=whole, cache_rows=whole and not small,
                        packed_kernel=packed_kernel)
    fn, args = aot.serving_program(TINY, spec, mesh, strategy, run=run, params=params, dispatch=ep, small=small,
                                   whole=whole)
    put = partial(jax.tree.map, lambda x, a: jax.device_put(x, a.sharding))
    own = partial(jax.tree.map, jnp.copy)  # the program donates its cache: never the caller's arrays
    # the plan's program takes the scanned cache layout
    return lambda p, tok, cache: fn(put(p, args[0]), put(tok, args[1]), put(own(C.stack_cache(cache, TINY)), args[2]))


def _tokens(batch, width, seed):
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, (batch, width)).astype(np.int32)


def _decode_both(params, mesh_axes, mine, ref, last, batch, small, packed_kernel="auto", run=RUN, strategy=None):
    """STEPS greedy decode steps with the plan's decode program on the mesh from ``mine`` and on one device (the
    flat cache layout, ``RUN``) from ``ref``."""
    step = _program(params, mesh_axes, "decode", batch, small=small, packed_kernel=packed_kernel, run=run,
                    strategy=strategy)
    for s in range(STEPS):
        ids = np.asarray(jnp.argmax(last, -1), np.int32)
        got, mine = step(params, ids[:, None], mine)
        last, ref = C.decode_step(params, ids, ref, TINY, RUN)
        err = assert_close(got, last, TOL["fp32_mesh_vs_single"], name=f"decode step {s}")
        print(f"{mesh_axes} B={batch} small={small} {packed_kernel}: decode step {s} rel-RMS {err:.2e}")
    for l in TINY.mla_layers:
        assert_close(C.unstack_cache(mine, TINY)["layers"][l]["c_kv"], ref["layers"][l]["c_kv"],
                     TOL["fp32_mesh_vs_single"], name=f"latent cache, layer {l}")
    assert np.asarray(mine["lengths"]).tolist() == [T + STEPS] * batch


@pytest.mark.parametrize("mesh_axes,mla,batch", [("data=2,expert=4", "xla", 8), ("expert=4,tensor=2", "pallas", 8),
                                                 pytest.param("expert=4,tensor=2", "xla", 4, marks=pytest.mark.slow),
                                                 pytest.param("expert=4,tensor=2", "pallas", 4,
                                                              marks=pytest.mark.slow)])
def test_prefill_then_decode_on_a_mesh_equals_one_device(params, mesh_axes, mla, batch):
    """The batch split over the token axes (data x expert: 8 rows, one per device; ep_tp: 4 ways, KDA heads and
    their state over ``tensor``): prefill's last logits, three decode steps' logits and the latent cache. MLA runs
    per device under the row split (k3jax/sharding/row_split.py): ``pallas``, its kernels (interpreted; the flash
    kernel on the prefill piece, the split-KV decode kernel on each step), against one device's XLA path. KDA's
    decode-step field is set too, and with the heads split over tensor XLA's step runs (``RowSplit.heads_whole``;
    the kernel's own case is expert 8 in the serve test below). With 8 rows on expert 4 x tensor 2 the latent
    cache's rows take ``tensor`` too (``latent_cache_rows``), with 4 not."""
    tokens = _tokens(batch, T, 0)
    run = RUN.replace(mla_impl=mla, kda_step_impl=mla)
    got, cache = _program(params, mesh_axes, "prefill", batch, run=run)(params, tokens,
                                                                         C.init_cache(TINY, batch, CONTEXT, RUN))
    ref, ref_cache = C.prefill(params, tokens, None, C.init_cache(TINY, batch, CONTEXT, RUN), TINY, RUN,
                               last_only=True)
    err = assert_close(got, ref, TOL["fp32_mesh_vs_single"], name="prefill logits")
    print(f"{mesh_axes} B={batch}: prefill rel-RMS {err:.2e}")
    _decode_both(params, mesh_axes, cache, ref_cache, ref, batch, small=False, run=run)


# the kernel's case in the slow pass (214 s in CI: the TPU interpreter inside shard_map runs the static grid over
# every tile); tests/sharding/test_ep_packed.py checks the kernel path under expert parallelism in the default one
@pytest.mark.parametrize("packed_kernel", ["auto", pytest.param("pallas", marks=pytest.mark.slow)])
def test_small_batch_rule_decode_equals_one_device(params, packed_kernel):
    """Two rows on 8 ways (data 2 x expert 4): the small-batch rule replicates rows and cache; each device runs its
    local experts on every row (the XLA tile loop, or the Pallas kernel's TPU schedule in the TPU interpreter inside
    the shard_map) and one psum sums them."""
    tokens = _tokens(2, T, 1)
    last, cache = C.prefill(params, tokens, None, C.init_cache(TINY, 2, CONTEXT, RUN), TINY, RUN, last_only=True)
    _decode_both(params, "data=2,expert=4", cache, cache, last, 2, small=True, packed_kernel=packed_kernel)


@pytest.mark.parametrize("mesh_axes,mla", [("expert=4,tensor=2", "xla"), ("expert=8", "pallas"),
                                           pytest.param("expert=4,tensor=2", "pallas", marks=pytest.mark.slow)])
def test_serve_decode_keeps_rows_whole_and_splits_the_caches(params, mesh_axes, mla):
    """The serve column at a batch that divides its token axis (8 rows on expert 4 x tensor 2, or expert 8; the
    width over expert): every row on every device for the projections and the experts (one psum), the caches split
    by rows — the KDA state over expert x heads, the latent over expert x tensor — and the attention per row shard
    between ``RowSplit.enter`` and ``leave`` (MLA's swap over tensor; ``pallas``: the MLA decode kernel,
    interpreted). On expert 8 (every head on every device, ``RowSplit.heads_whole``) ``pallas`` runs KDA's
    decode-step kernel too, the state advanced in its stack in place, and both output gates apply per row before
    the gather; the queries are up-projected per row on both meshes."""
    tokens = _tokens(8, T, 2)
    last, cache = C.prefill(params, tokens, None, C.init_cache(TINY, 8, CONTEXT, RUN), TINY, RUN, last_only=True)
    sizes, _ = place.resolve_mesh(mesh_axes, devices=8, strategy="serve")
    assert place.whole_rows("serve", sizes, 8) and not place.small_batch("serve", sizes, 8)
    _decode_both(params, mesh_axes, cache, cache, last, 8, small=False,
                 run=RUN.replace(mla_impl=mla, kda_step_impl=mla), strategy="serve")


@pytest.mark.parametrize("mode,batch", [("decode", 8), pytest.param("decode", 1, marks=pytest.mark.slow),
                                        pytest.param("prefill", 8, marks=pytest.mark.slow)])  # CI's budget
def test_plan_counts_the_cache_and_the_key_loops(mode, batch):
    """`k3 plan --compile --mode prefill | decode` on cpu:8: the compiled arguments are the closed form's
    (parameters + cache + tokens) within 0.1%; the cache figures are its shapes under the rules (the small-batch
    rule replicates it); the MLA key loops, whose trip counts depend on the filled keys, are counted at the planned
    context (only the packed experts' routing-dependent tile loops stay unknown)."""
    spec = plan_spec.PlanSpec(mode=mode, mesh="data=2,expert=4", batch=batch, seq_len=T if mode == "prefill" else 1,
                              context=CONTEXT)
    out = aot.compile_plan(TINY, hardware.parse_target("cpu:8"), spec)
    assert out["argument_over_estimate"] == pytest.approx(1.0, rel=1e-3), out["estimate"]
    assert out["small_batch"] == (batch == 1) and out["layer_stack"] == "scan"
    shapes = C.cache_shapes(TINY, batch, CONTEXT, plan_spec.run_settings(TINY, spec), stacked=True)
    whole = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    cache = out["cache"]
    assert cache["global"] == whole
    assert cache["per_device"] == (whole if batch == 1 else whole / 8)
    assert cache["kda_per_device"] + cache["mla_per_device"] < cache["per_device"]  # + lengths [B] int32
    keys = CONTEXT if mode == "decode" else T
    assert out["loop_hints"] == {"latent_keys_big": 0, "latent_keys": -(-keys // 8)}  # blocks of 8, no big block
    hinted = sorted(out["loop_hints"].values())[-1]
    # one key loop per MLA layer outside the scan, one inside it (run once per group)
    lay = layout(TINY)
    mla_calls = sum(TINY.is_mla(l) for l in (*lay.pre, *lay.post)) + sum(
        TINY.is_mla(l) for l in range(lay.start, lay.start + lay.period))
    assert lay.groups == 2 and out["hlo"]["while_trip_counts"].count(hinted) == mla_calls
    moe_layers = sum(TINY.is_moe(i) for i in range(TINY.num_layers))
    assert out["hlo"]["unknown_trip_counts"] <= moe_layers
    assert out["flops"]["model"] == 2.0 * out["flops"]["active_params"] * batch * spec.seq_len + batch * (
        estimate.attention_flops(TINY, plan_spec.with_defaults(spec)[0]))
