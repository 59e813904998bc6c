"""What a user can get wrong, as one exception type: `k3` exits 2 on ``InputError`` (a flag, file, tensor or config
field, named in the message, found before any compute); anything else that escapes a command is a bug in k3jax and
ends with its traceback and exit 1.

The domain errors subclass it (``ConfigError``, ``CheckpointError``, ``TokenizerError``, ``AblationSpecError``,
``CacheError``), so a library caller may catch either. It is a ValueError, so ``except ValueError`` still works.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input a user can fix; the message names the flag, file, tensor or field (`k3` exits 2)."""


__all__ = ["InputError"]
