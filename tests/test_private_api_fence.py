"""The compat fence, checked: outside `sb_titan/compat/`, no module touches a private
(`_name`) attribute of another project's module or object, nor imports one
(docs/architecture.md, "compat").

The check reads each module's syntax tree, so a rename cannot hide a touch:
  * imports: `import torch._dynamo`, `from torch.distributed._tensor import X`,
    `from torchtitan.x import _helper`;
  * `name._x` where `name` was imported from another project (`torch._C`);
  * `self._x` / `super()._x` / `def _x` in a class derived from a foreign class, where
    `_x` belongs to that foreign class (found by importing it and reading its source):
    an override of a private hook, or a read of private state;
  * `obj._x` on any other object (`tensor._base`, `model._skip_lm_head`), and the same
    spelled `getattr(obj, "_x")`, unless `_x` is a private name the project itself
    defines on its own classes.
An object's own private state (`self._x` that the class or a project base defines) is
the object's business, and a namedtuple's `_replace` / `_asdict` / `_fields` / `_make`
are its public API (they carry an underscore only to stay clear of field names).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO

PROJECT = ("sb_titan", "sb_titan_kernels")
FENCE = "sb_titan.compat"
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
STRING_ACCESS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


@dataclass(eq=False)
class Module:
    """One parsed module: where each imported name comes from, and its classes."""

    name: str
    tree: ast.Module
    is_package: bool = False
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    stars: list[str] = field(default_factory=list)  # `from x import *` sources

    def __post_init__(self):
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    self.imports[a.asname or top] = (a.name if a.asname else top, None)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(self.name, node, self.is_package)
                for a in node.names:
                    if a.name == "*":
                        self.stars.append(source)
                    else:
                        self.imports[a.asname or a.name] = (source, a.name)
        for node in self.tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node


def _parse(name: str, text: str, is_package: bool = False) -> Module:
    return Module(name, ast.parse(text), is_package)


@functools.cache
def _foreign_module(name: str) -> Module | None:
    """A foreign module's source, found on the path but never imported (importing
    TorchTitan's trainer to read its class takes a minute on a loaded machine)."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name is located, not imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin)
    if rest:
        if not spec.submodule_search_locations:
            return None
        folder = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
        path = folder / "__init__.py" if (folder / "__init__.py").is_file() else None
        if path is None and folder.with_suffix(".py").is_file():
            path = folder.with_suffix(".py")
    if path is None:
        return None
    return _parse(name, path.read_text(), path.name == "__init__.py")


Ref = tuple[Module, ast.ClassDef]


class Project:
    """Every parsed project module, and the private namespaces of classes, the
    project's and the foreign ones they derive from."""

    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self._bases: dict[int, list[Ref | None]] = {}
        self.defined = set()  # private names the project defines on its own classes
        for module in modules.values():
            for cls in module.classes.values():
                self.defined |= _declared(cls) - self.foreign_names(module, cls)

    def module(self, name: str) -> Module | None:
        return self.modules.get(name) if _is_project(name) else _foreign_module(name)

    def find_class(self, module: str, name: str, depth: int = 0) -> Ref | None:
        """Class `name` as `module` defines or re-exports it."""
        m = self.module(module)
        if m is None or depth > 8:
            return None
        if name in m.classes:
            return m, m.classes[name]
        if name in m.imports:
            source, imported = m.imports[name]
            if imported is not None:
                return self.find_class(source, imported, depth + 1)
        for source in m.stars:
            if found := self.find_class(source, name, depth + 1):
                return found
        return None

    def _resolve(self, module: Module, expr: ast.expr) -> Ref | None:
        dotted = []
        while isinstance(expr, ast.Attribute):
            dotted.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        if expr.id in module.classes and not dotted:
            return module, module.classes[expr.id]
        if expr.id not in module.imports:
            return None
        source, name = module.imports[expr.id]
        parts = [*source.split("."), *([name] if name else []), *dotted]
        return self.find_class(".".join(parts[:-1]), parts[-1])

    def bases(self, module: Module, cls: ast.ClassDef) -> list[Ref | None]:
        """Each base class, or None where it cannot be found (a builtin, a dynamic base)."""
        if id(cls) not in self._bases:
            bases = [b.value if isinstance(b, ast.Subscript) else b for b in cls.bases]
            self._bases[id(cls)] = [self._resolve(module, b) for b in bases]
        return self._bases[id(cls)]

    def own_names(self, module: Module, cls: ast.ClassDef) -> set[str]:
        """Private names a project class or its project bases define."""
        out = _declared(cls)
        for base in self.bases(module, cls):
            if base is not None and _is_project(base[0].name):
                out |= self.own_names(*base)
        return out

    def foreign_names(self, module: Module, cls: ast.ClassDef, depth: int = 0) -> set[str]:
        """Private names of the foreign classes a class derives from (all of a foreign
        class's own, with every `self._x` its methods touch)."""
        out = set()
        for base in self.bases(module, cls):
            if base is None or depth > 16:
                continue
            if not _is_project(base[0].name):
                out |= _touched(base[1])
            out |= self.foreign_names(*base, depth + 1)
        return out


def _declared(cls: ast.ClassDef) -> set[str]:
    """Private names a class body defines, and the `self._x` it assigns."""
    out = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            out.add(node.attr)
    return {n for n in out if _private(n)}


def _touched(cls: ast.ClassDef) -> set[str]:
    """A foreign class's private names: what its body defines and every private name
    its methods reach on `self` (also as `setattr(self, "_x", ...)`)."""
    out = _declared(cls)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("self", "cls"):
                out.add(node.attr)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                out.add(node.args[1].value)
    return {n for n in out if _private(n)} - NAMEDTUPLE_API


def _touches(project: Project, module: Module) -> list[str]:
    """Every private touch of a foreign module or object in `module`, as 'line: what'."""
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{module.name}:{node.lineno}: {what}")

    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not _is_project(a.name) and any(map(_private, a.name.split("."))):
                    report(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            source = node.module or ""
            if _is_project(source) or source == "__future__":
                continue
            names = [a.name for a in node.names]
            if any(map(_private, source.split("."))) or any(map(_private, names)):
                report(node, f"from {source} import {', '.join(names)}")

    def visit(node: ast.AST, cls: ast.ClassDef | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node
            foreign = project.foreign_names(module, cls)
            for item in node.body:
                if (
                    isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and item.name in foreign
                ):
                    report(item, f"{cls.name} overrides the foreign private {item.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            check(node, node.value, node.attr, cls)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in STRING_ACCESS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            check(node, node.args[0], node.args[1].value, cls)
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    def check(node: ast.AST, receiver: ast.expr, attr: str, cls: ast.ClassDef | None) -> None:
        what = f"{ast.unparse(receiver)}.{attr}"
        if attr in NAMEDTUPLE_API or (
            isinstance(receiver, ast.Attribute) and _private(receiver.attr)
        ):
            return  # `a._b._c`: reported once, at `a._b`
        if cls is not None and isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            if attr in project.foreign_names(module, cls):
                report(node, f"{what}: private to a foreign base of {cls.name}")
            elif attr not in project.own_names(module, cls):
                report(node, f"{what}: not defined by {cls.name} or its project bases")
        elif (
            cls is not None
            and isinstance(receiver, ast.Call)
            and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super"
        ):
            inherited = set()
            for base in project.bases(module, cls):
                if isinstance(base, tuple):
                    inherited |= project.own_names(*base)
            if attr not in inherited or attr in project.foreign_names(module, cls):
                report(node, f"{what}: a foreign base's private {attr}")
        elif isinstance(receiver, ast.Name) and receiver.id in module.imports:
            source, name = module.imports[receiver.id]
            if not _is_project(source):
                report(node, f"{what}: private to {source}{'.' + name if name else ''}")
        elif attr not in project.defined:
            report(node, f"{what}: no project class defines {attr}")

    visit(module.tree, None)
    return found


@functools.cache
def _project() -> Project:
    modules = {}
    for path in sorted((REPO / "sb_titan").rglob("*.py")):
        name = _module_name(path)
        modules[name] = _parse(name, path.read_text(), path.name == "__init__.py")
    return Project(modules)


def test_no_private_touch_outside_compat():
    project = _project()
    leaks = []
    for name, module in project.modules.items():
        if name == FENCE or name.startswith(FENCE + "."):
            continue
        leaks += _touches(project, module)
    assert not leaks, "private API touched outside sb_titan/compat/:\n" + "\n".join(leaks)


def test_compat_says_why_for_every_function():
    """Each fence-post says why it exists: a docstring on every public function."""
    bare = []
    for name, module in _project().modules.items():
        if name != FENCE and not name.startswith(FENCE + "."):
            continue
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not _private(node.name):
                if not ast.get_docstring(node):
                    bare.append(f"{name}.{node.name}")
    assert not bare, f"compat functions without a docstring: {bare}"


# -- the check itself: it must find each kind of touch, and nothing that is not one -------------
LEAKY = """
import torch._dynamo
import torch.distributed._functional_collectives as funcol
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part
import torch
from torch import nn
from torch.distributed.pipelining import Schedule1F1B

def f(t, model, loader):
    torch._C._current_graph_task_id()
    base = t._base
    model._skip_lm_head = True
    getattr(loader, "_it", None)
    nn._reduction

class Net(nn.Module):
    def forward(self, x):
        return len(self._modules) + x

class Sched(Schedule1F1B):
    def _step_microbatches(self, *a):
        return super()._step_microbatches(*a)

class Mixin:
    def run(self):
        return self._stages
"""
LEAKS = [
    "import torch._dynamo",
    "import torch.distributed._functional_collectives",
    "import _PipelineSchedule",
    "import _generate_llm_fqn_per_model_part",
    "torch._C: private to torch",
    "t._base: no project class defines _base",
    "model._skip_lm_head: no project class",
    "loader._it: no project class",
    "nn._reduction: private to torch.nn",
    "self._modules: private to a foreign base of Net",
    "Sched overrides the foreign private _step_microbatches",
    "super()._step_microbatches: a foreign base's private",
    "self._stages: not defined by Mixin",
]
CLEAN = """
import collections
from torch import nn
from sb_titan.probe.base import Base

Pair = collections.namedtuple("Pair", "a b")

class Mine(nn.Module):
    _cache = None
    def __init__(self):
        super().__init__()
        self._steps = 0
    def _helper(self):
        return self._steps + len(Pair(1, 2)._replace(a=3)._asdict())
    def peer(self, other: "Mine"):
        return other._helper() + other._steps

class Child(Base):
    def run(self):
        return super()._hook() + self._count
"""
BASE = """
class Base:
    def __init__(self):
        self._count = 0
    def _hook(self):
        return 1
"""


def _scan(sources: dict[str, str]) -> list[str]:
    modules = {name: _parse(name, text) for name, text in sources.items()}
    project = Project(modules)
    return [hit for m in modules.values() for hit in _touches(project, m)]


def test_the_check_finds_every_kind_of_touch():
    hits = _scan({"sb_titan.probe.leaky": LEAKY})
    missed = [want for want in LEAKS if not any(want in hit for hit in hits)]
    assert not missed, f"not found: {missed}\nfound:\n" + "\n".join(hits)
    assert len(hits) == len(LEAKS), "\n".join(hits)


@pytest.mark.parametrize("extra", [{}, {"sb_titan.probe.base": BASE}])
def test_the_check_leaves_own_state_alone(extra):
    hits = _scan({"sb_titan.probe.clean": CLEAN, **extra})
    if extra:
        assert not hits, hits
    else:  # without its project base, Child's inherited names have no known owner
        assert hits and all("Child" in h or "super()" in h for h in hits), hits
