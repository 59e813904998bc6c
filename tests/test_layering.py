"""The architecture's dependency direction (README, docs/design.md §2), checked on every import in the source —
lazy ones inside functions included: a package imports only packages below it; packages on one level (quant and
sharding; train and analysis; plan, bench and ablate) do not import each other; only layers/backends.py (and the
benchmarks) import pallas_kernels, which import only k3jax.ops and k3jax.notation. Inside a package too: no import
cycle among modules, and no module reaches for another module's ``_private`` name (what two modules share is public
in its one home)."""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# k3jax's top-level modules and packages by level: each may import its own and lower levels' only.
LEVELS = (
    {"notation", "errors", "pytree"},
    {"config", "data", "tokenizer", "chat", "distributed"},  # distributed: the process group, over jax alone
    {"ops", "reference"},
    {"layers"},
    {"model"},
    {"optim"},  # the optimizers and the router-bias / QB math: below sharding, whose QB update applies it on a mesh
    {"quant", "sharding", "testing"},  # testing: tiny configs, inputs and tolerances over the model
    {"checkpoint"},
    {"train", "analysis"},  # analysis beside train
    {"draft"},  # speculative decoding: the draft over the target model; its training and measurement reuse train's
    {"plan", "bench", "ablate"},  # plan compiles train steps; bench times everything below; ablate runs studies
    {"cli"},
)
LEVEL = {name: i for i, names in enumerate(LEVELS) for name in names}


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
        if other is None or other == me:
            continue
        if LEVEL[other] >= LEVEL[me]:
            bad.append(f"{module} (level {LEVEL[other]} {sorted(LEVELS[LEVEL[other]])}; {me} is level {LEVEL[me]})")
    assert not bad, f"k3jax/{rel} imports upward or sideways: {bad}"


@pytest.mark.parametrize("path", _sources("pallas_kernels"), ids=lambda p: str(p.relative_to(ROOT)))
def test_pallas_kernels_import_only_ops_and_notation(path):
    bad = [m for m in _imports(path) if m.startswith("k3jax") and _unit(m) not in ("ops", "notation")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of k3jax and pallas_kernels (a package is its __init__)."""
    out = {}
    for pkg in ("k3jax", "pallas_kernels"):
        for path in _sources(pkg):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _module_files()


def _owner(name: str) -> str | None:
    """The module that defines dotted ``name``: itself if a module, else its longest module prefix."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str) -> tuple[set[str], list[str]]:
    """(modules ``module`` imports, anywhere in its source; the other modules' private names it reaches for). A
    package's __init__ only re-exports: an import of a package counts as an edge to nothing, so the curated API does
    not close a circle through every module it re-exports."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    here = module if is_pkg else module.rpartition(".")[0]
    deps, private, aliases = set(), [], {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (target := _owner(a.name)) is not None:
                    deps.add(target)
                    if a.asname:
                        aliases[a.asname] = target
        elif isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                parts = here.split(".")
                src = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if _owner(src) is None:
                continue
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in MODULES:
                    deps.add(sub)
                    aliases[a.asname or a.name] = sub
                else:
                    deps.add(_owner(src))
                    if a.name.startswith("_") and not a.name.startswith("__") and _owner(src) != module:
                        private.append(f"from {src} import {a.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = aliases.get(node.value.id)
            if target and target != module and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{node.value.id}.{node.attr} ({target})")
    deps = {d for d in deps if d != module and MODULES[d].name != "__init__.py"}
    return (set() if is_pkg else deps), private


def test_no_import_cycle_among_modules():
    graph = {m: _edges(m)[0] for m in MODULES}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_no_module_imports_another_modules_private_names():
    bad = {m: p for m in MODULES if (p := _edges(m)[1])}
    assert not bad, f"private names used across modules (make them public in their one home): {bad}"


def test_no_module_is_past_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"past ~450 lines a module holds two concepts: split {long}"
