"""How many imports of k3jax / pallas_kernels modules sit inside functions rather than at a module's top level
(experiments/LOG.md, 2026-12-06, session 23). Usage: python experiments/count_lazy_imports.py [PACKAGE_DIR]
(default k3jax); prints "<imports> <inside functions> <fraction>", then the modules with the most."""

import ast
import pathlib
import sys


def main(root: str = "k3jax") -> None:
    total, inner, per = 0, 0, {}
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if not any(m.split(".")[0] in ("k3jax", "pallas_kernels") for m in mods):
                continue
            total += 1
            if id(node) not in top:  # inside a function (or a class / if block): not at the module's top level
                inner += 1
                per[str(path)] = per.get(str(path), 0) + 1
    print(total, inner, round(inner / max(total, 1), 3))
    for name, n in sorted(per.items(), key=lambda kv: -kv[1]):
        print(n, name)


if __name__ == "__main__":
    main(*sys.argv[1:])
