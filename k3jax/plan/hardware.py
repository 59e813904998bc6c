"""Hardware a plan is made for, as published figures: GPUs of the formula planner (``--hardware 8xB300``) and the
TPU / CPU compile targets of the AOT planner (``--target tpu:v5p:8x8x8 | cpu:64``), with the roofline that reads a
compiled program's costs against a chip's peaks.

    n, gpu, cap = parse_hardware("8xB300")        # (8, "B300", bytes per device)
    target = parse_target("tpu:v5p:8x8x8")         # Target(platform="tpu", devices=512, chip=CHIPS["v5p"], ...)
    roofline(target.chip, useful_flops, compiled_flops, hbm_bytes, collective_bytes, latency_s=..., floor_bytes=...)
    links = axis_links(sizes, topology_dims(target), target.chip)   # {mesh axis: [(chips, stride, wraps)]}
    collective_hops("all-reduce", links["expert"])                   # ICI hops of one all-reduce over that axis

Collective latency (the ``alpha`` of an alpha-beta model; "How to Scale Your Model", Part 3 "Sharding", jax-ml/
scaling-book ``sharding.md``): a collective costs a fixed launch plus one per-hop latency for every ICI hop its
pattern needs, whatever its size. Hops per pattern over a ring of L chips (stride s physical hops apart): a
bidirectional ring with a wraparound link takes ceil(L/2) steps, a line without one L - 1 (the book's AllGather,
its "3 hops" on a v5e axis of 4 without wraparound), each s hops; over several axes the hops add (the book's
multi-axis AllGather: the longest path, sum_i |X_i| / 2). all-gather, reduce-scatter, all-to-all (the farthest
shard crosses the same path) and collective-broadcast take that path once, all-reduce twice (reduce-scatter then
all-gather), collective-permute the longest distance between a source and its target.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass

from k3jax.errors import InputError

# GPU kind -> memory in bytes (decimal GB, as vendors state it)
GPU_BYTES = {"B300": 288 * 10**9, "B200": 192 * 10**9, "H200": 141 * 10**9, "H100": 80 * 10**9}
KNOWN_HARDWARE = ("8xB300", "16xB200", "8xB200", "64xH200", "32xH200", "16xH200", "8xH200", "8xH100")
DEFAULT_HARDWARE = ("8xB300", "16xB200", "64xH200")


def parse_hardware(name: str) -> tuple[int, str, int]:
    """``"8xB300"`` → (8, "B300", bytes per device)."""
    m = re.fullmatch(r"(\d+)x([A-Za-z0-9]+)", name)
    if not m or int(m.group(1)) < 1 or m.group(2).upper() not in GPU_BYTES:
        raise InputError(f"--hardware {name!r}: unknown; known hardware: {', '.join(KNOWN_HARDWARE)} "
                         f"(any <N>x<GPU> with GPU in {', '.join(GPU_BYTES)})")
    gpu = m.group(2).upper()
    return int(m.group(1)), gpu, GPU_BYTES[gpu]


# ICI latency, from the public figures of "How to Scale Your Model" (jax-ml/scaling-book, Part 3 "Sharding"):
# "Each hop over an ICI link has some intrinsic overhead regardless of the data volume. This is typically around
# 1us" (its Part 2 "TPUs" takes 1 us per hop on v5e too). Its one measured latency-bound collective, a 3-hop AllGather
# of 32 kB shards on a v5e 4x4 (no wraparound), took "closer to 8us" against 3 x 1 us of hops: 5 us per collective
# on top of its hops, the launch. The book gives no generation-specific figure, so v5p and v6e take the same two;
# with them that measured AllGather costs 5 + 3 x 1 = 8 us, never below the source.
ICI_HOP_LATENCY_S = 1e-6
COLLECTIVE_LAUNCH_S = 5e-6


@dataclass(frozen=True)
class Chip:
    """Published per-chip figures (Cloud TPU docs: the v5p, v6e and v5e pages), in bytes and bytes/s. v5p's HBM is
    the docs' table figure, 95 GiB (its compiler reports 95.73 GiB available); v6e 32 GB, v5e 16 GB. ``wrap``: which
    slice axes have wraparound links (the scaling book, Part 2 "TPUs"): ``"cube"`` (v5p) — every axis of a slice
    made of whole 4x4x4 cubes (the optical switches close the torus; a 2x2x4 has none), ``"full-axis"`` (v5e, v6e)
    — an axis of 16 chips, the pod's edge (an 8x16 wraps on its longer axis only)."""

    name: str
    hbm_bytes: float
    peak_flops: float  # bf16 dense
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, bidirectional, all links of one chip
    wrap: str = "full-axis"
    hop_latency_s: float = ICI_HOP_LATENCY_S
    collective_launch_s: float = COLLECTIVE_LAUNCH_S


CHIPS = {
    "v5p": Chip("TPU v5p", 95 * 2**30, 459e12, 2765e9, 1200e9, wrap="cube"),
    "v6e": Chip("TPU v6e", 32e9, 918e12, 1638e9, 800e9),
    "v5e": Chip("TPU v5e", 16e9, 197e12, 819e9, 400e9),
}


@dataclass(frozen=True)
class Target:
    spec: str
    platform: str  # "tpu" | "cpu"
    topology: str | None
    devices: int
    chip: Chip | None


def parse_target(s: str) -> Target:
    """``tpu:v5p:8x8x8`` / ``tpu:v6e:16x16`` / ``tpu:v5e:16x16`` / ``cpu:64``. Errors name the value."""
    parts = s.split(":")
    if parts[0] == "cpu" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) >= 1:
        return Target(s, "cpu", None, int(parts[1]), None)
    if parts[0] == "tpu" and len(parts) == 3 and parts[1] in CHIPS and re.fullmatch(r"\d+(x\d+){1,2}", parts[2]):
        dims = [int(d) for d in parts[2].split("x")]
        if min(dims) >= 1:
            return Target(s, "tpu", f"{parts[1]}:{parts[2]}", math.prod(dims), CHIPS[parts[1]])
    raise InputError(f"--target {s!r}: unknown target; use tpu:<chip>:<topology> with chip one of "
                     f"{', '.join(CHIPS)} (e.g. tpu:v5p:8x8x8, tpu:v6e:16x16) or cpu:<devices> (e.g. cpu:64)")


def xla_flags(cpu_devices: int | None) -> str:
    """XLA_FLAGS for a child process whose XLA:CPU has ``cpu_devices`` devices (None: its own count; XLA reads the
    count once, at start), keeping the caller's other flags (e.g. scripts/test.sh's -O0)."""
    import os

    keep = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return " ".join([*keep, *([f"--xla_force_host_platform_device_count={cpu_devices}"] if cpu_devices else [])])


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


LIBTPU_HINT = "install the TPU compiler with `pip install -e '.[tpu]'` (libtpu, ~590 MB; the dev extra includes it)"


def topology_dims(target: Target) -> tuple[int, ...] | None:
    """The chips along each physical axis of a TPU target (``tpu:v5p:4x4x8`` → (4, 4, 8)); None for cpu:N."""
    return tuple(int(d) for d in target.topology.split(":")[1].split("x")) if target.topology else None


def wraparounds(chip: Chip, dims: tuple[int, ...]) -> tuple[bool, ...]:
    """Which physical axes of a slice of ``dims`` chips close into a ring (``Chip.wrap``)."""
    if chip.wrap == "cube":
        whole = len(dims) == 3 and all(d % 4 == 0 for d in dims)
        return tuple(whole for _ in dims)
    return tuple(d == 16 for d in dims)


Link = tuple[int, int, bool]  # (chips along it, physical hops between neighbours, closes into a ring)


def axis_links(sizes: dict[str, int], dims: tuple[int, ...] | None = None, chip: Chip | None = None
               ) -> dict[str, list[Link]]:
    """How each mesh axis of ``sizes`` (``{axis: size}``, outermost first, as ``MESH_AXES`` orders them) lies on the
    slice: a list of links ``(chips, stride, wraps)``, innermost first. The mesh axes, innermost first, take the
    physical axes in order (``mesh_utils.create_device_mesh`` puts the innermost mesh axes on the nearest chips):
    a whole physical axis while the mesh axis's size is a multiple of it, else its first a chips (a line: no
    wraparound) with the rest of it (every a-th chip, a hops apart, a ring if the axis was) left to the next.
    Without a topology (``dims`` None) or past its end, each mesh axis is a line of its size."""
    dims = tuple(dims or ())
    wraps = wraparounds(chip, dims) if chip else (False,) * len(dims)
    free = [(d, 1, w) for d, w in zip(dims, wraps, strict=True) if d > 1]
    out: dict[str, list[Link]] = {}
    for axis in reversed(list(sizes)):
        n, links = sizes[axis], []
        while n > 1 and free:
            size, stride, wrap = free[0]
            g = math.gcd(n, size)
            if g == 1:
                break
            if g == size:  # the whole physical axis
                links.append(free.pop(0))
            else:
                links.append((g, stride, False))
                free[0] = (size // g, stride * g, wrap)
            n //= g
        if n > 1:
            links.append((n, 1, False))
        out[axis] = links
    return out


def ring_hops(link: Link) -> int:
    """Steps of a bidirectional ring pass over one link: ceil(L / 2) with a wraparound, L - 1 on a line, each
    ``stride`` physical hops."""
    size, stride, wrap = link
    return (math.ceil(size / 2) if wrap else size - 1) * stride


def collective_hops(kind: str, links: list[Link]) -> int:
    """ICI hops of one collective of ``kind`` over a group laid on ``links`` (the module docstring's patterns;
    collective-permute: ``permute_hops``)."""
    path = sum(ring_hops(link) for link in links)
    return 2 * path if kind == "all-reduce" else path


def permute_hops(links: list[Link], src: int, dst: int) -> int:
    """Physical hops between positions ``src`` and ``dst`` of one mesh axis laid on ``links`` (mixed radix,
    innermost link the lowest digit; a link with a wraparound goes the shorter way)."""
    hops = 0
    for size, stride, wrap in links:
        d = abs(src % size - dst % size)
        hops += (min(d, size - d) if wrap else d) * stride
        src, dst = src // size, dst // size
    return hops


def collective_latency_s(chip: Chip, hops: int) -> float:
    """The fixed time of one collective: its launch plus ``hops`` per-hop latencies."""
    return chip.collective_launch_s + hops * chip.hop_latency_s


def roofline(chip: Chip | None, useful_flops: float, compiled_flops: float, hbm_bytes: float,
             coll_bytes: float, *, latency_s: float = 0.0, floor_bytes: float | None = None) -> dict | None:
    """Step time bounds at the chip's published peaks (per device): compute, HBM and collective-bandwidth terms,
    plus the collectives' fixed latency. Two compute terms: ``compute_s`` from the useful FLOPs (the model's, no
    capacity padding or recompute) and ``compiled_compute_s`` from what the compiled program runs (the one the step
    bound takes). ``latency_s``: the summed launch + hop latency of every collective the step runs
    (``collective_latency_s``, loops counted as they run).

    ``step_s`` = max(compiled compute, memory, collective bandwidth) + collective latency. The three rates can hide
    behind each other (the step is at least the largest); a latency cannot hide behind the transfer it starts, and
    the step's collectives mostly sit on its critical path (dispatch → experts → combine, a layer's all-gather before
    its matmul), so it is added, not maxed — an upper-side choice where XLA overlaps an async collective with
    independent work. ``bound`` names the largest of the four; ``compute_share`` = compute_s / step_s.
    ``floor_bytes``: the bytes per device the step must touch (``k3jax.plan.floor.bytes_floor``):
    ``bytes_floor_s`` = floor_bytes / HBM bandwidth and ``over_bytes_floor`` = memory_s / bytes_floor_s (how far the
    compiled program's HBM traffic is from that floor)."""
    if chip is None:
        return None
    terms = {"compiled_compute_s": compiled_flops / chip.peak_flops, "memory_s": hbm_bytes / chip.hbm_bandwidth,
             "collective_s": coll_bytes / chip.ici_bandwidth}
    step = max(terms.values()) + latency_s
    every = {**terms, "collective_latency_s": latency_s}
    bound = max(every, key=every.get)
    compute = useful_flops / chip.peak_flops
    out = {"chip": chip.name, "peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth,
           "ici_bandwidth": chip.ici_bandwidth, "compute_s": compute, **terms, "collective_latency_s": latency_s,
           "step_s": step, "bound": bound.removesuffix("_s").removeprefix("compiled_"),
           "compute_share": compute / step if step else None}
    if floor_bytes is not None:
        out["bytes_floor_s"] = floor_bytes / chip.hbm_bandwidth
        out["over_bytes_floor"] = terms["memory_s"] / out["bytes_floor_s"] if floor_bytes else None
    return out


__all__ = ["CHIPS", "COLLECTIVE_LAUNCH_S", "DEFAULT_HARDWARE", "GPU_BYTES", "ICI_HOP_LATENCY_S", "KNOWN_HARDWARE",
           "LIBTPU_HINT", "Chip", "Link", "Target", "axis_links", "collective_hops", "collective_latency_s",
           "libtpu_installed", "parse_hardware", "parse_target", "permute_hops", "ring_hops", "roofline",
           "topology_dims", "wraparounds"]
