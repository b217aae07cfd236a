"""The import graph follows docs/architecture.md: no module imports a layer above its own."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "shardkit"

# docs/architecture.md, "Layers".
LAYERS = {
    0: {
        "_lazy",
        "errors",
        "error_sites",
        "tensorboard",
        "xla_flags",
        "host_allocator",
        "orbax_logs",
        "flags",
        "config",
        "devices",
        "mesh",
        "rules",
        "hlo",
        "hardware",
        "precision",
        "data",
        "distributed",
        "launch",
        "dirlock",
        "stopping",
        "progress",
        "run_dir",
        "estimate",
        "tokenizer",
        "packed",
        "dropout",
        "partitioned",
        "hlo_uses",
    },
    1: {
        "partition",
        "boundaries",
        "model",
        "model_source",
        "parallel",
        "models",
        "generate",
        "state",
        "losses",
        "sharding",
        "inputs",
        "checksums",
    },
    2: {"report", "report_data", "extrapolate"},
    3: {"steps", "accumulation", "train", "checkpoint", "checkpoint_checks", "pretrained"},
    4: {"dryrun", "plan", "auto_layout", "run", "run_inputs", "saved_run", "run_log", "cli", "__init__"},
}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


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
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(top(a.name) for a in node.names if a.name.startswith("shardkit."))
    return {f for f in found if f}


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def own_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_module_has_a_layer():
    assert {own_name(p) for p in MODULES} <= set(LAYER_OF), {own_name(p) for p in MODULES} - set(LAYER_OF)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path):
    mine = LAYER_OF[own_name(path)]
    upward = {m: LAYER_OF[m] for m in runtime_imports(path) if LAYER_OF.get(m, -1) > mine}
    assert not upward, f"{path.name} (layer {mine}) imports {upward}"


def test_the_analysis_layer_does_not_import_the_training_layer():
    text = (PACKAGE / "report.py").read_text()
    assert "shardkit.train" not in text and "shardkit.checkpoint" not in text
    assert not runtime_imports(PACKAGE / "report.py") & LAYERS[3]


def test_the_code_cites_no_file_outside_the_repository():
    for path in MODULES:
        assert "DESIGN.md" not in path.read_text(), path
