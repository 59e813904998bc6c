"""The roofline's collective latency and bytes floor (k3jax/plan/hardware.py ``roofline``, k3jax/plan/floor.py): hop
counts and latencies by hand from the published constants, the floor's parts from the config by hand, and one small
compiled plan whose step time is the largest bandwidth term plus the latency of the collectives it runs."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.config import get_preset
from k3jax.model.cache import capacity
from k3jax.plan import aot, estimate, floor, hardware
from k3jax.plan import spec as plan_spec
from k3jax.plan.hlo_cost import program_stats
from k3jax.sharding.mesh import make_mesh

TINY = get_preset("k3-tiny")
V5P, V5E = hardware.CHIPS["v5p"], hardware.CHIPS["v5e"]
HOP, LAUNCH = hardware.ICI_HOP_LATENCY_S, hardware.COLLECTIVE_LAUNCH_S


def test_latency_constants_reproduce_the_scaling_book_measurement():
    """The book's measured latency-bound AllGather: a v5e 4x4 (no wraparound under 16), one axis of 4, 3 hops,
    "closer to 8us"; v5p wraps a slice of whole 4x4x4 cubes (2 hops over 4), not a 2x2x4."""
    links = hardware.axis_links({"tensor": 4}, (4, 4), V5E)["tensor"]
    assert links == [(4, 1, False)]
    assert hardware.collective_latency_s(V5E, hardware.collective_hops("all-gather", links)) == pytest.approx(8e-6)
    assert hardware.wraparounds(V5P, (4, 4, 8)) == (True, True, True)
    assert hardware.wraparounds(V5P, (2, 2, 4)) == (False, False, False)
    assert hardware.wraparounds(V5E, (8, 16)) == (False, True)
    assert hardware.collective_hops("all-gather", hardware.axis_links({"tensor": 4}, (4, 4, 4), V5P)["tensor"]) == 2


def test_mesh_axes_laid_on_the_torus_and_their_hops():
    """v5p 8x8x8 (wraps), mesh fsdp=8 x expert=64: expert (innermost) takes two whole axes of 8, fsdp the third.
    all-gather over expert: 4 + 4 hops; all-reduce twice that; all-to-all over fsdp: 4. A mesh axis that splits a
    physical axis: tensor=2 on v5p 4x4x4 takes a 2-chip line of the first axis, expert=32 the rest of it (2 chips
    2 hops apart, still a ring) and the two other axes. Without a topology every axis is a line."""
    links = hardware.axis_links({"data": 1, "fsdp": 8, "expert": 64, "context": 1, "tensor": 1}, (8, 8, 8), V5P)
    assert links["expert"] == [(8, 1, True), (8, 1, True)] and links["fsdp"] == [(8, 1, True)]
    assert hardware.collective_hops("all-gather", links["expert"]) == 8
    assert hardware.collective_hops("all-reduce", links["expert"]) == 16
    assert hardware.collective_hops("all-to-all", links["fsdp"]) == 4
    split = hardware.axis_links({"expert": 32, "tensor": 2}, (4, 4, 4), V5P)
    assert split["tensor"] == [(2, 1, False)]
    assert split["expert"] == [(2, 2, True), (4, 1, True), (4, 1, True)]
    assert hardware.collective_hops("reduce-scatter", split["expert"]) == 1 * 2 + 2 + 2
    # positions 1 and 6 of expert=32: digits (1, 0, 0) and (0, 3, 0): 1 x 2 hops, then 1 hop the short way round
    assert hardware.permute_hops(split["expert"], 1, 6) == 2 + 1
    assert hardware.axis_links({"data": 2, "expert": 4}) == {"expert": [(4, 1, False)], "data": [(2, 1, False)]}


def test_step_adds_the_latency_to_the_largest_bandwidth_term():
    """step_s = max(compute, memory, collective) + latency; the floor's ratio is memory_s / bytes_floor_s; a step
    of tiny transfers is latency-bound."""
    r = hardware.roofline(V5P, 1e11, 2e11, 5e9, 1e9, latency_s=3e-4, floor_bytes=2.5e9)
    assert r["step_s"] == pytest.approx(max(2e11 / V5P.peak_flops, 5e9 / V5P.hbm_bandwidth, 1e9 / V5P.ici_bandwidth)
                                        + 3e-4)
    assert r["bound"] == "memory" and r["collective_latency_s"] == 3e-4
    assert r["bytes_floor_s"] == pytest.approx(2.5e9 / V5P.hbm_bandwidth) and r["over_bytes_floor"] == pytest.approx(2)
    assert r["compute_share"] == pytest.approx(1e11 / V5P.peak_flops / r["step_s"])
    assert hardware.roofline(V5P, 1e6, 1e6, 1e6, 1e3, latency_s=1e-4)["bound"] == "collective_latency"


def test_replica_group_forms():
    """The iota, explicit and mesh forms of replica_groups name the same mesh axes; a permute's hops are its
    farthest pair's."""
    sizes = {"data": 2, "fsdp": 1, "expert": 4, "context": 1, "tensor": 1}
    assert floor.group_axes("replica_groups=[2,4]<=[8]", sizes) == {"expert": 4}
    assert floor.group_axes("replica_groups=[4,2]<=[2,4]T(1,0)", sizes) == {"data": 2}
    assert floor.group_axes("replica_groups={{0,4},{1,5},{2,6},{3,7}}", sizes) == {"data": 2}
    assert floor.group_axes("replica_groups=mesh['data'=2,'expert'=4] {'data','expert'}", sizes) == {"data": 2,
                                                                                                    "expert": 4}
    assert floor.group_axes("replica_groups={}", sizes) == {"data": 2, "expert": 4}
    links = hardware.axis_links(sizes)
    assert floor.instr_hops("collective-permute", "source_target_pairs={{0,1},{1,3},{4,6}}", sizes, links) == 2
    assert floor.instr_hops("all-reduce", "replica_groups=[2,4]<=[8]", sizes, links) == 6


def test_latency_counts_every_collective_as_it_runs():
    """A shard_map in a scan of 3 (XLA:CPU, 8 devices, data=2 x expert=4): each collective runs 3 times, as
    program_stats counts them; on lines (no topology) psum over expert (4) is 2 x 3 hops, all_gather over data 1,
    all_to_all over expert 3, ppermute by one 1, psum_scatter over both 1 + 3."""
    mesh = make_mesh({"data": 2, "expert": 4})

    def body(c, _):
        x = jax.lax.psum(c, "expert")
        y = jax.lax.all_gather(x, "data", tiled=True)[: c.shape[0]]
        z = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)
        w = jax.lax.ppermute(z, "expert", [(i, i + 1) for i in range(3)])
        return jnp.tile(jax.lax.psum_scatter(w, ("data", "expert"), tiled=True), (8, 1)), None

    f = jax.shard_map(lambda x: jax.lax.scan(body, x, None, length=3)[0], mesh=mesh, in_specs=P(), out_specs=P(),
                      check_vma=False)
    text = jax.jit(f).lower(jnp.ones((16, 4))).compile().as_text()
    lat = floor.collective_latency(text, None, V5P, {"data": 2, "expert": 4}, None)
    hops = {"all-reduce": 6, "all-gather": 1, "all-to-all": 3, "collective-permute": 1, "reduce-scatter": 4}
    assert {k: v["max_hops"] for k, v in lat["by_kind"].items()} == hops
    assert {k: v["count"] for k, v in lat["by_kind"].items()} == {
        k: v["count"] for k, v in program_stats(text).collectives.items()} == dict.fromkeys(hops, 3)
    assert lat["seconds"] == pytest.approx(sum(3 * (LAUNCH + h * HOP) for h in hops.values()))


def test_experts_reached():
    """E (1 - (1 - A/E)^n): one token reaches A experts; many reach them all."""
    assert floor.experts_reached(1, 64, 8) * 64 == pytest.approx(8)
    assert floor.experts_reached(2, 64, 8) * 64 == pytest.approx(64 * (1 - (56 / 64) ** 2))
    assert floor.experts_reached(10**5, 64, 8) == pytest.approx(1.0)


def test_decode_floor_by_hand():
    """Decode, B = 2 rows under the small-batch rule on expert=4 (rows and cache replicated; every row reaches
    every device's experts): non-expert weights + the packed experts x the share two tokens reach + the KDA state
    read and written + --context + 1 latent positions + the tokens in and the [B, V] f32 logits out."""
    spec = plan_spec.PlanSpec(mode="decode", mesh="expert=4", batch=2, seq_len=1, context=20)
    sizes, strategy = plan_spec.check(TINY, hardware.parse_target("cpu:4"), spec)
    est = estimate.estimate_arguments(TINY, spec, sizes, strategy)
    cache = estimate.cache_bytes(TINY, spec, sizes, strategy)
    f = floor.bytes_floor(TINY, spec, sizes, strategy)
    E, A = TINY.num_experts, TINY.num_experts_per_token
    reach = 1 - (1 - A / E) ** 2
    assert f["expert_tokens"] == 2 and f["experts_reached"] == pytest.approx(reach)
    assert f["weights"] == pytest.approx(est["weights"] + reach * est["packed_experts"])
    slots = capacity(TINY, 20, plan_spec.run_settings(TINY, spec))
    assert f["cache"] == pytest.approx(2 * cache["kda_per_device"] + cache["mla_per_device"] * 21 / slots)
    assert f["io"] == pytest.approx(4 * 2 + 4 * 2 * TINY.vocab_size) and f["optimizer"] == 0
    assert f["total"] == pytest.approx(f["weights"] + f["cache"] + f["io"])


def test_train_floor_by_hand():
    """Train on data=2 x expert=4: the fp32 masters read once (the experts at the share the expert group's 8 x 8
    / 8 x 4 tokens reach), and the optimizer's gradient, masters and state each read and written."""
    spec = plan_spec.PlanSpec(mode="train", mesh="data=2,expert=4", batch=8, seq_len=8)
    sizes, strategy = plan_spec.check(TINY, hardware.parse_target("cpu:8"), spec)
    est = estimate.estimate_arguments(TINY, spec, sizes, strategy)
    f = floor.bytes_floor(TINY, spec, sizes, strategy)
    experts = 4 * floor.routed_expert_elements(TINY, spec, sizes, strategy)
    moe_layers = sum(TINY.is_moe(i) for i in range(TINY.num_layers))
    per_expert = 3 * TINY.routed_expert_hidden_size * TINY.moe_intermediate_size  # gate, up, down of one expert
    assert experts == pytest.approx(4 * moe_layers * TINY.num_experts / 4 * per_expert)
    assert f["expert_tokens"] == 8 * 8 / 8 * 4
    reach = 1 - (1 - TINY.num_experts_per_token / TINY.num_experts) ** f["expert_tokens"]
    assert f["weights"] == pytest.approx(est["weights"] - experts + reach * experts)
    assert f["optimizer"] == pytest.approx(4 * est["gradient_bytes"] + 2 * est["optimizer"])
    assert f["io"] == est["tokens"] and f["cache"] == 0


@pytest.mark.slow  # a k3-tiny compile (7-16 s); the pure-function tests above stay in the default pass
def test_compiled_plan_step_includes_the_collective_latency():
    """A k3-tiny decode step of one row (the small-batch rule) compiled by XLA:CPU on 8 devices (data=2 x expert=4)
    and read at v5p's figures (a 2x2x2 slice: no wraparound): the roofline's step is its largest bandwidth term plus
    the latency of every collective the program runs (counted as program_stats counts them), and the bytes floor
    sits under the program's HBM traffic."""
    target = hardware.Target("cpu:8", "cpu", "v5p:2x2x2", 8, V5P)
    spec = plan_spec.PlanSpec(mode="decode", mesh="data=2,expert=4", batch=1, seq_len=1, context=16)
    out = aot.compile_plan(TINY, target, spec)
    r, lat = out["roofline"], out["collective_latency"]
    assert {k: v["count"] for k, v in lat["by_kind"].items()} == {
        k: v["count"] for k, v in out["collectives"].items()}
    assert lat["count"] > 0 and lat["seconds"] >= lat["count"] * LAUNCH
    assert r["collective_latency_s"] == lat["seconds"]
    assert r["step_s"] == pytest.approx(max(r["compiled_compute_s"], r["memory_s"], r["collective_s"])
                                        + lat["seconds"])
    assert r["bytes_floor_s"] == pytest.approx(out["bytes_floor"]["total"] / V5P.hbm_bandwidth)
    assert r["over_bytes_floor"] == pytest.approx(r["memory_s"] / r["bytes_floor_s"]) and r["over_bytes_floor"] > 1
    assert math.isclose(r["per_token_latency_s"], r["step_s"])
