"""Every example in the README runs: the Python blocks here, the command lines as a user types them."""

import contextlib
import io
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

README = pathlib.Path("README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
COMMANDS = [c for block in re.findall(r"```bash\n(.*?)```", README, re.S)
            for c in (line.split("#")[0].strip() for line in block.splitlines()) if c]
# Commands these tests do not run here, and where they are run instead.
ELSEWHERE = {
    "make demo": "tests/tools/test_demo.py runs its job (python -m zero demo); CI runs make test itself",
    "make test": "CI runs it (.ci/run)",
    "make test TORCH= VENV_FLAGS=--system-site-packages": "a variant of make test for a torch of one's own",
    "pip install -e '.[dev,jax]'": "what make's set-up runs",
    "torchrun --nproc_per_node=2 -m zero.tools.demo --full": "tests/tools/test_demo.py runs it scaled down",
}


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(textwrap.dedent(code), "README.md", "exec"), {})  # a block in a list item is indented


def test_every_command_line_is_run_here_or_elsewhere(tmp_path):
    zero_lines = [c for c in COMMANDS if c.startswith(".venv/bin/zero ")]
    assert set(COMMANDS) - set(zero_lines) <= set(ELSEWHERE), set(COMMANDS) - set(zero_lines) - set(ELSEWHERE)
    for line in zero_lines:  # in order: later lines read what earlier ones saved
        args = line.removeprefix(".venv/bin/zero ").split()
        if args[0] == "bench":
            args += ["--args", "--presets gpt2 --worlds 2"]  # the same command on a smaller model
        res = subprocess.run([sys.executable, "-m", "zero", *args], capture_output=True, text=True, cwd=tmp_path)
        assert res.returncode == 0, f"{line}: {res.stderr[-1500:]}"
