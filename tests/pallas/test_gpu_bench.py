"""The GPU benchmark scripts (``python -m k3jax.bench.gpu_kda`` / ``gpu_mxfp4``): on CPU they print one JSON object
saying there is no GPU and exit 2; on a GPU their correctness checks must pass (exit 0, ``"ok": true``). They live in
k3jax/bench because kernel folders may import only k3jax.ops and k3jax.notation (docs/design.md §2), checked here with
the other edge the bench moves fixed: train never imports bench (the MFU peak lives in k3jax.train.flops)."""

import ast
import glob
import importlib
import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", ["gpu_kda", "gpu_mxfp4"])
def test_gpu_bench_without_a_gpu_exits_2(name, monkeypatch, capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: test_gpu_bench_checks_pass runs the script")
    mod = importlib.import_module(f"k3jax.bench.{name}")
    monkeypatch.setattr(sys, "argv", [name])
    assert mod.main() == 2
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "cpu" and not out.get("ok", False)
    assert "no GPU backend" in (out.get("error", "") + " ".join(out.get("errors", [])))


@pytest.mark.gpu
@pytest.mark.parametrize("name,args", [("gpu_kda", ["--max-seq", "8192", "--heads", "8", "--budget-s", "60"]),
                                       ("gpu_mxfp4", ["--quick"])])
def test_gpu_bench_checks_pass(name, args):
    p = subprocess.run([sys.executable, "-m", f"k3jax.bench.{name}", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and out["ok"], (out, p.stderr[-3000:])


def _k3jax_imports(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return {m for m in names if m.split(".")[0] == "k3jax"}


def test_kernel_folders_import_only_ops_and_notation():
    files = glob.glob(os.path.join(ROOT, "pallas_kernels", "**", "*.py"), recursive=True)
    assert files
    bad = {os.path.relpath(f, ROOT): sorted(m for m in _k3jax_imports(f)
                                           if not m.startswith(("k3jax.ops", "k3jax.notation")))
           for f in files}
    assert not {f: m for f, m in bad.items() if m}, bad


def test_train_never_imports_bench():
    files = glob.glob(os.path.join(ROOT, "k3jax", "train", "*.py"))
    bad = {os.path.relpath(f, ROOT): sorted(m for m in _k3jax_imports(f) if m.startswith("k3jax.bench"))
           for f in files}
    assert files and not {f: m for f, m in bad.items() if m}, bad
