"""`zero.backends.at_exit`: a gloo default group a script leaves up is destroyed at a clean exit
(gloo's workers would otherwise outlive the interpreter and can abort the process), and left as
it is after an uncaught exception (collectives may be in flight)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch, torch.distributed as dist
    from zero.tools.launch import free_port

    # registered before zero's: it runs after it, and reports what zero left
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group({backend!r}, rank=0, world_size=1)
    import zero
    model = torch.nn.Linear(4, 3)
    opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    if {fail!r}:
        raise RuntimeError("the script's own error")
""")


@pytest.mark.parametrize("fail, left_up", [(False, False), (True, True)])
def test_a_gloo_group_left_up_is_destroyed_at_a_clean_exit_only(fail, left_up):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(backend="gloo", fail=fail)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == (1 if fail else 0), out.stderr[-2000:]
    assert f"initialized at exit: {left_up}" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert ("the script's own error" in out.stderr) == fail
