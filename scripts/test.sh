#!/usr/bin/env bash
# The default test suite (.ci/run's first pass): everything not marked slow/gpu, 2 workers, 8 simulated CPU devices.
# Usage: bash scripts/test.sh [extra pytest args]      e.g. bash scripts/test.sh -m "slow and not gpu and not manual"
# (a later -m replaces the default one; .ci/run runs the default suite; the slow pass is run by hand)
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh || exit 1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
# CPU backend unless the caller names one (e.g. JAX_PLATFORMS=cuda on a GPU machine): libtpu (the dev extra) lets one
# process at a time hold /tmp/libtpu_lockfile, and a JAX process free to pick TPU takes it for life, so a second
# xdist worker would fail with "Internal error when accessing libtpu". Deviceless TPU compiles work with cpu set.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
# XLA:CPU with xla_backend_optimization_level=0 (its LLVM code generation at -O0): the tests compile far more than
# they compute (tiny shapes), so this cuts their time by ~40% (layers + ops + snapshot: 308 s -> 182 s;
# experiments/LOG.md 2026-12-03, session 13). The checks are against float64 references within TOL, or between two
# runs under the same flags; they pass unchanged at -O0. `k3` itself keeps XLA's default.
if [ "$JAX_PLATFORMS" = cpu ]; then export XLA_FLAGS="$XLA_FLAGS --xla_backend_optimization_level=0"; fi
# JAX's persistent compilation cache, shared by the two xdist workers, by CI's two passes and by the `k3` processes
# tests start: many tests compile the same small programs (k3-tiny's train step, scorer, prefill and decode step),
# and a hit skips XLA's backend compile, about half of a compile-bound test's time (tests/cli/test_generate.py: 70 s
# cold, 35 s warm on a 2-core AMD EPYC). It lives in the clone (.cache/, ignored), so a fresh clone starts empty;
# only compiles over a second are stored (JAX's default), the key is the program and the compile options, so an
# entry never outlives the code that made it. Tests that need their own cache (kill/resume) set it themselves.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax-tests}"
# --dist loadgroup: tests marked xdist_group("libtpu") (the deviceless TPU compiles) share one worker. (pytest 9 +
# pytest-xdist 3.8 ignore the group, so tests/pallas/test_targets.py also runs libtpu in one locked child process.)
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations=40 -m "not slow and not gpu and not manual" "$@"
