#!/usr/bin/env bash
# The default test suite (.ci/run's first pass): everything not marked slow/gpu, 2 workers, 8 simulated CPU devices.
# Usage: bash scripts/test.sh [extra pytest args]      e.g. bash scripts/test.sh -m "slow and not gpu and not manual"
# (a later -m replaces the default one; .ci/run runs the default suite, then that slow pass)
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh || exit 1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
# CPU backend unless the caller names one (e.g. JAX_PLATFORMS=cuda on a GPU machine): libtpu (the dev extra) lets one
# process at a time hold /tmp/libtpu_lockfile, and a JAX process free to pick TPU takes it for life, so a second
# xdist worker would fail with "Internal error when accessing libtpu". Deviceless TPU compiles work with cpu set.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
# --dist loadgroup: tests marked xdist_group("libtpu") (the deviceless TPU compiles) share one worker. (pytest 9 +
# pytest-xdist 3.8 ignore the group, so tests/pallas/test_targets.py also runs libtpu in one locked child process.)
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations=40 -m "not slow and not gpu and not manual" "$@"
