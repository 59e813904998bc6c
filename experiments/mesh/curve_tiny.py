# ruff: noqa: E402, E501, E702, N812  (measurement scripts: environment set before the jax import)
"""Session-8 measurement script (experiments/LOG.md, session 8): run from the repo root with .venv/bin/python.
Run order for the gradient figures: grad_compare.py (writes /tmp/k3_mesh_g_*.npz), then grad_partition_floor.py and
grad_vs_float64.py."""
import os

os.environ["JAX_PLATFORMS"]="cpu"; os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
import numpy as np

from k3jax.train.loop import train
from k3jax.train.settings import TrainConfig

tc = TrainConfig(preset="k3-tiny", steps=20, batch=8, seq_len=16, max_bytes=100000, eval_every=1000, progress=False, peak_flops=1e12)
a = np.array(train(tc.replace(devices=1), log=lambda m: None)["losses"])
b = np.array(train(tc.replace(mesh="data=2,expert=4"), log=lambda m: None)["losses"])
print("per-step relative gap:", " ".join(f"{x:.1e}" for x in np.abs(a - b) / a))
