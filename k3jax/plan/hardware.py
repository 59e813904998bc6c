"""Hardware a plan is made for, as published figures: GPUs of the formula planner (``--hardware 8xB300``) and the
TPU / CPU compile targets of the AOT planner (``--target tpu:v5p:8x8x8 | cpu:64``), with the roofline that reads a
compiled program's costs against a chip's peaks.

    n, gpu, cap = parse_hardware("8xB300")        # (8, "B300", bytes per device)
    target = parse_target("tpu:v5p:8x8x8")         # Target(platform="tpu", devices=512, chip=CHIPS["v5p"], ...)
    roofline(target.chip, useful_flops, compiled_flops, hbm_bytes, collective_bytes)
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


@dataclass(frozen=True)
class Chip:
    """Published per-chip figures (Cloud TPU docs: the v5p, v6e and v5e pages), in bytes and bytes/s. v5p's HBM is
    the docs' table figure, 95 GiB (its compiler reports 95.73 GiB available); v6e 32 GB, v5e 16 GB."""

    name: str
    hbm_bytes: float
    peak_flops: float  # bf16 dense
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, bidirectional, all links of one chip


CHIPS = {
    "v5p": Chip("TPU v5p", 95 * 2**30, 459e12, 2765e9, 1200e9),
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


def roofline(chip: Chip | None, useful_flops: float, compiled_flops: float, hbm_bytes: float,
             coll_bytes: float) -> dict | None:
    """Step time bounds at the chip's published peaks (per device): compute, HBM and collective terms; the step
    cannot be faster than the largest. Two compute terms: ``compute_s`` from the useful FLOPs (the model's, no
    capacity padding or recompute) and ``compiled_compute_s`` from what the compiled program runs (the one the step
    bound takes); ``compute_share`` = compute_s / step_s."""
    if chip is None:
        return None
    terms = {"compiled_compute_s": compiled_flops / chip.peak_flops, "memory_s": hbm_bytes / chip.hbm_bandwidth,
             "collective_s": coll_bytes / chip.ici_bandwidth}
    bound = max(terms, key=terms.get)
    compute = useful_flops / chip.peak_flops
    return {"chip": chip.name, "peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth,
            "ici_bandwidth": chip.ici_bandwidth, "compute_s": compute, **terms, "step_s": terms[bound],
            "bound": bound.removesuffix("_s").removeprefix("compiled_"),
            "compute_share": compute / terms[bound] if terms[bound] else None}

__all__ = ["CHIPS", "DEFAULT_HARDWARE", "GPU_BYTES", "KNOWN_HARDWARE", "LIBTPU_HINT", "Chip", "Target",
           "libtpu_installed", "parse_hardware", "parse_target", "roofline"]
