"""The examples in the library's docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["zero.functional.kernels.chains",
           "zero.functional.aliases.sgd", "zero.functional.aliases.adam", "zero.functional.aliases.rms",
           "zero.functional.aliases.sign", "zero.functional.aliases.layerwise", "zero.functional.aliases.factored",
           "zero.functional.contrib._muon"]


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


def _code(path: str) -> list[str]:
    import nbformat

    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path("notebooks").glob("*.ipynb")), ids=str)
def test_every_curve_a_notebook_draws_has_labelled_axes(path):
    for source in _code(path):
        if "plt.plot(" in source:
            assert "plt.xlabel(" in source and "plt.ylabel(" in source, f"unlabelled axes in:\n{source}"


def test_zero_in_practice_shows_its_training_loop():
    code = "\n".join(_code("notebooks/zero_in_practice.ipynb"))
    assert "zero.tools.demo" not in code and "import demo" not in code, "the loop lives in the notebook"
    assert "def train(" in code and ".backward()" in code and "opt.step()" in code


def test_a_rich_table_printed_in_a_notebook_shows_once(tmp_path):
    """`render` returns the table's text; in Jupyter rich would also display it as HTML on its own."""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import zero\n"
                                          "metas = zero.param_metas({'a': (4,), 'b': (6,)})\n"
                                          "print(zero.diff_plans(zero.make_plan(metas, 2), zero.make_plan(metas, 3)))")]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert [o.output_type for o in outputs] == ["stream"], outputs
    assert outputs[0].text.count("per-rank change") == 1
