"""The layout rules of ARCHITECTURE.md, checked: imports inside the package form no cycle, functions stay short."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "precisionloop"
MODULES = {p.stem: p for p in PACKAGE.glob("*.py")}


def _package_imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("precisionloop."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("precisionloop.")}
    return found & set(MODULES)


def test_no_import_cycle_inside_the_package():
    edges = {name: _package_imports(path) for name, path in MODULES.items()}
    done, active = set(), []

    def visit(name):
        assert name not in active, f"import cycle: {' -> '.join(active[active.index(name):] + [name])}"
        if name in done:
            return
        active.append(name)
        for dep in edges[name]:
            visit(dep)
        active.pop()
        done.add(name)

    for name in edges:
        visit(name)
    assert edges["_compat"] == set() and "trainer" not in edges["tuning"] | edges["loop"] | edges["checkpoint"]


def test_no_function_over_60_lines_outside_recipes():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                start = body[1].lineno if has_doc and len(body) > 1 else body[0].lineno
                if node.end_lineno - start + 1 > 60:
                    long.append(f"{path.name}:{node.name} ({node.end_lineno - start + 1} lines)")
    assert not long, long


def test_the_trainer_class_stays_small():
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 300, trainer.end_lineno - trainer.lineno + 1


def test_the_architecture_table_names_each_modules_imports_and_they_point_to_lower_layers():
    import re

    table = {}
    for line in (PACKAGE.parent / "ARCHITECTURE.md").read_text().splitlines():
        row = re.match(r"\| (\d+) \| `(\w+)` \| .* \| (.*) \|$", line)
        if row:
            table[row.group(2)] = int(row.group(1)), set(re.findall(r"`(\w+)`", row.group(3)))
    stubs = {"fp8_tuning"}  # a removed module that only raises, importing nothing
    assert set(table) == set(MODULES) - stubs
    for name, (layer, listed) in table.items():
        imported = _package_imports(MODULES[name])
        assert listed == imported, f"{name}: the table lists {sorted(listed)}, it imports {sorted(imported)}"
        assert all(table[dep][0] < layer for dep in imported), f"{name} imports from its own layer or above"
