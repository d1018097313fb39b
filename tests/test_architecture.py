"""The package's shape, checked: layers import only downward (function-level imports
included), no import cycles, and size limits (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

# Bottom up. A module may import its own layer's package and any layer below; packages
# that share a layer (profiler, simulator) may not import each other.
LAYERS = [
    ["sb_titan_kernels"],
    ["sb_titan.attention"],
    ["sb_titan.context_parallel"],
    ["sb_titan.models"],
    ["sb_titan.balance"],
    ["sb_titan.data"],
    ["sb_titan.profiler", "sb_titan.simulator"],
    ["sb_titan.runtime"],
    ["sb_titan.config"],
    ["sb_titan.eval"],
    ["sb_titan.tools"],
]
ANYWHERE = ["sb_titan.compat", "sb_titan.util"]  # import nothing of the project; any layer
# TorchTitan finds a model's config registry beside the model; it is an entry point.
ENTRY_POINTS = {"sb_titan.models.qwen2_5.config_registry": "sb_titan.tools"}
PURE = ["sb_titan_kernels", "sb_titan.attention"]  # run on bare torch + Triton
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / "sb_titan").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((REPO / "kernels").glob("*.py")):
        stem = path.stem
        out["sb_titan_kernels" + ("" if stem == "__init__" else f".{stem}")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every project module `name` imports, at any depth of the file."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES}
    return out - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(name: str) -> str:
    for group in LAYERS:
        for pkg in group:
            if name == pkg or name.startswith(pkg + "."):
                return pkg
    for pkg in ANYWHERE:
        if name == pkg or name.startswith(pkg + "."):
            return pkg
    return name


def _layer(name: str) -> int | None:
    pkg = _package(ENTRY_POINTS.get(name, name))
    return next((i for i, group in enumerate(LAYERS) if pkg in group), None)


def test_every_module_has_a_layer():
    homeless = [
        n for n in MODULES if n != "sb_titan" and _layer(n) is None and _package(n) not in ANYWHERE
    ]
    assert not homeless, f"modules outside every layer: {homeless}"


def test_imports_only_go_down():
    wrong = []
    for name, targets in GRAPH.items():
        if name == "sb_titan":
            continue
        for target in targets:
            if _package(target) in ANYWHERE or target == "sb_titan":
                continue
            mine, theirs = _layer(name), _layer(target)
            if _package(name) in ANYWHERE:
                wrong.append(
                    f"{name} -> {target} ({_package(name)} imports nothing of the project)"
                )
            elif theirs > mine or (theirs == mine and _package(target) != _package(name)):
                if name not in ENTRY_POINTS:
                    wrong.append(f"{name} -> {target}")
                elif theirs > _layer(name):
                    wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import, function-level too."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    # A package's __init__ re-exporting its modules is not a cycle of concepts.
    real = [c for c in cycles if not _only_package_reexports(c)]
    assert not real, f"import cycles: {real}"


def _only_package_reexports(component: list[str]) -> bool:
    inits = [n for n in component if MODULES[n].name == "__init__.py"]
    rest = [n for n in component if n not in inits]
    # acyclic once the package __init__ files are removed
    sub = {n: GRAPH[n] & set(rest) for n in rest}
    seen, done = set(), set()

    def has_cycle(v):
        seen.add(v)
        for w in sub[v]:
            if w in seen and w not in done:
                return True
            if w not in seen and has_cycle(w):
                return True
        done.add(v)
        return False

    return bool(inits) and not any(has_cycle(v) for v in rest if v not in seen)


@pytest.mark.parametrize("package", PURE)
def test_kernels_and_attention_never_import_torchtitan(package):
    users = []
    for name, path in MODULES.items():
        if _package(name) != package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            if any(m.split(".")[0] == "torchtitan" for m in mods):
                users.append(name)
    assert not users, users


def test_sizes():
    """No module over ~500 lines and no function over ~80, kernels excepted."""
    big = []
    for name, path in MODULES.items():
        if name.startswith("sb_titan_kernels"):
            continue
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    big.append(f"{name}.{node.name}: {n} lines")
    assert not big, big


def test_pyproject_lists_every_package():
    import tomli

    listed = set(
        tomli.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    assert packages == listed, (packages - listed, listed - packages)


# The balance loop has one owner (docs/architecture.md): inside sb_titan/ only the
# balancer builds a planner, runs DST or keeps the cost-model snapshots. Each part is
# named where it lives; benches and tests may call the parts directly.
BALANCER = "sb_titan.balance.balancer"
LOOP_PARTS = {
    "Planner": "sb_titan.balance.sab",
    "tune_budgets": "sb_titan.balance.dst",
    "step_budgets": BALANCER,
    "CostModelSnapshots": "sb_titan.balance.snapshots",
}


def _loop_parts_named(tree: ast.AST) -> set[str]:
    """Which LOOP_PARTS a syntax tree names: called, referenced or imported, under any
    module alias (`sab.Planner(...)`, `from ... import tune_budgets as solve`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rpartition(".")[2])
    return found & set(LOOP_PARTS)


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("from sb_titan.balance.sab import Planner\np = Planner(lengths)", {"Planner"}),
        (
            "import sb_titan.balance.dst as d\nd.tune_budgets(units, m, cfg, 'mass')",
            {"tune_budgets"},
        ),
        ("from sb_titan.balance.dst import tune_budgets as solve", {"tune_budgets"}),
        ("make = functools.partial(sab.Planner, lengths)", {"Planner"}),
        ("plan = balancer.next_step().plan", set()),
    ],
)
def test_loop_part_finder(source, named):
    assert _loop_parts_named(ast.parse(source)) == named


def test_only_the_balancer_plans_and_budgets():
    wrong = []
    for name, path in MODULES.items():
        if not name.startswith("sb_titan.") or name == BALANCER:
            continue
        for part in sorted(_loop_parts_named(ast.parse(path.read_text()))):
            home = LOOP_PARTS[part]
            if name != home and not name.startswith(home + "."):
                wrong.append(f"{name} uses {part}")
    assert not wrong, "only balance/balancer.py may plan and budget:\n" + "\n".join(wrong)


# Lower layers take what they use (docs/architecture.md): below runtime/ no function
# takes a parameter typed `Any` (the trainer's whole config hid there), and nothing
# names the trainer's config class. Read from the syntax tree, so a rename or an
# alias cannot hide a parameter.
TRAINER_NAMES = {"SBTrainer"}


def _below_runtime(name: str) -> bool:
    runtime = _layer("sb_titan.runtime")
    if _package(name) in ANYWHERE:
        return True
    layer = _layer(name)
    return name not in ENTRY_POINTS and layer is not None and layer < runtime


def _annotation_tree(node: ast.expr | None) -> ast.AST | None:
    """An annotation as a tree, string annotations (`"Any | None"`) parsed too."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return ast.parse(node.value, mode="eval").body
    return node


def _names_any(node: ast.AST | None) -> bool:
    """`Any`, `typing.Any`, `Any | None`, `Optional[Any]`: the annotation is Any at its
    top (a union counts); `list[Any]` or `dict[str, Any]` says what the container is."""
    node = _annotation_tree(node)
    if node is None:
        return False
    if isinstance(node, ast.Name) or isinstance(node, ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) == "Any"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _names_any(node.left) or _names_any(node.right)
    if isinstance(node, ast.Subscript):
        outer = node.value.id if isinstance(node.value, ast.Name) else ""
        outer = node.value.attr if isinstance(node.value, ast.Attribute) else outer
        if outer in ("Optional", "Union"):
            inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return any(_names_any(e) for e in inner)
    return False


def _any_parameters(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        a = node.args
        params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
        name = getattr(node, "name", "<lambda>")
        out += [f"{name}({p.arg}) line {p.lineno}" for p in params if _names_any(p.annotation)]
    return out


def _trainer_references(tree: ast.AST) -> list[str]:
    """Where a tree names the trainer's class: code, imports and string annotations."""
    out = []
    for node in ast.walk(tree):
        named, annotation = None, None
        if isinstance(node, ast.Name):
            named = node.id
        elif isinstance(node, ast.Attribute):
            named = node.attr
        elif isinstance(node, ast.alias):
            named = node.name.rpartition(".")[2]
        elif isinstance(node, ast.arg | ast.AnnAssign):
            annotation = node.annotation
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotation = node.returns
        if named in TRAINER_NAMES:
            out.append(f"{named} line {getattr(node, 'lineno', '?')}")
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            out += _trainer_references(_annotation_tree(annotation))
    return out


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("def f(config: Any): ...", ["f(config) line 1"]),
        ("def f(cfg: typing.Any | None = None): ...", ["f(cfg) line 1"]),
        ("def f(*, c: 'Optional[Any]'): ...", ["f(c) line 1"]),
        ("def f(**kw: Any): ...", ["f(kw) line 1"]),
        ("def f(c: Training, rows: dict[str, Any]) -> Any: ...", []),
    ],
)
def test_any_parameter_finder(source, found):
    assert _any_parameters(ast.parse(source)) == found


@pytest.mark.parametrize(
    ("source", "count"),
    [
        ("from sb_titan.runtime.trainer import SBTrainer", 1),
        ("import sb_titan.runtime.trainer as t\ndef f(c: t.SBTrainer.Config): ...", 1),
        ("def f(c: 'SBTrainer.Config'): ...", 1),
        ("def f(c: Training) -> None: ...", 0),
    ],
)
def test_trainer_reference_finder(source, count):
    assert len(_trainer_references(ast.parse(source))) == count


def test_lower_layers_take_what_they_use():
    wrong = []
    for name, path in MODULES.items():
        if not _below_runtime(name):
            continue
        tree = ast.parse(path.read_text())
        wrong += [f"{name}: {p} is typed Any" for p in _any_parameters(tree)]
        wrong += [f"{name}: names the trainer, {r}" for r in _trainer_references(tree)]
    assert not wrong, "below runtime/, take typed sections, not the trainer's config:\n" + (
        "\n".join(wrong)
    )
