"""Regenerate the executed notebooks: each notebooks/NAME.py (jupytext percent format, the source) becomes
notebooks/NAME.ipynb with its outputs and inline figures, executed top to bottom by a real Jupyter kernel.

Usage:  .venv/bin/python scripts/notebooks.py [NAME ...]        (default: every notebooks/*.py)

Each notebook runs at its own default (full-size) settings: the K3_NB_* knobs that tests use to run them small are
removed from the kernel's environment, and $K3_NB_OUT is a fresh temporary directory, deleted afterwards. The kernel
is ipykernel's `python3`, started with this interpreter (jupyter_client runs a kernelspec's `python` as
sys.executable), in notebooks/ as Jupyter would, on the CPU backend unless JAX_PLATFORMS says otherwise (libtpu in the
dev extra would otherwise take its process lock). Cell timings are not recorded, so a rerun only changes the .ipynb
where a result changed; nor are XLA's "Very slow compile?" alarms, which a busy machine prints to the kernel's
stderr (they say how loaded the machine was, nothing about the notebook). Never edit the .ipynb by hand: edit the
.py and rerun this.
"""

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jupytext
from nbclient import NotebookClient
from nbformat import NotebookNode

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 3600
# XLA's alarm for a compile that takes minutes (e.g. on a machine shared with other jobs), as the kernel's stderr has it
SLOW_COMPILE = re.compile(r"E\d{4} [\d:.]+ +\d+ slow_operation_alarm\.cc:\d+\][^\n]*\n\n?\*+\n"
                          r"\[Compiling module [^\n]*\n\*+\n")


def drop_slow_compile_alarms(nb: NotebookNode) -> int:
    """Removes ``SLOW_COMPILE`` messages from the code cells' stderr outputs (an output left empty goes); returns how
    many were removed."""
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == "stderr":
                o.text, k = SLOW_COMPILE.subn("", o.text)
                n += k
                if not o.text:
                    continue
            kept.append(o)
        cell.outputs = kept
    return n


def execute(py: Path, env: dict[str, str], cwd: Path) -> NotebookNode:
    """Reads the percent-format ``py`` and runs every cell in a fresh python3 kernel started with ``env`` in ``cwd``;
    raises nbclient's CellExecutionError at the first cell that fails. Returns the executed notebook."""
    nb = jupytext.read(py)
    for i, cell in enumerate(nb.cells):  # nbformat draws random cell ids: numbered ones keep reruns' diffs to results
        cell.id = f"cell-{i}"
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebook names (default: every notebooks/*.py)")
    args = ap.parse_args(argv)
    pys = [NOTEBOOKS / f"{n.removesuffix('.py')}.py" for n in args.names] or sorted(NOTEBOOKS.glob("*.py"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_NB_")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    for py in pys:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"{py.stem}_") as out:
            nb = execute(py, dict(env, K3_NB_OUT=out), NOTEBOOKS)
        if n := drop_slow_compile_alarms(nb):
            print(f"{py.stem}: dropped {n} 'Very slow compile' alarm(s) from the outputs", file=sys.stderr)
        jupytext.write(nb, py.with_suffix(".ipynb"))
        size = py.with_suffix(".ipynb").stat().st_size
        print(f"{py.with_suffix('.ipynb').relative_to(NOTEBOOKS.parent)}: {size:,} bytes, "
              f"executed in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
