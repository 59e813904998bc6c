"""The smallest H200 count a full-size K3 QAT step needs by the closed form — fp32 master weights, fp32
gradients and the optimizer state (``k3jax.plan.estimate.estimate_arguments`` over one device), before any
activation — for fp32 and bf16 optimizer moments.

    python experiments/h200_count.py          # numbers quoted in experiments/LOG.md (2026-12-05, session 17)
"""

import math

from k3jax.config import get_preset
from k3jax.plan import estimate, hardware
from k3jax.plan import spec as plan_spec

H200_HBM = 141e9  # bytes (NVIDIA's published 141 GB)

cfg = get_preset("kimi-k3")
for dtype in ("float32", "bfloat16"):
    spec = plan_spec.PlanSpec(mode="train", mesh="expert=64", batch=64, seq_len=4096, opt_state_dtype=dtype)
    sizes, _ = plan_spec.check(cfg, hardware.parse_target("cpu:64"), spec)
    est = estimate.estimate_arguments(cfg, spec, {a: 1 for a in sizes}, "ep")
    total = est["weights"] + est["gradient_bytes"] + est["optimizer"]
    n = math.ceil(total / H200_HBM)
    print(f"{dtype} moments: master {est['weights'] / 1e12:.2f} TB + gradient {est['gradient_bytes'] / 1e12:.2f} TB "
          f"+ optimizer {est['optimizer'] / 1e12:.2f} TB = {total / 1e12:.2f} TB -> {n} H200s "
          f"({math.ceil(n / 8)} nodes of 8)")
