"""Command-line arguments that are read before torch loads: a usage error answers at once."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "demo_parser"]


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, or a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def demo_parser() -> argparse.ArgumentParser:
    """``zero demo``'s arguments (`zero.tools.demo`)."""
    p = argparse.ArgumentParser(prog="zero demo", description="The ZeRO tutorial, runnable anywhere: DDP on N ranks, "
                                "once with ZeRO and once with plain Adam.")
    p.add_argument("-w", "--world-size", type=positive_int, default=2)
    p.add_argument("--layers", type=positive_int, default=8, help="Linear layers (tutorial: 20)")
    p.add_argument("--width", type=positive_int, default=1000, help="features per layer (tutorial: 2000)")
    p.add_argument("--full", action="store_true", help="the tutorial's size: 20 x Linear(2000, 2000)")
    p.add_argument("--steps", type=positive_int, default=3)
    return p
