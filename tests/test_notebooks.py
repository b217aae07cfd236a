"""Every notebook runs end to end in a real Jupyter kernel, and the stored copy shows what it does.

The repository keeps the notebooks with their outputs (pictures included) for readers; each test
re-executes one from its stored sources and compares the structure of the outputs: which cells
print, which draw pictures or return values. Pixels and numbers are not compared (they move with
the machine); errors fail the test.
"""

import importlib.util
import pathlib

import nbformat
import pytest
from helpers import TEST_XLA_FLAGS

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "notebooks" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def structure(nb) -> list[tuple[bool, tuple[tuple[str, ...], ...]]]:
    """Per code cell: does it print to stdout, and the MIME types of each picture or value it shows."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        prints = any(o.output_type == "stream" and o.name == "stdout" for o in cell.outputs)
        shown = tuple(
            tuple(sorted(k for k in o.data if k != "text/plain"))
            for o in cell.outputs
            if o.output_type in ("display_data", "execute_result")
        )
        out.append((prints, shown))
    return out


def test_the_stored_notebooks_are_the_generated_ones_with_outputs():
    make = generator()
    assert sorted(make.NOTEBOOKS) == [p.name for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        stored = nbformat.read(path, as_version=4)
        built = make.build(make.NOTEBOOKS[path.name])
        assert [(c.cell_type, c.source) for c in stored.cells] == [(c.cell_type, c.source) for c in built.cells], (
            f"{path.name} differs from notebooks/make_notebooks.py: run `python notebooks/make_notebooks.py`"
        )
        code = [c for c in stored.cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code), f"{path.name} is stored without its outputs"
        assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), f"{path.name} has no picture"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_as_stored(path, tmp_path):
    stored = nbformat.read(path, as_version=4)
    # The tests' compile flags: the pipeline notebook ran in 81 s with them, 124 s with XLA's defaults.
    fresh = generator().execute(nbformat.read(path, as_version=4), str(tmp_path), xla_flags=TEST_XLA_FLAGS)
    errors = [o for c in fresh.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0]
    assert structure(fresh) == structure(stored)
