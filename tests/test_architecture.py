"""Layout rules, checked by reading the code (imports inside functions included): no import cycle, a shallow package,
short functions, a small Trainer, and scripts that use only the names a module exports in its ``__all__``."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "precisionloop"
SCRIPTS = sorted([*(ROOT / "recipes").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                  *(PACKAGE / "recipes").glob("*.py")])


def _name(path: Path) -> str:
    """precisionloop/recipes/data.py -> "precisionloop.recipes.data"; recipes/x.py -> "recipes/x.py"."""
    if PACKAGE not in path.parents:
        return str(path.relative_to(ROOT))
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))} | {_name(p): p for p in SCRIPTS}


def _imports(name: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for each import in ``name``'s file, relative imports resolved."""
    path = MODULES[name]
    package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            elif not name.startswith("precisionloop") and node.module and f"{path.parent.relative_to(ROOT)}/{node.module}.py" in MODULES:
                module = f"{path.parent.relative_to(ROOT)}/{node.module}.py"  # a script importing a sibling script
            else:
                module = node.module
            found += [(module, a.name) for a in node.names]
    return found


def _edges(name: str) -> set[str]:
    """The modules of the package and the scripts that ``name`` imports (a submodule named in a from-import too)."""
    edges = set()
    for module, item in _imports(name):
        if item and f"{module}.{item}" in MODULES:
            edges.add(f"{module}.{item}")
        elif module in MODULES:
            edges.add(module)
    return edges - {name}


EDGES = {name: _edges(name) for name in MODULES}


def test_no_import_cycle():
    done, active = set(), []

    def visit(name):
        assert name not in active, f"import cycle: {' -> '.join(active[active.index(name):] + [name])}"
        if name not in done:
            active.append(name)
            for dep in EDGES[name]:
                visit(dep)
            active.pop()
            done.add(name)

    for name in EDGES:
        visit(name)


def test_the_package_is_at_most_six_floors_deep():
    """Floor 1 imports no module of the package; each other module is one floor above the highest it imports. The
    package's ``__init__`` and its recipes, which stand on top of it, are not counted."""
    core = {name for name in MODULES if name.startswith("precisionloop.") and not name.startswith("precisionloop.recipes")}
    floors = {}

    def floor(name):
        if name not in floors:
            floors[name] = 0  # a cycle (test_no_import_cycle's failure) ends here
            floors[name] = 1 + max((floor(dep) for dep in EDGES[name] & core), default=0)
        return floors[name]

    deep = {name: floor(name) for name in sorted(core) if floor(name) > 6}
    assert not deep, deep


def test_no_function_of_the_package_over_60_lines():
    long = []
    for name, path in MODULES.items():
        if not name.startswith("precisionloop"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                start = body[1].lineno if has_doc and len(body) > 1 else body[0].lineno
                if node.end_lineno - start + 1 > 60:
                    long.append(f"{name}:{node.name} ({node.end_lineno - start + 1} lines)")
    assert not long, long


def test_the_trainer_class_is_at_most_300_lines():
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 300, trainer.end_lineno - trainer.lineno + 1


def _exported(module: str) -> set[str]:
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_scripts_import_only_what_a_module_exports():
    private = []
    for script in map(_name, SCRIPTS):
        for module, item in _imports(script):
            if module in MODULES and module.startswith("precisionloop"):
                if item is None and any(part.startswith("_") for part in module.split(".")):
                    private.append(f"{script}: import {module}")
                elif item and f"{module}.{item}" not in MODULES and item not in _exported(module):
                    private.append(f"{script}: from {module} import {item}")
    assert not private, private
