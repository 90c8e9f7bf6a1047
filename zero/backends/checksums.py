"""The hash every checkpoint format of zero writes beside its pieces, and the note for one without.

XXH3-64 (``xxhash``): 14 GB/s a core here, so verifying costs a fraction of the read it guards.
Neither torch nor jax is imported here: DCP's writer (`zero.backends.checkpoint.integrity`) and
the Orbax checkpoints (`zero.backends.orbax_format`) share it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import xxhash

__all__ = ["ALGORITHM", "digest", "Digest", "UnverifiedCheckpointWarning", "warn_unverified"]

ALGORITHM = "xxh3_64"
Digest = xxhash.xxh3_64  # incremental: ``Digest()``, ``.update(bytes)``, ``.hexdigest()``


def digest(data: Any) -> str:
    """The hex hash of a bytes-like object (a contiguous numpy array too)."""
    return xxhash.xxh3_64_hexdigest(data)


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without zero's checksums was loaded: its bytes could not be verified."""


def warn_unverified(path: str | os.PathLike, made_by: str) -> None:
    warnings.warn(f"the checkpoint at {os.fspath(path)!r} has no checksums ({made_by}): it loads, but its bytes "
                  "cannot be verified", UnverifiedCheckpointWarning, stacklevel=3)
