"""Where shardkit raises its errors, read from its own source: the data behind ``docs/errors.md``
(``python -m shardkit.cli.error_sites > docs/errors.md``) and behind the test that every raise site
uses one of the :mod:`shardkit.core.errors` family.

Example:
  >>> sites = raise_sites()
  >>> any(s.error == "LayoutError" and s.module == "core.mesh" for s in sites)
  True
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

from shardkit.core import errors

PACKAGE = pathlib.Path(__file__).parent.parent  # shardkit/, from shardkit/cli/
# Raises that are not bad input, each with why: argparse's and Python's own protocols, and
# invariants whose failure is a bug in shardkit (never the user's input).
NOT_BAD_INPUT = {
    "AssertionError": "an internal invariant (a pipeline schedule's timing rules)",
    "AttributeError": "the module __getattr__ protocol of the lazy namespace",
    "KeyError": 'the Mapping protocol of a plan\'s result (result["best"])',
    "SystemExit": "the command line's exit code after Ctrl-C",
    "ValueError": "a converter argparse calls, which turns it into a usage error",
    "PlanInterrupted": "Ctrl-C during a plan, carrying the partial result",
}


@dataclasses.dataclass(frozen=True)
class RaiseSite:
    """One ``raise Error(...)`` in the package: the error's class name, the module (dotted, under
    ``shardkit``), the enclosing function, the line, and the message's fixed text (``…`` where a
    value is filled in)."""

    error: str
    module: str
    function: str
    line: int
    message: str


def _message_text(node: ast.expr | None, constants: dict[str, str]) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_message_text(v, constants) if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_text(node.left, constants) + _message_text(node.right, constants)
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _message_text(node.func.value, constants)
    return "…"


class _Finder(ast.NodeVisitor):
    def __init__(self, module: str, constants: dict[str, str]):
        self.module, self.constants = module, constants
        self.scope: list[str] = []
        self.sites: list[RaiseSite] = []

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Raise(self, node: ast.Raise) -> None:
        call = node.exc
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            message = _message_text(call.args[0] if call.args else None, self.constants)
            where = ".".join(self.scope) or "<module>"
            self.sites.append(RaiseSite(call.func.id, self.module, where, node.lineno, " ".join(message.split())))


def raise_sites(package: pathlib.Path = PACKAGE) -> list[RaiseSite]:
    """Every ``raise Name(...)`` in the package's modules, in module and line order."""
    sites = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {
            t.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        module = ".".join(path.relative_to(package).with_suffix("").parts)
        finder = _Finder(module, constants)
        finder.visit(tree)
        sites += finder.sites
    return sites


def refinements(package: pathlib.Path = PACKAGE) -> dict[str, tuple[str, str]]:
    """Subclasses of the family defined elsewhere in the package (e.g. ``CheckpointDamaged``), read
    from the source: ``{name: (base name, docstring)}``."""
    family = {"ShardkitError", *(c.__name__ for c in errors.FAMILY)}
    found: dict[str, tuple[str, str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or not node.bases or not isinstance(node.bases[0], ast.Name):
                continue
            if node.bases[0].id in family and node.name not in family:
                found[node.name] = (node.bases[0].id, " ".join((ast.get_docstring(node) or "").split()))
    return found


def catalogue() -> str:
    """``docs/errors.md``: the family from its docstrings, then each class's raise sites."""
    subclasses, sites = refinements(), raise_sites()
    out = [
        "# Errors: what shardkit refuses, and the fix it names",
        "",
        "<!-- Generated by `python -m shardkit.cli.error_sites > docs/errors.md`; a test checks it is current. -->",
        "",
        inspect.getdoc(errors) or "",
        "",
        "Each bad input of the catalogue in `tests/test_bad_inputs.py` (and `tests/test_errors.py`) is "
        "checked to raise its error before anything is compiled or written, with the message shown.",
    ]
    classes: list[type[errors.ShardkitError]] = [errors.ShardkitError, *errors.FAMILY]
    for cls in classes:
        subs = sorted(name for name, (base, _) in subclasses.items() if base == cls.__name__)
        mine = [s for s in sites if s.error == cls.__name__ or s.error in subs]
        out += ["", f"## `{cls.__name__}`" + (f" (and {', '.join(f'`{s}`' for s in subs)})" if subs else ""), ""]
        out += [inspect.getdoc(cls) or "", ""]
        for sub in subs:
            out += [f"`{sub}`: {subclasses[sub][1]}", ""]
        if mine:
            out += ["| where | message (… is a value) |", "|---|---|"]
            for s in mine:
                text = s.message if len(s.message) <= 150 else s.message[:149] + "…"
                out.append(f"| `{s.module}.{s.function}` | {text.replace('|', '/')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(catalogue(), end="")
