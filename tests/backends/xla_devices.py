"""XLA's CPU device count for the JAX processes the tests start (the JAX mesh's and the cross-framework
checks), added to the flags already set (the suite's compile settings, tests/conftest.py) rather than
replacing them. Imports nothing: the checks scripts read it before jax starts."""

import os

__all__ = ["flags_with_devices", "environ_with_devices"]

_COUNT = "--xla_force_host_platform_device_count"


def flags_with_devices(n: int) -> str:
    """This process's ``XLA_FLAGS`` with ``n`` CPU devices (a device count already there replaced)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT)]
    return " ".join([*kept, f"{_COUNT}={n}"])


def environ_with_devices(n: int, **extra: str) -> dict[str, str]:
    """This process's environment for a JAX process with ``n`` CPU devices, ``extra`` beside it."""
    return {**os.environ, "XLA_FLAGS": flags_with_devices(n), "JAX_PLATFORMS": "cpu", **extra}
