"""Checkpoint errors. Every message names the file and, where there is one, the tensor."""

from __future__ import annotations

from k3jax.errors import InputError


class CheckpointError(InputError):
    """A malformed, inconsistent or unsafe checkpoint (a ValueError, so `k3` exits with status 2)."""

    def __init__(self, msg: str, *, file: str | None = None, tensor: str | None = None):
        where = ": ".join(x for x in (file, f"tensor {tensor!r}" if tensor else None) if x)
        super().__init__(f"{where}: {msg}" if where else msg)
        self.file = file
        self.tensor = tensor


__all__ = ["CheckpointError"]
