"""The architecture's dependency direction (README, docs/design.md §2), checked on every import in the source —
lazy ones inside functions included: a package imports only packages below it; packages on one level (quant and
sharding; train and analysis; plan and bench) do not import each other; only layers/backends.py (and the
benchmarks) import pallas_kernels, which import only k3jax.ops and k3jax.notation."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# k3jax's top-level modules and packages by level: each may import its own and lower levels' only.
LEVELS = (
    {"notation", "errors", "pytree"},
    {"config", "hf_config", "hf_keys", "lora_config", "data", "tokenizer", "chat"},  # config + hf_*: one unit
    {"ops", "reference"},
    {"layers"},
    {"model"},
    {"quant", "sharding", "testing"},  # testing: tiny configs, inputs and tolerances over the model
    {"checkpoint"},
    {"train", "analysis"},  # analysis beside train
    {"plan", "bench"},  # plan compiles train steps; bench times everything below
    {"cli"},
)
LEVEL = {name: i for i, names in enumerate(LEVELS) for name in names}
SAME_UNIT = {frozenset(p) for p in (("config", "hf_config"), ("config", "hf_keys"), ("hf_config", "hf_keys"),
                                    ("config", "lora_config"))}


def _imports(path: Path) -> set[str]:
    """Every ``k3jax.<x>`` / ``pallas_kernels`` module named by an import anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "k3jax" else [f"k3jax.{a.name}" for a in node.names]
            out.update(names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] in ("k3jax", "pallas_kernels")}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "k3jax" and len(parts) > 1 else None


def _sources(pkg: str):
    return sorted(p for p in (ROOT / pkg).rglob("*.py"))


def test_every_k3jax_unit_has_a_level():
    units = {p.stem if p.parent == ROOT / "k3jax" else p.relative_to(ROOT / "k3jax").parts[0]
             for p in _sources("k3jax") if p.name != "__init__.py" or p.parent != ROOT / "k3jax"}
    assert units <= set(LEVEL), f"give {sorted(units - set(LEVEL))} a level in LEVELS"


@pytest.mark.parametrize("path", _sources("k3jax"), ids=lambda p: str(p.relative_to(ROOT)))
def test_k3jax_imports_point_down(path):
    rel = path.relative_to(ROOT / "k3jax")
    if rel == Path("__init__.py"):
        return  # the curated public API re-exports from anywhere
    me = rel.parts[0].removesuffix(".py")
    bad = []
    for module in _imports(path):
        if module.startswith("pallas_kernels"):
            if rel != Path("layers/backends.py") and me != "bench":
                bad.append(f"{module} (the model reaches kernels through layers/backends.py; bench times them)")
            continue
        other = _unit(module)
        if other is None or other == me or frozenset({me, other}) in SAME_UNIT:
            continue
        if LEVEL[other] >= LEVEL[me]:
            bad.append(f"{module} (level {LEVEL[other]} {sorted(LEVELS[LEVEL[other]])}; {me} is level {LEVEL[me]})")
    assert not bad, f"k3jax/{rel} imports upward or sideways: {bad}"


@pytest.mark.parametrize("path", _sources("pallas_kernels"), ids=lambda p: str(p.relative_to(ROOT)))
def test_pallas_kernels_import_only_ops_and_notation(path):
    bad = [m for m in _imports(path) if m.startswith("k3jax") and _unit(m) not in ("ops", "notation")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
