"""Serving layouts (k3jax/plan/layouts.py): the candidate meshes of a slice, their closed-form ranking (no compile),
`k3 plan --compile --mode decode` without --mesh choosing and compiling one, and the bad-input exits."""

import json
import os
import subprocess
import sys

import pytest

from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.errors import InputError
from k3jax.plan import layouts
from k3jax.plan.hardware import parse_target
from k3jax.plan.spec import PlanSpec

V5P_64 = parse_target("tpu:v5p:4x4x4")


def test_candidate_meshes_of_64_and_2_chips():
    assert [m[:2] for m in layouts.candidate_meshes(64)] == [
        ("expert=16,tensor=4", "ep_tp"), ("expert=8,tensor=8", "ep_tp"), ("expert=16,tensor=4", "serve"),
        ("expert=64", "serve")]
    assert [m[:2] for m in layouts.candidate_meshes(2)] == [("expert=2", "serve")]  # tensor 4 and 8 do not divide


def test_kimi_k3_decode_on_v5p_64_ranks_the_serve_column_first():
    cfg = get_preset("kimi-k3")
    spec = PlanSpec(mode="decode", mesh=None, batch=1, seq_len=1, context=8192)
    choice = layouts.choose_layout(cfg, V5P_64, spec)
    rows = {(r["mesh"], r["strategy"]): r for r in choice["candidates"]}
    assert len(rows) == 4 and all(r["estimate_s"] for r in rows.values())
    assert choice["chosen"] == {"mesh": "expert=16,tensor=4", "strategy": "serve"}
    today, serve = rows[("expert=16,tensor=4", "ep_tp")], rows[("expert=16,tensor=4", "serve")]
    # today's mesh reads ~37 GB per chip per token (36 GB of it non-expert weights split 4 ways); serve < 4 GB
    assert today["bytes_per_device"] > 30e9 and serve["bytes_per_device"] < 4e9
    assert today["collectives_per_step"] < serve["collectives_per_step"]  # the price: more per-layer collectives
    ranked = [r["estimate_s"] for r in choice["candidates"]]
    assert ranked == sorted(ranked) and today["estimate_s"] > serve["estimate_s"]
    # tensor 8 leaves w2's packed minor dim at F / 8 / 2 = 192 bytes, off the 128 lanes: its stacks are relaid out
    # per layer (read + written), which the bytes floor does not count and the ranking does
    t8 = {"data": 1, "fsdp": 1, "expert": 8, "context": 1, "tensor": 8}
    w2 = cfg.num_experts / 8 * cfg.routed_expert_hidden_size * cfg.moe_intermediate_size / 8 / 2
    assert layouts.relaid_bytes(cfg, t8, "ep_tp") == 2 * w2 * (cfg.num_layers - cfg.first_k_dense_replace)
    assert layouts.relaid_bytes(cfg, {**t8, "expert": 16, "tensor": 4}, "ep_tp") == 0
    # ep_tp at B = 1: per MoE layer the routed psum and the router's scores and chosen weights gathered over the
    # experts' axis (its width is whole, its experts split): 3 + 2 per MoE layer, 2 per dense one (heads, FFN hidden);
    # + 1: the embedding's rows split over tensor, its gathered rows all-reduced
    moe = cfg.num_layers - cfg.first_k_dense_replace
    assert today["collectives_per_step"] == 2 * cfg.num_layers + 3 * moe + 1
    assert "ms" in choice["why"]


def test_kimi_k3_decode_at_64_rows_ranks_serve_with_whole_rows_and_split_caches():
    """B = 64 at 128K on v5p-64: serve keeps every row on every chip (``placement.whole_rows``) and splits only the
    caches by rows, so it is placed and ranked (it was refused before: rows split over the axis its width takes);
    its collectives count the per-row attention's: per mixer layer the outputs' all-gather over the rows' axis and,
    on tensor 4, per MLA layer the latent's swap (3 all-to-alls) and W_UK / W_UV gathered whole (2 all-gathers).
    A prefill under serve is still refused."""
    cfg = get_preset("kimi-k3")
    spec = PlanSpec(mode="decode", mesh=None, batch=64, seq_len=1, context=131072)
    choice = layouts.choose_layout(cfg, V5P_64, spec)
    rows = {(r["mesh"], r["strategy"]): r for r in choice["candidates"]}
    assert all(r["estimate_s"] for r in rows.values()) and choice["chosen"]["strategy"] == "serve"
    ep_tp, serve, e64 = (rows[k] for k in (("expert=16,tensor=4", "ep_tp"), ("expert=16,tensor=4", "serve"),
                                           ("expert=64", "serve")))
    assert serve["bytes_per_device"] < ep_tp["bytes_per_device"] - 25e9    # 36 GB of weights over 64 chips, not 4
    moe = cfg.num_layers - cfg.first_k_dense_replace
    mla = len(cfg.full_attn_layers)
    # serve at B = 1 (the small-batch rule): 7 per MoE layer, 6 per dense one; at B = 64 + the per-row attention's;
    # + 1: the embedding's rows split over tensor x expert (163840 divides by 64), its gathered rows all-reduced
    assert serve["collectives_per_step"] == 7 * moe + 6 * (cfg.num_layers - moe) + cfg.num_layers + 5 * mla + 1
    # expert=64: no heads' or hidden's axis (no swap, no output or FFN all-reduce over tensor)
    assert e64["collectives_per_step"] == 5 * moe + 4 * (cfg.num_layers - moe) + cfg.num_layers + 1
    with pytest.raises(InputError, match="--mode prefill"):
        layouts.estimate_layout(cfg, V5P_64, PlanSpec(mode="prefill", mesh="expert=16,tensor=4", strategy="serve",
                                                      batch=16, seq_len=8192, context=8192))


def test_bad_input_exits_2(capsys):
    base = ["plan", "--preset", "kimi-k3", "--compile", "--target", "tpu:v5p:4x4x4", "--mode", "decode",
            "--context", "8192"]
    assert main([*base, "--mesh", "tensor=64", "--strategy", "serve"]) == 2  # 96 heads over 64 tensor ways
    assert "'tensor'" in capsys.readouterr().err
    assert main([*base, "--mesh", "tensor=4,expert=16", "--compare-layouts"]) == 2
    assert "--compare-layouts" in capsys.readouterr().err
    assert main([*base[:-4], "--mode", "train"]) == 2  # train plans need their mesh
    assert "--compile needs one --mesh" in capsys.readouterr().err


@pytest.mark.slow  # an XLA:CPU compile of k3-tiny's decode step on 8 devices, ~50 s on the shared 2-core box
def test_tiny_decode_plan_without_mesh_chooses_and_compiles():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "k3jax.cli.main", "plan", "--preset", "k3-tiny", "--compile", "--target",
                        "cpu:8", "--mode", "decode", "--context", "64", "--compare-layouts", "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    lay = out["layout"]
    # k3-tiny's vocab 97 splits over no tensor axis: only expert=8 (serve) places it, and it is compiled
    assert lay["chosen"] == {"mesh": "expert=8", "strategy": "serve"} == {"mesh": out["mesh"],
                                                                             "strategy": out["strategy"]}
    placed = [c for c in lay["candidates"] if c["estimate_s"] is not None]
    assert [c["mesh"] for c in placed] == ["expert=8"] and "compiled" in placed[0]
    assert all("97" in c["error"] for c in lay["candidates"] if c["estimate_s"] is None)
    assert out["argument_bytes_per_device"] > 0
