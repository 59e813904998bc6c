#!/usr/bin/env bash
# Create .venv with a Python 3.12 interpreter and install k3jax (editable) with its dev extra.
# Usage: bash scripts/setup.sh            (idempotent: re-running only re-installs the package)
# Finds Python 3.12 robustly: $K3_PYTHON, python3.12 on PATH, a pyenv-managed 3.12 (pyenv shims refuse to run
# without a version named, so we ask pyenv for the interpreter's real path), then common install locations.
set -euo pipefail
cd "$(dirname "$0")/.."

is312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; }

find_python312() {
  if [ -n "${K3_PYTHON:-}" ] && is312 "$K3_PYTHON"; then echo "$K3_PYTHON"; return 0; fi
  for cand in python3.12 python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && is312 "$cand"; then command -v "$cand"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)
    if [ -n "$v" ] && is312 "$(pyenv root)/versions/$v/bin/python3.12"; then
      echo "$(pyenv root)/versions/$v/bin/python3.12"; return 0
    fi
  fi
  for p in /usr/local/bin/python3.12 /usr/bin/python3.12 /opt/python/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$HOME"/.local/bin/python3.12; do
    if [ -x "$p" ] && is312 "$p"; then echo "$p"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! is312 .venv/bin/python; then
  PY=$(find_python312) || { echo "error: no Python 3.12 interpreter found (set K3_PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "using $PY" >&2
  rm -rf .venv
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints-ci.txt -e '.[dev]'
echo "k3jax installed in .venv ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))" >&2
