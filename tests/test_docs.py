"""The examples in the library's docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["zero.functional.alias"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
