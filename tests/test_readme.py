"""Every Python example in the README runs."""

import contextlib
import io
import pathlib
import re

import pytest

BLOCKS = re.findall(r"```python\n(.*?)```", pathlib.Path("README.md").read_text(), re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "README.md", "exec"), {})
