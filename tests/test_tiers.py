"""The developer's loop (tests/tiers.py) names modules and tests that exist, so that a rename
cannot drop a promise from it unnoticed; and it leaves out every slow test."""

import ast
import pathlib

import pytest
from tiers import DEV_MODULES, DEV_TESTS, is_dev

TESTS = pathlib.Path(__file__).parent


def defined_tests(module: str) -> set[str]:
    tree = ast.parse((TESTS / module).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


@pytest.mark.parametrize("module", sorted(DEV_MODULES | set(DEV_TESTS)))
def test_every_named_module_and_test_exists(module):
    assert (TESTS / module).exists(), module
    missing = DEV_TESTS.get(module, set()) - defined_tests(module)
    assert not missing, f"tests/tiers.py names {sorted(missing)} in {module}, which it does not define"


def test_slow_tests_and_other_tests_are_not_in_the_loop():
    assert not is_dev("tests/test_golden.py", "test_compiled_program_matches_its_golden_summary", slow=True)
    assert is_dev("tests/test_golden.py", "test_compiled_program_matches_its_golden_summary", slow=False)
    assert is_dev("shardkit/core/mesh.py", "shardkit.core.mesh.Layout", slow=False)
    assert not is_dev("tests/test_plan.py", "test_predictions_respond_to_batch", slow=False)
