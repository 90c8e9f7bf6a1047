"""`zero.tools.notebook`: the size a notebook runs at, read from ``ZERO_NOTEBOOK_SIZE``."""

import pytest

from zero.tools.notebook import by_size, size


def test_unset_is_full_and_small_is_small(monkeypatch):
    monkeypatch.delenv("ZERO_NOTEBOOK_SIZE", raising=False)
    assert size() == "full" and by_size(full=150, small=60) == 150
    monkeypatch.setenv("ZERO_NOTEBOOK_SIZE", "small")
    assert size() == "small" and by_size(full=150, small=60) == 60


def test_the_suite_runs_the_notebooks_small():
    import os

    assert os.environ["ZERO_NOTEBOOK_SIZE"] == "small", "tests/conftest.py sets it for the notebooks' kernels"


def test_a_misspelt_size_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ZERO_NOTEBOOK_SIZE", "smal")
    with pytest.raises(ValueError, match=r"ZERO_NOTEBOOK_SIZE must be one of \('full', 'small'\), got 'smal'"):
        by_size(full=1, small=2)
