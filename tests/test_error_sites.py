"""Every raise site in the package uses one of the ShardkitError family, and docs/errors.md,
generated from the family's docstrings and the raise sites, is current."""

import importlib
import inspect
import pathlib

from shardkit.cli.error_sites import NOT_BAD_INPUT, catalogue, raise_sites, refinements
from shardkit.core import errors

ROOT = pathlib.Path(__file__).parent.parent


def _raised_class(site) -> type:
    """The class a raise site raises: a name in its module, or what a helper it calls returns."""
    module = importlib.import_module(f"shardkit.{site.module}")
    raised = getattr(module, site.error)
    if inspect.isfunction(raised):  # `raise halted(state, ...)`: a helper that builds the error
        returned = inspect.signature(raised).return_annotation
        raised = getattr(module, returned) if isinstance(returned, str) else returned
    return raised


def test_every_raise_site_raises_a_member_of_the_family():
    sites = raise_sites()
    assert len(sites) > 150  # the parser found the package's raises
    wrong = []
    for site in sites:
        if site.error in NOT_BAD_INPUT:
            continue
        raised = _raised_class(site)
        if not (issubclass(raised, errors.ShardkitError) and raised is not errors.ShardkitError):
            wrong.append(f"{site.module}.{site.function}:{site.line} raises {site.error}")
    assert not wrong, "use a subclass from shardkit.core.errors:\n" + "\n".join(wrong)


def test_the_exceptions_that_are_not_bad_input_are_few_and_explained():
    others = {s.error for s in raise_sites()} & set(NOT_BAD_INPUT)
    assert others == set(NOT_BAD_INPUT), f"no longer raised; drop from NOT_BAD_INPUT: {set(NOT_BAD_INPUT) - others}"
    plain_value_errors = [s for s in raise_sites() if s.error == "ValueError"]
    assert [(s.module, s.function) for s in plain_value_errors] == [("core.flags", "_parse_bool")]


def test_every_member_of_the_family_is_raised_somewhere_and_documented():
    raised = {s.error for s in raise_sites()}
    raised |= {base for name, (base, _) in refinements().items() if name in raised}
    for cls in errors.FAMILY:
        assert cls.__name__ in raised, f"{cls.__name__} is never raised: drop it or use it"
        assert len(inspect.getdoc(cls) or "") > 80, f"{cls.__name__} needs a docstring: it is the catalogue"
    for name, (base, doc) in refinements().items():
        assert base in {c.__name__ for c in errors.FAMILY} | {"ShardkitError"} and doc, name


def test_a_family_error_is_still_a_shardkit_error_and_a_value_error():
    import shardkit as sk

    try:
        sk.Layout.parse("data:2")
    except sk.errors.LayoutError as e:
        assert isinstance(e, sk.ShardkitError) and isinstance(e, ValueError)
    else:
        raise AssertionError("a malformed layout was accepted")


def test_docs_errors_md_is_generated_and_current():
    stored = (ROOT / "docs" / "errors.md").read_text()
    assert stored == catalogue(), "regenerate: python -m shardkit.cli.error_sites > docs/errors.md"
