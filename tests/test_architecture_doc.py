"""docs/architecture.md cannot drift from the code: every module, class, function and
file it names exists, each layer row names modules of its own folder, and each walk's
hops (its ```walk blocks) exist, in call order.

Names resolve against the syntax tree of sb_titan/ and kernels/ (nothing is imported),
by suffix (`SBTrainer._after_step`) or by dotted parts in order
(`sb_titan_kernels.block_sparse_forward_triton`, `balance.dst.tune_budgets`), so a page
may name a function by its package's re-export and a move inside a package does not
break it; a rename or removal does. In a walk, `A → B` means B is called in A's body
(by its last name: `self.cost_model.refit(...)` calls `CostModel.refit`); `A ⇢ B`
means A's result reaches B through TorchTitan or a queue (both must exist); each line
starts from a hop named on an earlier line, so a walk reads in call order.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from conftest import REPO

PAGE = REPO / "docs" / "architecture.md"
IDENT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
CALL = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")
FILE_EXT = {"py", "md", "sh", "toml", "json", "jsonl", "bin", "npy", "txt"}
DEF = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
PATH = re.compile(r"(?<![\w/.`-])((?:[\w.-]+/)+[\w.-]*\.(?:py|md|sh|toml|json))\b")


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("").parts
    if rel[0] == "kernels":
        rel = ("sb_titan_kernels", *rel[1:])
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


class Index:
    """Qualified names of every module, class, function, method, class field, `self.x`
    attribute and module-level constant; and the words the code uses as keys."""

    def __init__(self, sources: dict[str, str]):
        self.defs: dict[str, ast.AST | None] = {}
        self.words: set[str] = set()
        for module, text in sources.items():
            tree = ast.parse(text)
            self.defs[module] = tree
            self._body(module, tree.body, in_class=False)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    self.words |= set(re.findall(r"[\w.]+", node.value))
                elif isinstance(node, ast.arg):
                    self.words.add(node.arg)
                elif isinstance(node, ast.keyword) and node.arg:
                    self.words.add(node.arg)

    def _body(self, prefix: str, body: list[ast.stmt], in_class: bool) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.defs[f"{prefix}.{node.name}"] = node
                if isinstance(node, ast.ClassDef):
                    self._body(f"{prefix}.{node.name}", node.body, in_class=True)
                elif in_class:
                    for sub in ast.walk(node):
                        if (
                            isinstance(sub, ast.Attribute)
                            and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name)
                            and sub.value.id == "self"
                        ):
                            self.defs.setdefault(f"{prefix}.{sub.attr}", None)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.defs.setdefault(f"{prefix}.{t.id}", None)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.defs.setdefault(f"{prefix}.{node.target.id}", None)

    def resolve(self, name: str, within: str = "") -> list[str]:
        """Qualified names `name` can mean (under package `within` if given)."""
        parts = name.split(".")
        pool = [q for q in self.defs if not within or q.startswith(within + ".")]
        exact = [q for q in pool if q == name or q.endswith("." + name)]
        if exact:
            return exact
        out = []
        for q in pool:
            comps = q.split(".")
            if comps[-1] != parts[-1]:
                continue
            rest = iter(comps[:-1])
            if all(any(p == c for c in rest) for p in parts[:-1]):
                out.append(q)
        return out

    def calls(self, qualname: str) -> set[str]:
        """Last names of everything called in a function's body."""
        node = self.defs[qualname]
        out = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                f = sub.func
                out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
        return out


def _exists(path: str, files: set[str]) -> bool:
    """A repository path, or one relative to a folder the page is talking about."""
    path = path.rstrip("/")
    return path in files or any(f.endswith("/" + path) for f in files)


def _span_problems(index: Index, span: str, files: set[str]) -> list[str]:
    span = span.strip()
    m = CALL.match(span)
    name, args = (m.group(1), m.group(2)) if m else (span, None)
    if "/" in span or span.endswith("/"):
        ok = _exists(span.split()[0], files)
        return [] if ok else [f"`{span}`: no such file or folder"]
    if " " in span or not IDENT.match(name):
        return []  # a command line or an expression; its names are checked as prose
    if "." in name and name.split(".")[-1] in FILE_EXT:  # tokens.bin: written by the code
        ok = _exists(name, files) or name in index.words
        return [] if ok else [f"`{span}`: no file of that name, and no code writes one"]
    found = index.resolve(name)
    if not found:
        if "." not in name and name in index.words:
            return []  # a key, keyword or argument the code uses (`attention_masks`)
        return [f"`{span}`: names nothing in sb_titan/ or kernels/"]
    if args is not None:
        target = index.defs[found[0]]
        known = set()
        if isinstance(target, ast.ClassDef):
            known = {q.rsplit(".", 1)[1] for q in index.defs if q.startswith(found[0] + ".")}
        elif isinstance(target, ast.FunctionDef):
            known = {a.arg for a in target.args.args + target.args.kwonlyargs}
        wrong = [a for a in (x.strip() for x in args.split(",")) if a.isidentifier() and known]
        wrong = [a for a in wrong if a not in known]
        if wrong:
            return [f"`{span}`: {found[0]} has no {wrong}"]
    return []


def page_problems(index: Index, text: str, files: set[str]) -> list[str]:
    problems = []
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        problems += _span_problems(index, span, files)
    for path in PATH.findall(prose):
        if not _exists(path, files):
            problems.append(f"{path}: no such file")
    for line in prose.splitlines():  # a layer row names modules of its own folder
        cells = line.split("|")
        if len(cells) < 4 or not re.fullmatch(r"\s*`sb_titan/[\w/]+/`.*", cells[2]):
            continue
        package = "sb_titan." + cells[2].split("`")[1].strip("/").split("/", 1)[1].replace("/", ".")
        package = package.rstrip(".")
        for span in re.findall(r"`([\w.]+)`", cells[3]):
            if span.split(".")[-1] in FILE_EXT:
                continue
            if not index.resolve(span, within=package):
                problems.append(f"layer {package}: `{span}` is not in {package}")
    for block in re.findall(r"```walk\n(.*?)```", text, flags=re.S):
        problems += walk_problems(index, block)
    return problems


def walk_problems(index: Index, block: str) -> list[str]:
    problems, named = [], set()
    for n, line in enumerate(x for x in block.splitlines() if x.strip()):
        tokens = re.split(r"\s*([→⇢])\s*", line.strip())
        hops, arrows = tokens[0::2], tokens[1::2]
        if n and hops[0] not in named:
            problems.append(f"walk line {line!r}: starts from {hops[0]}, named nowhere above")
        resolved = []
        for hop in hops:
            found = [q for q in index.resolve(hop) if isinstance(index.defs[q], DEF)]
            if len(found) != 1:
                what = "names nothing" if not found else f"is ambiguous: {found}"
                problems.append(f"walk hop {hop} {what}")
            resolved.append(found[0] if len(found) == 1 else None)
            named.add(hop)
        pairs = list(zip(hops, resolved, strict=True))
        for (a, qa), arrow, (b, qb) in zip(pairs[:-1], arrows, pairs[1:], strict=True):
            if arrow != "→" or qa is None or qb is None:
                continue
            if not isinstance(index.defs[qa], ast.FunctionDef):
                problems.append(f"walk {a} → {b}: {a} is not a function")
            elif qb.rsplit(".", 1)[1] not in index.calls(qa):
                problems.append(f"walk {a} → {b}: {a} does not call {b}")
    return problems


@functools.cache
def _index() -> Index:
    paths = sorted((REPO / "sb_titan").rglob("*.py")) + sorted((REPO / "kernels").rglob("*.py"))
    return Index({_module_name(p): p.read_text() for p in paths})


def _files() -> set[str]:
    """Every file and folder of the checkout, relative (posix)."""
    out = set()
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if not {".git", ".venv", "__pycache__"} & set(rel.parts):
            out.add(rel.as_posix())
    return out


def test_architecture_page_names_only_what_exists():
    problems = page_problems(_index(), PAGE.read_text(), _files())
    assert not problems, "docs/architecture.md has drifted:\n" + "\n".join(problems)


def test_each_walk_has_hops():
    assert len(re.findall(r"```walk\n", PAGE.read_text())) == 2


# -- the check itself finds each kind of drift ----------------------------------------------
CODE = {
    "sb_titan.runtime.trainer": """
class SBTrainer:
    def __init__(self):
        self.cost_model = build_run_cost_model()
    def _take_step(self, scheduled):
        return scheduled
def build_run_cost_model():
    return CostModel()
""",
    "sb_titan.runtime.tensorboard": "def add_run_tensorboard(): pass\n",
    "sb_titan.balance.cost_model.model": """
class CostModel:
    def refit(self, observations): pass
""",
}
STALE = """
| runtime | `sb_titan/runtime/` | `trainer`, `tb_events` | below |

`SBTrainer._step_budgets` calls `CostModel.refit(plan)` (runtime/cost.py).

```walk
SBTrainer.__init__ → build_run_cost_model → CostModel.refit
CostModel.refit → SBTrainer.missing
SBTrainer._take_step ⇢ CostModel.refit
```
"""
FOUND = [
    "layer sb_titan.runtime: `tb_events`",
    "`tb_events`: names nothing",
    "`SBTrainer._step_budgets`: names nothing",
    "`CostModel.refit(plan)`: sb_titan.balance.cost_model.model.CostModel.refit has no ['plan']",
    "runtime/cost.py: no such file",
    "walk build_run_cost_model → CostModel.refit: build_run_cost_model does not call",
    "walk hop SBTrainer.missing names nothing",
    "walk line 'SBTrainer._take_step ⇢ CostModel.refit': starts from SBTrainer._take_step",
]


def test_the_check_finds_each_kind_of_drift():
    problems = page_problems(Index(CODE), STALE, {"sb_titan/runtime"})
    missed = [f for f in FOUND if not any(f in p for p in problems)]
    assert not missed, f"missed {missed} in:\n" + "\n".join(problems)
    assert len(problems) == len(FOUND), "\n".join(problems)


@pytest.mark.parametrize(
    "page",
    [
        "`SBTrainer._take_step(scheduled)` (runtime/trainer.py)",
        "```walk\nSBTrainer.__init__ → build_run_cost_model → CostModel\n```",
    ],
)
def test_the_check_passes_what_exists(page):
    assert page_problems(Index(CODE), page, {"sb_titan/runtime/trainer.py"}) == []
