"""The examples in the library's docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["zero.functional.aliases.sgd", "zero.functional.aliases.adam", "zero.functional.aliases.rms",
           "zero.functional.aliases.sign", "zero.functional.aliases.layerwise", "zero.functional.aliases.factored"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path("notebooks").glob("*.ipynb")), ids=str)
def test_notebooks_are_committed_without_outputs_and_draw_a_figure(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip the outputs before committing"
    assert any("plt." in c.source or ".plot(" in c.source for c in code), "each notebook makes a figure"
