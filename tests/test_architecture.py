"""The import graph follows docs/architecture.md: the folders are layers, and no module imports a
folder above its own or one its folder's ``__init__`` does not declare."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "shardkit"

# docs/architecture.md, "Layers": the package's folders, lowest first. A module imports only from
# its own folder or a folder below it (at run time; the root's __init__ and _lazy import none).
FOLDERS = ("core", "runtime", "io", "parallel", "models", "analysis", "training", "plan", "cli")
ROOT_MODULES = {"__init__", "_lazy", "_moved"}


def top(module: str) -> str:
    """``shardkit.parallel.pipeline`` -> ``parallel``; ``shardkit`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def runtime_imports(path: pathlib.Path) -> set[str]:
    """shardkit modules imported at run time (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardkit"):
            found.add(top(node.module) if node.module != "shardkit" else None)
            if node.module == "shardkit":
                found.update(alias.name if alias.name in FOLDERS else "__init__" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(top(a.name) for a in node.names if a.name.startswith("shardkit."))
    return {f for f in found if f}


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def own_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def declared_imports(folder: str) -> set[str]:
    """The folders a folder's ``__init__`` docstring says it may import (``May import: ...``)."""
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    line = next((line for line in doc.split("\n\n") if line.startswith("May import:")), None)
    assert line is not None, f"shardkit/{folder}/__init__.py: its docstring must say what the folder may import"
    return set(re.findall(r"``(\w+)``", line))


def test_every_module_lives_in_a_folder():
    assert {own_name(p) for p in MODULES} <= set(FOLDERS) | ROOT_MODULES, {own_name(p) for p in MODULES}


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_declares_the_folders_below_it_that_it_may_import(folder):
    below = set(FOLDERS[: FOLDERS.index(folder)])
    assert declared_imports(folder) <= below, f"{folder} declares {declared_imports(folder) - below}, not below it"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_outside_what_its_folder_declares(path):
    mine = own_name(path)
    if mine in ROOT_MODULES:
        assert runtime_imports(path) <= {"_lazy", "_moved"}, f"{path.name} must stay lazy: {runtime_imports(path)}"
        return
    allowed = declared_imports(mine) | {mine, "__init__", "_lazy"}
    assert runtime_imports(path) <= allowed, f"{path.relative_to(PACKAGE)} imports {runtime_imports(path) - allowed}"


def test_the_analysis_folder_does_not_import_training():
    for path in (PACKAGE / "analysis").glob("*.py"):
        assert "training" not in runtime_imports(path), path


def test_the_code_cites_no_file_outside_the_repository():
    for path in MODULES:
        assert "DESIGN.md" not in path.read_text(), path


def test_every_module_path_from_before_the_folders_still_imports_as_the_moved_module():
    import importlib

    from shardkit._moved import MOVED

    for old, new in MOVED.items():
        assert (PACKAGE / pathlib.Path(*new.split("."))).with_suffix(".py").exists(), new
        assert importlib.import_module(f"shardkit.{old}") is importlib.import_module(f"shardkit.{new}"), old
    from shardkit.report import sharding_warnings  # the example

    assert sharding_warnings is importlib.import_module("shardkit.analysis.report").sharding_warnings
    with pytest.raises(ModuleNotFoundError, match="shardkit.reports"):  # a misspelling is still an error
        importlib.import_module("shardkit.reports")


def test_an_old_path_in_a_fresh_process_imports_no_jax_until_the_module_needs_it():
    import subprocess
    import sys

    code = (
        "import sys, shardkit; assert 'jax' not in sys.modules; "
        "from shardkit.checkpoint import Checkpointer; from shardkit.train import Trainer; "
        "import shardkit as sk; assert Trainer is sk.Trainer and Checkpointer is sk.Checkpointer; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
