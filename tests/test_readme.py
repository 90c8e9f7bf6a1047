"""Every example in the README and on the documentation site's pages runs: the Python blocks here,
the command lines as a user types them (a page's lines in order, in one fresh process, through the
``zero`` entry point); and the site builds with ``mkdocs build --strict``."""

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

PAGES = [pathlib.Path("README.md"), *sorted(pathlib.Path("docs").glob("*.md"))]


def blocks(page: pathlib.Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), re.S)


def commands(page: pathlib.Path) -> list[str]:
    return [c for block in blocks(page, "bash") for c in (line.split("#")[0].strip() for line in block.splitlines())
            if c]


EXAMPLES = [(page, i, code) for page in PAGES for i, code in enumerate(blocks(page, "python"))]
# Commands these tests do not run here, and where they are run instead.
ELSEWHERE = {
    "make demo": "tests/tools/test_demo.py runs its job (python -m zero demo); CI runs make test itself",
    "make test": "CI runs it (.ci/run)",
    "make docs": "test_the_site_builds_strict below runs its command",
    "make test TORCH= VENV_FLAGS=--system-site-packages": "a variant of make test for a torch of one's own",
    "pip install -e '.[dev,jax]'": "what make's set-up runs",
    "pip install --no-deps torchao==0.18.0 torchtitan==0.3.0 gram-newton-schulz==0.1.6":
        "what make's set-up runs ($(TORCHAO) $(TORCHTITAN) $(GRAMNS))",
    "torchrun --nproc_per_node=2 -m zero.tools.demo --full": "tests/tools/test_demo.py runs it scaled down",
}


def test_the_pages_have_examples():
    assert len(EXAMPLES) >= 13 and all(page.exists() for page in PAGES) and len(PAGES) >= 14


@pytest.mark.parametrize("page, i, code", EXAMPLES, ids=[f"{page.stem}-{i}" for page, i, _ in EXAMPLES])
def test_example_runs(page, i, code):
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(textwrap.dedent(code), str(page), "exec"), {})  # a block in a list item is indented


def _command_pages() -> list:
    """The pages with commands; at-scale's on test_simulate's worker, where the rank it simulates
    has been simulated already (the session's ZERO_SIMULATE_CACHE; tests/conftest.py)."""
    return [pytest.param(p, id=p.stem, marks=[pytest.mark.xdist_group("simulate")] if p.stem == "at-scale" else [])
            for p in PAGES if commands(p)]


@pytest.mark.parametrize("page", _command_pages())
def test_every_command_line_is_run_here_or_elsewhere(page, tmp_path):
    lines = commands(page)
    zero_lines = [c for c in lines if c.startswith(".venv/bin/zero ")]
    assert set(lines) - set(zero_lines) <= set(ELSEWHERE), set(lines) - set(zero_lines) - set(ELSEWHERE)
    argvs = []
    for line in zero_lines:  # in order: later lines read what earlier ones saved
        args = line.removeprefix(".venv/bin/zero ").split()
        if args[0] == "bench":
            args += ["--args", "--presets gpt2 --worlds 2 --metas gpt2"]  # the same command on a smaller model
        argvs.append(args)
    res = subprocess.run([sys.executable, "-c", RUN_LINES, json.dumps(argvs)], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


# A page's command lines, in one fresh process, through the entry point ``zero`` runs (`python -m
# zero` is ``sys.exit(main())``): each as its own process would import torch, zero and a fork
# server for its ranks again, 3-4 s of CPU a line for nothing the line tests.
RUN_LINES = """
import json, sys
from zero.tools.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    if code not in (0, None):
        sys.exit(f"zero {' '.join(argv)}: exit status {code}")
"""


def test_every_cli_subcommand_is_on_the_cli_page():
    from zero.tools.cli import subcommands

    page = pathlib.Path("docs/cli.md").read_text()
    assert len(subcommands()) >= 5 and [c for c in subcommands() if f"`zero {c}" not in page] == []


@pytest.mark.timeout(300)
def test_the_site_builds_strict(tmp_path):
    """``make docs``: every page, the API reference from the docstrings and the notebooks, with
    no warning (broken links between pages, docstrings that do not parse, missing files)."""
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "functional" / "index.html").read_text().count('id="zero.functional.') > 100


def test_the_optax_name_table_lists_every_public_name_and_real_optax_names():
    optax = pytest.importorskip("optax")
    import zero.functional as F

    table = pathlib.Path("docs/optax-names.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M)
    assert sorted(n for n, _ in listed) == sorted(F.__all__)
    for _, theirs in listed:
        if theirs.startswith("`optax."):
            module, attr = theirs.strip("` ").rsplit(".", 1)
            assert hasattr(optax.contrib if module == "optax.contrib" else optax, attr), theirs
