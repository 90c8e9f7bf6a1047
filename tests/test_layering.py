"""The layering rule of DESIGN.md, checked in fresh interpreters."""

import ast
import pathlib
import subprocess
import sys

import pytest


def loaded(module: str, names: list[str]) -> list[str]:
    code = f"import sys, {module}; print(' '.join(n for n in {names!r} if n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_import_zero_loads_neither_torch_nor_jax_nor_rich():
    assert loaded("zero", ["torch", "jax", "rich", "optree"]) == []


def test_plans_compute_without_torch():
    code = ("import sys, zero; from zero.plans.presets import preset; "
            "p = zero.make_plan(preset('gpt2'), 8); str(p); "
            "assert 'torch' not in sys.modules and 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_functional_loads_no_jax_and_no_backends():
    assert loaded("zero.functional", ["jax", "optax", "zero.backends"]) == []


def test_stepping_plain_params_loads_no_backend():
    """Only sharded params (FSDP2's DTensors) reach a backend, by the name in
    `zero.functional.adapters.executor.EXECUTORS`, and only when such params are given."""
    code = ("import sys, torch, zero.functional as F\n"
            "p = torch.ones(3, requires_grad=True); p.grad = torch.ones(3)\n"
            "F.Optimizer([p], F.adamw(0.1)).step()\n"
            "assert 'zero.backends' not in sys.modules, 'a plain step loaded a backend'\n"
            "opt = F.Optimizer([p], F.adamw(0.1)); opt.state_dict(); opt.load_state_dict(opt.state_dict())\n"
            "assert 'zero.backends' not in sys.modules, 'a plain state dict loaded a backend'\n"
            "from zero.functional.adapters.executor import EXECUTORS\n"
            "assert set(EXECUTORS.values()) == {'zero.backends.fsdp2'}")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_jax_mesh_executor_loads_no_torch():
    assert loaded("zero.backends.jax_mesh", ["torch", "zero.functional"]) == []


def imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports, with whether the import runs at module level.

    ``from a import b`` counts as importing ``a`` and ``a.b`` (``from torch import distributed``).
    """
    out = []

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                out.append((child.module, top))
                out.extend((f"{child.module}.{a.name}", top) for a in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return out


def modules(folder: str) -> list[pathlib.Path]:
    """The modules of one layer; ``""`` is the package root (``zero/__main__.py`` is a program)."""
    return sorted(pathlib.Path("zero", folder).rglob("*.py")) if folder else [pathlib.Path("zero/__init__.py")]


def reaches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# What each part of the package may not import: (anywhere, at module level).
FORBIDDEN = {
    "plans": (("torch.distributed", "zero.functional", "zero.backends", "zero.tools"),
              ("torch", "jax", "optree", "rich")),
    "functional": (("torch.distributed", "zero.backends", "zero.tools"), ("jax", "optax")),
    "backends": (("zero.tools",), ()),
    "backends/jax_mesh": (("torch", "zero.functional", "zero.tools"), ()),  # jax and optax only
    "": (("torch.distributed", "zero.backends", "zero.tools", "torch", "jax"), ()),  # the root package
}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_point_one_way(folder):
    never, not_at_top = FORBIDDEN[folder]
    found = [(str(path), name) for path in modules(folder) for name, top in imports(path)
             if reaches(name, never) or (top and reaches(name, not_at_top))]
    assert found == [], f"imports against the layering (DESIGN.md): {found}"


def test_the_layering_check_sees_every_form_of_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from torch import distributed\nimport torch.distributed.rpc as rpc\n"
                   "def f():\n    import jax\n")
    assert ("torch.distributed", True) in imports(src)
    assert ("torch.distributed.rpc", True) in imports(src)
    assert ("jax", False) in imports(src)


def test_only_backends_and_tools_touch_torch_distributed():
    users = {path.parts[1] for path in pathlib.Path("zero").rglob("*.py")
             if any(reaches(name, ("torch.distributed",)) for name, _ in imports(path))}
    assert users <= {"backends", "tools"}, users


def test_zero_optimizer_resolves_lazily_from_the_root():
    code = ("import sys, zero; assert 'torch' not in sys.modules; cls = zero.ZeroRedundancyOptimizer; "
            "import zero.backends; assert cls is zero.backends.ZeroRedundancyOptimizer")
    subprocess.run([sys.executable, "-c", code], check=True)


# Inside zero.functional, folders point one way too: core (the floor: base, sharding, elementwise, foreach, quantize,
# scalars, and Optax's linear algebra and microbatching, which need nothing of zero)
# <- kernels <- core combinators (update, combine, inject) <- transforms/schedules <- aliases/contrib <- adapters.
# What each may not import (anywhere in the folder, at any level).
FLOOR = ("base", "sharding", "elementwise", "foreach", "quantize", "scalars", "linalg", "microbatching")
COMBINATORS = ("update", "combine", "inject")
ABOVE_CORE = ("transforms", "schedules", "aliases", "contrib", "adapters")
FUNCTIONAL_FORBIDDEN = {
    **{floor: ("kernels", *COMBINATORS, *ABOVE_CORE) for floor in FLOOR},
    "kernels": (*COMBINATORS, *ABOVE_CORE),
    **{core: ABOVE_CORE for core in COMBINATORS},
    "transforms": ("aliases", "contrib", "adapters"),
    "schedules": ("transforms", "aliases", "contrib", "adapters"),
    "aliases": ("contrib", "adapters"),
    "contrib": ("adapters",),
    "adapters": (),  # the top: it may import every folder below (never the package root, as for all)
}


def functional_part(path: pathlib.Path) -> str:
    """``transforms`` for zero/functional/transforms/adam.py, ``base`` for zero/functional/base.py."""
    part = path.relative_to("zero/functional").parts[0]
    return part.removesuffix(".py")


@pytest.mark.parametrize("part", sorted(FUNCTIONAL_FORBIDDEN))
def test_functional_folders_point_one_way(part):
    never = tuple(f"zero.functional.{name}" for name in FUNCTIONAL_FORBIDDEN[part])
    found = [(str(path), name) for path in pathlib.Path("zero/functional").rglob("*.py")
             if functional_part(path) == part for name, _ in imports(path) if reaches(name, never)]
    assert found == [], f"imports against zero.functional's layout (its package docstring): {found}"


def test_every_functional_module_is_placed_in_the_layout():
    parts = {functional_part(p) for p in pathlib.Path("zero/functional").rglob("*.py")} - {"__init__"}
    assert parts == set(FUNCTIONAL_FORBIDDEN), parts ^ set(FUNCTIONAL_FORBIDDEN)


def test_nothing_inside_zero_functional_imports_its_package_root():
    """``import zero.functional`` (or a name from it that is not a submodule) from inside the layer
    reaches up through every folder at once: modules import what they need from where it lives."""
    submodules = {p.stem for p in pathlib.Path("zero/functional").iterdir() if p.name != "__init__.py"}
    root = pathlib.Path("zero/functional/__init__.py")
    found = []
    for path in pathlib.Path("zero/functional").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())) if path != root else ():
            if isinstance(node, ast.Import):
                found += [(str(path), a.name) for a in node.names if a.name == "zero.functional"]
            elif isinstance(node, ast.ImportFrom) and node.module == "zero.functional":
                found += [(str(path), a.name) for a in node.names if a.name not in submodules]
    assert found == [], f"modules that import zero.functional's root: {found}"


def test_every_functional_folder_says_what_goes_in_it():
    folders = [p for p in pathlib.Path("zero/functional").iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert {p.name for p in folders} == {"transforms", "schedules", "aliases", "contrib", "kernels", "adapters",
                                         "sharding"}
    root_doc = ast.get_docstring(ast.parse(pathlib.Path("zero/functional/__init__.py").read_text()))
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{folder} has no package docstring"
        assert f"``{folder.name}/``" in root_doc, f"zero.functional's docstring does not say what {folder.name}/ holds"
    assert not [p for p in pathlib.Path("zero/functional").rglob("*.py") if p.stem.startswith("more_")]


def test_every_dotted_name_the_docs_write_resolves_after_import_zero():
    """`import zero; zero.backends.checkpoint.save(...)` as the README writes it: every
    ``zero.a.b.c`` in the README and the docs resolves from a fresh ``import zero`` alone."""
    import re

    texts = [pathlib.Path("README.md"), *sorted(pathlib.Path("docs").rglob("*.md"))]
    names = sorted({n for t in texts for n in re.findall(r"\bzero(?:\.[A-Za-z_]\w*)+", t.read_text())})
    assert "zero.backends.checkpoint.save" in names and len(names) > 30
    code = ("import functools, sys, zero\nbad = []\n"
            f"for name in {names!r}:\n"
            "    try: functools.reduce(getattr, name.split('.')[1:], zero)\n"
            "    except AttributeError as e: bad.append((name, str(e)))\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_name_that_is_not_there_is_an_attribute_error_naming_it():
    code = ("import zero\ntry: zero.backends.no_such_thing\n"
            "except AttributeError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "module 'zero.backends' has no attribute 'no_such_thing'" in out.stdout


def test_the_plans_import_each_other_without_a_circle():
    # the plan is a value: what executes it (footprint, holdings, a mesh's padding) reads its fields
    # (plan_fields), and the plan's table may then show what they say, with no way back
    names = {f"zero.plans.{p.stem}": p for p in pathlib.Path("zero/plans").glob("*.py") if p.stem != "__init__"}
    # every import counts: module level, inside functions, under TYPE_CHECKING
    graph = {name: {m for m, _ in imports(path) if m in names} for name, path in names.items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError(f"an import circle in zero.plans: {' -> '.join(path[path.index(name):] + [name])}")
        if name not in done:
            path.append(name)
            for other in sorted(graph[name]):
                visit(other)
            path.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_modes_stay_small():
    """A mode answers a few questions and its `Gradients` the gradients' ones (DESIGN.md): no class
    in ``zero/backends/modes`` over 12 methods, no module over 300 lines."""
    for path in sorted(pathlib.Path("zero/backends/modes").glob("*.py")):
        assert len(path.read_text().splitlines()) <= 300, path
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                methods = [m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
                assert len(methods) <= 12, f"{path}: {node.name} has {len(methods)} methods: {methods}"
