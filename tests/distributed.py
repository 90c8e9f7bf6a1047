"""The tests start ranks with the library's own launcher (`zero.tools.launch.run`)."""

from zero.tools.launch import free_port
from zero.tools.launch import run as run_ranks

__all__ = ["run_ranks", "free_port"]
