"""Speculative verify plans (`k3 plan --compile --mode verify --draft-tokens K`, k3jax/plan/verify.py): the flags'
checks (exit 2 before any compile), the draft a kimi-k3 plan runs (the published K3 DSpark draft's shape), the
closed form (a verify step touches at least a decode step's bytes, plus its records and its draft; its FLOPs are
K + 1 tokens' and the draft's), and a small verify program compiled on 8 CPU devices with its JSON fields."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from k3jax.cli.main import main
from k3jax.config import get_preset, k3_full_attn_layers
from k3jax.draft import draft_tensor_shapes
from k3jax.plan import aot, estimate, floor, hardware
from k3jax.plan import spec as plan_spec
from k3jax.plan.verify import ACCEPTANCE_LENGTHS, decode_baseline_spec
from k3jax.sharding import placement as place

REPO = Path(__file__).resolve().parents[2]
K3 = get_preset("kimi-k3")
TINY = get_preset("k3-tiny")
# the compile test's target: two layers (KDA, MLA), dense — XLA:CPU compiles k3-tiny's packed-expert dispatch on 8
# devices in ~20 s more (the slow CLI test below plans the whole k3-tiny, experts included)
TWO = get_preset("k3-tiny", num_layers=2, full_attn_layers=k3_full_attn_layers(2), first_k_dense_replace=2)


def _verify(**kw):
    base = dict(mode="verify", mesh="expert=16,tensor=4", strategy="serve", batch=1, seq_len=8, context=8192)
    return plan_spec.PlanSpec(**{**base, **kw})


@pytest.mark.parametrize("argv,msg", [
    (["--mode", "decode", "--context", "64", "--draft-tokens", "3"],
     "--draft-tokens 3: a speculative verify step's; --mode decode has none"),
    (["--mode", "decode", "--context", "64", "--rollback", "replay"], "--rollback replay: a speculative verify"),
    (["--mode", "decode", "--context", "64", "--no-decode-baseline"], "--no-decode-baseline: a verify plan's"),
    (["--mode", "verify", "--context", "64", "--draft-tokens", "0"], "--draft-tokens 0: must be an integer >= 1"),
    (["--mode", "verify", "--context", "64", "--rollback", "undo"], "--rollback 'undo': unknown; known: copy, replay"),
    (["--mode", "verify", "--context", "64", "--draft-tokens", "3", "--seq-len", "8"],
     "--seq-len 8: a verify step's piece is the anchor and the K drafted tokens, --draft-tokens 3 + 1 = 4"),
    (["--mode", "verify", "--draft-tokens", "3"], "--mode verify needs --context"),
    (["--mode", "verify", "--context", "3", "--draft-tokens", "3"], "--context 3: must lie in [4,"),
    (["--mode", "verify", "--context", "64", "--batch", "12"], "--batch 12: not divisible by the 8 ways"),
])
def test_bad_verify_input_exits_2_before_any_compile(capsys, argv, msg):
    assert main(["plan", "--preset", "k3-tiny", "--compile", "--target", "cpu:8", "--mesh", "expert=8", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_verify_on_a_context_axis_exits_2(capsys):
    assert main(["plan", "--preset", "k3-tiny", "--compile", "--target", "cpu:8", "--mesh", "context=2,expert=4",
                 "--mode", "verify", "--context", "64", "--draft-tokens", "3"]) == 2
    assert "a context axis splits sequences, and a verify step is K + 1 tokens per row" in capsys.readouterr().err


def test_verify_flags_need_compile(capsys):
    assert main(["plan", "--preset", "k3-tiny", "--draft-tokens", "3"]) == 2
    assert "--draft-tokens applies to --compile" in capsys.readouterr().err


def test_verify_defaults_are_the_k3_drafts_block_and_decodes():
    spec, filled = plan_spec.with_defaults(plan_spec.PlanSpec(mode="verify", mesh="expert=8", batch=1, seq_len=8,
                                                              context=64))
    assert (spec.draft_tokens, spec.rollback, spec.capacity_factor, spec.remat) == (7, "copy", -1.0, "none")
    assert {"draft_tokens", "rollback", "capacity_factor"} <= set(filled)
    dec = decode_baseline_spec(spec)
    assert (dec.mode, dec.seq_len, dec.draft_tokens, dec.rollback, dec.context) == ("decode", 1, None, None, 64)


def test_kimi_k3_plan_runs_the_published_draft():
    """DraftConfig.for_target(kimi-k3): 5 dense MLA layers of width 7168 (64 heads, q_lora 1536, kv_lora 512, qk
    128 + 64, v 128), MLP 14336, taps 2, 23, 47, 71, 89, Markov rank 256 — the published tensors' shapes; the plan's
    abstract draft holds exactly those parameters."""
    dcfg = estimate.plan_draft(K3, _verify())
    shapes = draft_tensor_shapes(dcfg)
    assert dcfg.target_layer_ids == (2, 23, 47, 71, 89) and dcfg.block_size == 7
    assert shapes["context_proj.weight"] == (7168, 5 * 7168) and shapes["context_norm.weight"] == (7168,)
    assert {n.split(".")[1] for n in shapes if n.startswith("layers.")} == {"0", "1", "2", "3", "4"}
    assert shapes["layers.4.self_attn.q_a_proj.weight"] == (1536, 7168)
    assert shapes["layers.4.self_attn.q_b_proj.weight"] == (64 * (128 + 64), 1536)
    assert shapes["layers.4.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes["layers.4.self_attn.kv_b_proj.weight"] == (64 * (128 + 128), 512)
    assert shapes["layers.4.self_attn.o_proj.weight"] == (7168, 64 * 128)
    assert shapes["layers.4.mlp.gate_proj.weight"] == (14336, 7168)
    assert shapes["markov_head.markov_w1.weight"] == (163840, 256)
    assert shapes["confidence_head.proj.weight"] == (1, 7168 + 256)
    total = sum(math.prod(s) for s in shapes.values())
    _, params, _ = estimate.abstract_draft(dcfg)
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(params)) == total


def test_verify_closed_form_against_decode():
    """kimi-k3, B = 1 at 8192 on v5p-64's serve mesh (the small-batch rule: rows on every chip, KDA heads over
    tensor = 4): the verify step's argument bytes are decode's + the draft's weights and cache; its bytes floor at
    least decode's (its 8 tokens reach more experts) + records + draft; copy records are ~21x replay's; its FLOPs
    are 8 tokens' over the active weights + the draft's."""
    spec = plan_spec.with_defaults(_verify())[0]
    dec = plan_spec.with_defaults(decode_baseline_spec(spec))[0]
    sizes = place.axis_sizes(place.parse_mesh(spec.mesh))
    ev, ed = (estimate.estimate_arguments(K3, s, sizes, "serve") for s in (spec, dec))
    d = estimate.draft_bytes(K3, spec, sizes, "serve")
    assert ev["cache"] == ed["cache"] and ed["draft"] == 0
    assert ev["draft"] == d["params_per_device"] + d["cache_per_device"]
    assert ev["total"] - ed["total"] == pytest.approx(ev["draft"] + 4 * 7, rel=1e-9)  # + the piece's 7 more ids
    assert d["params_global"] == 2 * d["params"] and 2.3e9 < d["params"] < 2.5e9
    assert d["params_per_device"] < d["params_global"] / 16  # split like the target's non-expert weights
    fv, fd = (floor.bytes_floor(K3, s, sizes, "serve") for s in (spec, dec))
    assert fv["total"] >= fd["total"] + fv["records"] + fv["draft"] and fv["weights"] > fd["weights"]
    assert fv["expert_tokens"] == 8 and fd["expert_tokens"] == 1
    copy, replay = (estimate.record_bytes(K3, spec, sizes, "serve", m) for m in ("copy", "replay"))
    assert copy["per_device"] == pytest.approx(copy["global"] / 4, rel=1e-6)  # rows whole, heads over tensor = 4
    # 69 KDA layers x 8 positions x 96 heads x 128 x 128 fp32 states, + the conv inputs
    assert copy["per_device_by_leaf"]["rec_state"] == 69 * 8 * 96 * 128 * 128 * 4 / 4
    assert 15 < copy["global"] / replay["global"] < 30
    mv, md = (estimate.model_flops(K3, s, sizes, "serve") for s in (spec, dec))
    n = mv["active_params"]
    assert mv["expected"] == pytest.approx(8 * md["expected"] + mv["draft"], rel=1e-12)
    assert mv["expected"] > 2 * n * 8 and mv["draft"] > 0


def test_tiny_verify_plan_compiles_with_its_fields():
    """A verify step of a two-layer k3-tiny on 8 CPU devices, data 2 x expert 4, B = 2 (the small-batch rule: rows and
    both caches on every device): the compiled arguments are the closed form's within 0.2% (target, cache, draft
    and its cache, the piece), each device's compiled FLOPs within 20% of the step's closed form (the draft's
    included; the two-layer model is dense and ep leaves its weights whole, so every device computes every row), and the
    JSON carries the verify block — the closed-form ratio and speedups without a chip's roofline."""
    spec = plan_spec.PlanSpec(mode="verify", mesh="data=2,expert=4", batch=2, seq_len=4, context=24, draft_tokens=3,
                              rollback="replay")
    out = aot.compile_plan(TWO, hardware.parse_target("cpu:8"), spec, decode_baseline=False)
    assert out["mode"] == "verify" and out["small_batch"] and out["draft_tokens"] == 3
    assert out["argument_over_estimate"] == pytest.approx(1.0, rel=2e-3), out["estimate"]
    assert out["estimate"]["draft"] > 0 and out["fits"] is None and out["roofline"] is None
    assert out["peak_bytes_per_device"] > out["argument_bytes_per_device"]
    assert out["loop_hints"] == {"latent_keys_big": 0, "latent_keys": 24 // 8}
    assert out["flops"]["draft"] > 0
    f = out["flops"]  # the ep column replicates the dense weights: under the small-batch rule every device runs it all
    assert f["compiled_per_device"] / f["expected"] == pytest.approx(1.0, abs=0.2), f
    assert out["bytes_floor"]["records"] > 0 and out["bytes_floor"]["draft"] > 0
    v = out["verify"]
    assert v["rollback"] == "replay" and v["piece_tokens"] == 4
    assert v["step_s"] is None and v["decode_step_s"] is None and v["step_ratio"] is None
    assert v["basis"] == "closed-form estimate" and v["estimate_step_ratio"] >= 1.0
    assert list(v["implied_speedup"]) == [str(a) for a in ACCEPTANCE_LENGTHS]
    for a in ACCEPTANCE_LENGTHS:
        assert v["implied_speedup"][str(a)] == pytest.approx(a / v["estimate_step_ratio"])
    assert v["rollback_bytes_per_chip"]["copy"] > v["rollback_bytes_per_chip"]["replay"] > 0
    assert v["draft_params_bytes"] == 2 * v["draft_params"]
    assert v["published"]["copy_rollback_gib_per_rank"] == 28.9 and "decode" not in v


@pytest.mark.slow  # k3-tiny's verify and decode steps compiled on 8 CPU devices in a child process (~90 s)
def test_cli_plans_a_tiny_verify_step_beside_its_decode_step():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "k3jax.cli.main", "plan", "--preset", "k3-tiny", "--compile",
                        "--target", "cpu:8", "--mesh", "data=2,expert=4", "--mode", "verify", "--draft-tokens", "3",
                        "--batch", "2", "--context", "40", "--json"],
                       capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    # B = 2 on 8 token ways: the small-batch rule, each device's local experts on both rows' 4 tokens
    assert out["seq_len"] == 4 and out["small_batch"] and out["defaults"]["rollback"] == "copy"
    assert out["argument_over_estimate"] == pytest.approx(1.0, rel=2e-3)
    assert out["hlo"]["unknown_trip_counts"] > 0  # the packed experts' tile loops: the MoE layers are in it
    v = out["verify"]
    assert v["decode"]["compile_s"] > 0 and v["draft_tokens"] == 3
    spec = plan_spec.PlanSpec(mode="verify", mesh="data=2,expert=4", batch=2, seq_len=4, context=40, draft_tokens=3)
    sizes = place.axis_sizes(place.parse_mesh(spec.mesh))
    assert v["rollback_bytes_per_chip"]["copy"] == estimate.record_bytes(TINY, spec, sizes, "ep", "copy")["per_device"]


# k3-tiny as tests/plan/test_serving.py plans it: 13 layers (an unrolled head, two scanned groups, a tail), vocab 96
SERVE = get_preset("k3-tiny", num_layers=13, full_attn_layers=k3_full_attn_layers(13), attn_res_block_size=3,
                   vocab_size=96, moe_intermediate_size=64)


@pytest.mark.slow  # a 13-layer verify step compiled on 8 CPU devices beside its one-device twin (~3 min)
@pytest.mark.parametrize("mesh_axes,strategy", [("data=2,expert=4", "ep"), ("expert=4,tensor=2", "serve")])
def test_verify_program_on_a_mesh_equals_the_speculative_step_on_one_device(mesh_axes, strategy):
    """The plan's program is the real step: on data 2 x expert 4 (one row per device, packed experts, the scanned
    cache layout with records in both groups) — or under serve on expert 4 x tensor 2 (every row on every device,
    the caches and records split by rows: ``placement.whole_rows``) —, f32, each row given the target's own greedy
    continuation with one
    token changed at a chosen slot, it accepts exactly the tokens before that slot (n = the slot; all K when none
    is changed), emits the target's bonus token, rolls both caches back as ``extend`` + ``rollback`` + the draft's
    ``append_context`` do on one device, and drafts what ``propose`` + the greedy Markov bias draft there."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from k3jax.config import default_run
    from k3jax.draft.network import DraftModel, draft_cache
    from k3jax.draft.speculative import accept_greedy
    from k3jax.model import cache as C  # noqa: N812
    from k3jax.model.rollback import rollback, with_records
    from k3jax.plan.verify import verify_program
    from k3jax.quant import pack_params
    from k3jax.sharding.expert_parallel import ExpertParallel
    from k3jax.sharding.mesh import make_mesh
    from k3jax.testing import TOL, assert_close, random_params

    run = default_run(SERVE)
    B, K, T0, CTX = 8, 3, 12, 24
    params = pack_params(jax.tree.map(jnp.asarray, random_params(SERVE, seed=5)))
    spec = plan_spec.PlanSpec(mode="verify", mesh=mesh_axes, batch=B, seq_len=K + 1, context=CTX,
                              draft_tokens=K, capacity_factor=-1.0, strategy=strategy, rollback="copy")
    dcfg = estimate.plan_draft(SERVE, spec)
    draft = DraftModel(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    dparams = nnx.split(draft)[1].to_pure_dict()
    taps = tuple(dcfg.target_layer_ids)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, SERVE.vocab_size, (B, T0)).astype(np.int32)
    last, cache, hidden = C.extend(params, prompts, None, C.init_cache(SERVE, B, CTX, run), SERVE, run,
                                   last_only=True, taps=taps)
    dcache = draft.append_context(draft_cache(dcfg, B, C.capacity(SERVE, CTX, run)), hidden, np.full((B,), T0))
    anchor = np.asarray(jnp.argmax(last, -1), np.int32)
    greedy, tok, c = [], anchor, cache        # the target's greedy continuation (decode steps on a copy)
    for _ in range(K):
        logits, c = C.decode_step(params, tok, c, SERVE, run)
        tok = np.asarray(jnp.argmax(logits, -1), np.int32)
        greedy.append(tok)
    piece = np.concatenate([anchor[:, None], np.stack(greedy, 1)], axis=1)
    slot = np.arange(B) % (K + 1)                                    # the drafted token changed (K: none)
    rows = np.flatnonzero(slot < K)
    piece[rows, slot[rows] + 1] = (piece[rows, slot[rows] + 1] + 1) % SERVE.vocab_size

    # one device: the speculative step's own calls
    start = np.asarray(cache["lengths"])
    vl, vc, hid = C.extend(params, piece, None, with_records(cache, SERVE, K + 1, "copy"), SERVE, run, absorbed=True,
                           taps=taps)
    n_ref, bonus_ref = accept_greedy(vl, jnp.asarray(piece[:, 1:]))
    keep = np.asarray(n_ref) + 1
    ref_cache = rollback(vc, SERVE, keep, start=start)
    ref_dcache = draft.append_context(dcache, hid, keep)
    embed = params["embed"]
    base, _ = draft.propose(ref_dcache, bonus_ref, embed=embed, head=params["lm_head"])
    prev, ref_ids = bonus_ref, []
    for i in range(K):
        prev = jnp.argmax(base[:, i] + draft.markov_bias(prev), -1).astype(jnp.int32)
        ref_ids.append(prev)

    # the plan's program on the mesh
    sizes, strategy = place.resolve_mesh(spec.mesh, devices=8, strategy=strategy)
    mesh = make_mesh(sizes)
    whole = place.whole_rows(strategy, sizes, B)                     # as aot.build_program decides
    ep = ExpertParallel(mesh, strategy, capacity_factor=-1.0, replicate_tokens=whole, cache_rows=whole)
    fn, args = verify_program(SERVE, spec, mesh, strategy, run=run, params=params, dispatch=ep, small=False,
                              whole=whole)
    put = lambda tree, a: jax.tree.map(lambda x, s: jax.device_put(jnp.copy(x), s.sharding), tree, a)  # noqa: E731
    (n, bonus, ids), got_cache, got_dcache = fn(put(params, args[0]), put(piece, args[1]),
                                                put(C.stack_cache(cache, SERVE), args[2]), put(dparams, args[3]),
                                                put(dcache, args[4]))
    assert np.asarray(n).tolist() == slot.tolist() == np.asarray(n_ref).tolist()
    assert np.asarray(bonus).tolist() == np.asarray(bonus_ref).tolist()
    assert np.asarray(ids).tolist() == np.asarray(jnp.stack(ref_ids, 1)).tolist()
    got_cache = C.unstack_cache(got_cache, SERVE)
    assert np.asarray(got_cache["lengths"]).tolist() == (start + keep).tolist()
    for l, layer in ref_cache["layers"].items():
        for name, x in layer.items():
            assert_close(got_cache["layers"][l][name], x, TOL["fp32_mesh_vs_single"], name=f"layer {l} {name}")
    for j, layer in enumerate(ref_dcache["layers"]):
        for name, x in layer.items():
            assert_close(got_dcache["layers"][j][name], x, TOL["fp32_mesh_vs_single"], name=f"draft {j} {name}")
