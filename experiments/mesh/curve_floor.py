# ruff: noqa: E402, E501, E702, E731  (measurement scripts: environment set before the jax import)
"""Session-9 measurement (experiments/LOG.md): the one-device k3-mini curve against itself with the batch summed
in two halves (micro_batches=2) — the reproducibility floor — and against the ep mesh, 20 steps.
Usage: .venv/bin/python experiments/mesh/curve_floor.py qb|off"""
import json
import os
import sys

os.environ["JAX_PLATFORMS"]="cpu"; os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
import numpy as np

from k3jax.train.loop import train
from k3jax.train.settings import TrainConfig

balance = sys.argv[1]
tc = TrainConfig(preset="k3-mini", steps=20, batch=8, seq_len=32, max_bytes=100_000, eval_every=1000, progress=False, peak_flops=1e12, balance=balance)
runs = {"single": tc.replace(devices=1), "single_m2": tc.replace(devices=1, micro_batches=2), "ep": tc.replace(mesh="data=2,expert=4")}
out = {k: train(v, log=lambda m: None)["losses"] for k, v in runs.items()}
ref = np.array(out["single"])
for k in ("single_m2", "ep"):
    g = np.abs(np.array(out[k]) - ref) / ref
    print(balance, k, "max gap", f"{g.max():.2e}", "per step", " ".join(f"{x:.0e}" for x in g), flush=True)
json.dump(out, open(f"/tmp/exp/floor_{balance}.json", "w"))
