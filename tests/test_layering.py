"""The layering rule of DESIGN.md, checked in fresh interpreters."""

import subprocess
import sys


def loaded(module: str, names: list[str]) -> list[str]:
    code = f"import sys, {module}; print(' '.join(n for n in {names!r} if n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_import_zero_loads_neither_torch_nor_jax_nor_rich():
    assert loaded("zero", ["torch", "jax", "rich", "optree"]) == []


def test_plans_compute_without_torch():
    code = ("import sys, zero; from zero.presets import preset; "
            "p = zero.make_plan(preset('gpt2'), 8); str(p); "
            "assert 'torch' not in sys.modules and 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)



def test_functional_loads_no_jax_and_no_backends():
    assert loaded("zero.functional", ["jax", "optax", "zero.backends"]) == []


def test_functional_does_not_import_torch_distributed_itself():
    import pathlib

    for path in pathlib.Path("zero/functional").glob("*.py"):
        text = path.read_text()
        assert "torch.distributed" not in text, f"{path} reaches into torch.distributed"
    for path in pathlib.Path("zero").glob("*.py"):
        assert "import torch" not in path.read_text().replace("    import torch", ""), \
            f"{path}: the plan layer imports torch only inside adapters"


def test_only_backends_touch_torch_distributed():
    import pathlib

    for path in pathlib.Path("zero").rglob("*.py"):
        if "backends" not in path.parts:
            assert "torch.distributed" not in path.read_text(), f"{path} reaches into torch.distributed"


def test_zero_optimizer_resolves_lazily_from_the_root():
    code = ("import sys, zero; assert 'torch' not in sys.modules; cls = zero.ZeroRedundancyOptimizer; "
            "import zero.backends; assert cls is zero.backends.ZeroRedundancyOptimizer")
    subprocess.run([sys.executable, "-c", code], check=True)
