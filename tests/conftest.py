"""Test setup: 8 simulated CPU devices, float64 available on demand, Hypothesis profile."""

import glob
import os

from k3jax.cli.main import jax_platforms_override  # imports no jax

# Must be set before the jax backend initializes.
# JAX_PLATFORMS=cpu unless set, or the machine has a TPU or an NVIDIA GPU (the `gpu` tests need JAX to find it): with
# libtpu installed (the dev extra), a JAX process that may pick a TPU backend takes libtpu's one-process lock
# (/tmp/libtpu_lockfile) for life, and the next process fails with "Internal error when accessing libtpu". Deviceless
# TPU topologies (tests/pallas/test_targets.py) still work with it set. Same rule as the `k3` command.
_platforms = jax_platforms_override(os.environ, lambda pattern: bool(glob.glob(pattern)), libtpu_installed=True)
if _platforms is not None:
    os.environ.setdefault("JAX_PLATFORMS", _platforms)
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


@pytest.fixture
def x64():
    """Enable float64 inside one test (restored afterwards)."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
