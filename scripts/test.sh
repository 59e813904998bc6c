#!/usr/bin/env bash
# The default test suite (.ci/run's first pass): everything not marked slow/gpu, 2 workers, 8 simulated CPU devices.
# Usage: bash scripts/test.sh [extra pytest args]      e.g. bash scripts/test.sh -m "slow and not gpu"
# (a later -m replaces the default one; .ci/run runs the default suite, then that slow pass)
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh || exit 1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
exec .venv/bin/python -m pytest -q -n 2 --durations=40 -m "not slow and not gpu" "$@"
