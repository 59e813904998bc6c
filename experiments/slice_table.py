"""The smallest slice for K3: prefill 8K, decode (B = 1 at 8K; B = 64 at 128K) and the fine-tuning plans
(frozen-experts, QAT ``train``, QLoRA ``lora``) of kimi-k3 over v5p-{64, 128, 256, 512} and v6e-{64, 128, 256},
each through the deviceless TPU compiler (`k3 plan --compile --json`), one libtpu process at a time.

    .venv/bin/python experiments/slice_table.py                       # run what is missing, then print the table
    .venv/bin/python experiments/slice_table.py --only decode1 --slices v5p-64
    .venv/bin/python experiments/slice_table.py --table               # print the table from the saved JSONs only

Resumable: each plan's JSON (the fitting plan's, or the compiler's out-of-memory figures with exit 1) is written
atomically to experiments/runs/slices/<plan>__<slice>.json; a plan with a JSON is not compiled again. A compile that
fails for another reason is recorded with its exit code and the tail of its stderr (``error``), and rerun only with
``--retry-errors``.

Meshes (documented in the LOG beside the table):
- serving (prefill, decode): no ``--mesh`` (the default, ``--serving-mesh planner``): `k3 plan` ranks its serving
  candidates for the slice by the closed-form estimate and compiles the best (k3jax/plan/layouts.py; the chosen
  mesh, strategy and why are in the JSON's ``layout``). ``--serving-mesh fixed``: the earlier rule — on v5p
  (95 GiB) tensor 4 x expert N/4 (``ep_tp``: KDA / MLA heads, the dense and shared FFNs and the vocabulary over
  tensor; routed experts over expert x tensor), tensor 8 past 256 chips (expert 64); on v6e (32 GB): tensor 8 x
  expert N/8. Decode B = 64 needs the token axes (expert) to divide 64 or exceed it (the small-batch rule then
  replicates the rows and the cache).
- frozen-experts, train, lora: fsdp N/64 x expert 64 (``zero3_ep_tp``; on 64 chips expert 64 alone, ``ep``),
  4,096 tokens per chip on v5p and 1,024 on v6e (the LOG's earlier plans), one sequence per chip; remat by the
  plan's default (auto: the first policy that fits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "runs" / "slices"
SLICES = {"v5p-64": "v5p:4x4x4", "v5p-128": "v5p:4x4x8", "v5p-256": "v5p:4x8x8", "v5p-512": "v5p:8x8x8",
          "v6e-64": "v6e:8x8", "v6e-128": "v6e:8x16", "v6e-256": "v6e:16x16"}
PLANS = ("prefill8k", "decode1", "decode64", "frozen", "train", "lora")
TRAIN_MODES = {"frozen": "frozen-experts", "train": "train", "lora": "lora"}


def _serving_mesh(chip: str, n: int) -> tuple[int, int]:
    """(tensor, expert) of the serving plans."""
    tensor = 4 if chip == "v5p" and n <= 256 else 8
    return tensor, n // tensor


def plan_argv(plan: str, slice_name: str, serving_mesh: str = "planner") -> list[str]:
    chip, n = slice_name.split("-")
    n = int(n)
    argv = ["--preset", "kimi-k3", "--compile", "--target", f"tpu:{SLICES[slice_name]}", "--json"]
    if plan in TRAIN_MODES:
        mesh = "expert=64" if n == 64 else f"fsdp={n // 64},expert=64"
        return argv + ["--mesh", mesh, "--mode", TRAIN_MODES[plan], "--batch", str(n),
                       "--seq-len", "4096" if chip == "v5p" else "1024"]
    tensor, expert = _serving_mesh(chip, n)
    if serving_mesh == "fixed":
        argv += ["--mesh", f"tensor={tensor},expert={expert}"]
    if plan == "prefill8k":   # one 8K sequence per chip of the fixed rule's token axis (the same batch either way)
        return argv + ["--mode", "prefill", "--batch", str(expert), "--seq-len", "8192"]
    batch, context = (1, 8192) if plan == "decode1" else (64, 131072)
    return argv + ["--mode", "decode", "--batch", str(batch), "--context", str(context)]


def run_one(plan: str, slice_name: str, timeout: int, serving_mesh: str = "planner") -> dict:
    # `python -m k3jax.cli.main` from the repository root: this checkout's code (a git worktree too), whatever the
    # virtual environment's editable install points at
    argv = [sys.executable, "-m", "k3jax.cli.main", "plan", *plan_argv(plan, slice_name, serving_mesh)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.time()
    try:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", e.stdout or "", (e.stderr or b"").decode() if isinstance(e.stderr, bytes) \
            else (e.stderr or "")
    doc = {"plan": plan, "slice": slice_name, "argv": ["k3", *argv[3:]], "exit": rc, "wall_s": time.time() - t0}
    try:
        doc["result"] = json.loads(stdout) if rc in (0, 1) else None
    except json.JSONDecodeError:
        doc["result"] = None
    if doc["result"] is None:
        doc["error"] = stderr[-3000:]
    return doc


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def row(doc: dict) -> str:
    r = doc.get("result")
    if r is None:
        return f"| {doc['plan']} | {doc['slice']} | — | error (exit {doc['exit']}) | | | |"
    if r.get("fits") is False:
        f = r.get("hbm_oom") or {}   # empty when the compile succeeded with a peak past the chip's capacity
        used = f.get("used_bytes", r.get("peak_bytes_per_device") or 0)
        cap = f.get("available_bytes", r.get("capacity_bytes_per_device") or 0)
        return (f"| {doc['plan']} | {doc['slice']} | {r['mesh']} | **no**: needs {used / 1e9:,.1f} of {cap / 1e9:,.1f} "
                f"GB | | | |")
    roof = r["roofline"]
    peak = r["peak_bytes_per_device"] / 1e9
    extra = f"compute share {roof['compute_share']:.3f}"
    if "tokens_per_s_per_chip" in roof:
        lat = roof.get("per_token_latency_s", roof.get("time_to_first_token_s"))
        extra = f"{lat * 1e3:,.1f} ms; {roof['tokens_per_s_per_chip']:,.1f} tok/s/chip"
    if "collective_latency_s" in roof:   # plans since the latency term and the bytes floor
        extra += f"; latency {roof['collective_latency_s'] * 1e3:,.1f} ms"
        if roof.get("over_bytes_floor") is not None:
            extra += f"; {roof['over_bytes_floor']:.2f}x bytes floor"
    cache = f"{r['cache']['per_device'] / 1e9:,.1f}" if "cache" in r else "—"
    mesh = r["mesh"] + ("" if r.get("strategy") in (None, "ep_tp") else f" ({r['strategy']})")
    return (f"| {doc['plan']} | {doc['slice']} | {mesh} | yes, {peak:,.1f} GB peak | {cache} | "
            f"{roof['step_s']:,.3f} s ({roof['bound']}) | {extra} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=PLANS, help="plans to run (default all)")
    ap.add_argument("--slices", action="append", choices=list(SLICES), help="slices to run (default all)")
    ap.add_argument("--table", action="store_true", help="print the table from the saved JSONs; compile nothing")
    ap.add_argument("--retry-errors", action="store_true", help="recompile plans recorded with an error")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per compile (default 3600)")
    ap.add_argument("--serving-mesh", choices=("planner", "fixed"), default="planner",
                    help="serving plans: the planner's choice (no --mesh; default) or the fixed tensor x expert rule")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    todo = [(p, s) for s in (args.slices or SLICES) for p in (args.only or PLANS)]
    if not args.table:
        for plan, slice_name in todo:
            path = OUT / f"{plan}__{slice_name}.json"
            if path.exists():
                old = json.loads(path.read_text())
                if old.get("result") is not None or not args.retry_errors:
                    continue
            print(f"{plan} on {slice_name}: k3 plan {' '.join(plan_argv(plan, slice_name, args.serving_mesh))}",
                  file=sys.stderr, flush=True)
            doc = run_one(plan, slice_name, args.timeout, args.serving_mesh)
            _write(path, doc)
            print(row(doc), file=sys.stderr, flush=True)
    print("| plan | slice | mesh | fits (peak per chip) | cache GB/chip | roofline step (bound) | serving / share |")
    print("|---|---|---|---|---|---|---|")
    for plan in PLANS:
        for s in SLICES:
            path = OUT / f"{plan}__{s}.json"
            if path.exists():
                print(row(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
