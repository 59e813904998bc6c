"""The committed notebooks/*.ipynb are the executed twins of notebooks/*.py, as scripts/notebooks.py writes them: the
same cells jupytext reads from the .py (so editing the .py without rerunning the script fails here), every code cell
run once, in order, without an error, and every figure embedded. Reads JSON only; nothing is executed."""

import importlib.util
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
RERUN = ".venv/bin/python scripts/notebooks.py"


def figure_cells_missing_png(nb) -> list[str]:
    """The code cells that show fewer inline PNGs than they call ``display(Image(...))`` (the notebooks' one way of
    showing a figure: the PNG they wrote to $K3_NB_OUT), each as its first line."""
    return [c.source.splitlines()[0] for c in nb.cells if c.cell_type == "code"
            and sum("image/png" in o.get("data", {}) for o in c.outputs) < c.source.count("display(Image(")]


@pytest.fixture(params=sorted(NOTEBOOKS.glob("*.py")), ids=lambda p: p.stem)
def pair(request):
    py = request.param
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is not committed: run {RERUN} {py.stem}"
    return py, nbformat.read(ipynb, as_version=4)


def test_ipynb_cells_equal_the_py(pair):
    py, nb = pair
    source = jupytext.read(py)
    assert nb.metadata["jupytext"]["formats"] == "ipynb,py:percent"
    assert [(c.cell_type, c.source) for c in nb.cells] == [(c.cell_type, c.source) for c in source.cells], (
        f"{py.stem}.ipynb is stale: run {RERUN} {py.stem}")


def test_ipynb_ran_in_order_without_error(pair):
    py, nb = pair
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"rerun {RERUN} {py.stem}"
    assert not [o.ename for c in code for o in c.outputs if o.output_type == "error"]


def test_ipynb_embeds_every_figure(pair):
    py, nb = pair
    assert any("display(Image(" in c.source for c in nb.cells), "each notebook shows at least one figure"
    assert figure_cells_missing_png(nb) == []
    assert py.with_suffix(".ipynb").stat().st_size < 4 << 20  # readers download it: a few figures, not megabytes


def test_ipynb_has_no_slow_compile_alarms(pair):
    py, nb = pair  # a loaded machine's XLA alarms are no result: scripts/notebooks.py drops them
    stderr = [o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "stream" and o.name == "stderr"]
    assert not [t for t in stderr if "slow_operation_alarm" in t or "Very slow compile" in t], f"rerun {RERUN}"


def test_the_script_drops_slow_compile_alarms_only():
    spec = importlib.util.spec_from_file_location("nb_script", NOTEBOOKS.parent / "scripts" / "notebooks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    alarm = ("E1206 01:08:48.822304   15121 slow_operation_alarm.cc:141] The operation took 2m2.361046067s\n\n"
             "********************************\n[Compiling module jit__lambda for CPU] Very slow compile? If you want "
             "to file a bug, run with envvar XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.\n"
             "********************************\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("stream", name="stderr", text=alarm),
        nbformat.v4.new_output("stream", name="stderr", text="a real warning\n" + alarm.replace("141]", "74] ")),
        nbformat.v4.new_output("stream", name="stdout", text=alarm)])])
    assert script.drop_slow_compile_alarms(nb) == 2
    assert [(o.name, o.text) for o in nb.cells[0].outputs] == [("stderr", "a real warning\n"), ("stdout", alarm)]
