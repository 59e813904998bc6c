#!/usr/bin/env bash
# One `k3` command as N local processes of one jax.distributed job: a CPU rehearsal of a many-host run, and what the
# multi-process tests start. Each process gets --coordinator localhost:PORT --num-processes N --process-id I appended;
# on the CPU each starts (mesh devices / N) simulated devices unless JAX_NUM_CPU_DEVICES or XLA_FLAGS choose them.
#
#   bash scripts/multiprocess.sh 2 k3 train --preset k3-tiny --mesh data=2,expert=4 --steps 8 --ckpt-dir runs/t
#
# Process 0 writes the logs, metrics and progress; every process prints its own errors, prefixed [process I/N].
# SIGTERM or Ctrl-C to this script is passed to every process (the run saves a checkpoint and exits 0 / 130); a
# SIGTERM to one process alone stops them all at the same step, too. Exit status: 0 when every process exits 0, else
# the first non-zero status in process order. K3_COORDINATOR_PORT picks the port (default: a free one).
set -uo pipefail
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bash scripts/multiprocess.sh N COMMAND [ARGS...]   (e.g. N=2 k3 train --mesh data=2,expert=4 ...)" >&2
  exit 2
fi
n=$1; shift
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python3
port="${K3_COORDINATOR_PORT:-$("$py" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
pids=()
for ((i = 0; i < n; i++)); do
  "$@" --coordinator "localhost:$port" --num-processes "$n" --process-id "$i" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
trap 'kill -INT "${pids[@]}" 2>/dev/null' INT
rc=0
for pid in "${pids[@]}"; do
  while true; do
    wait "$pid"; s=$?
    kill -0 "$pid" 2>/dev/null || break  # wait was interrupted by a trapped signal: wait again
  done
  [ "$rc" -eq 0 ] && rc=$s
done
exit "$rc"
