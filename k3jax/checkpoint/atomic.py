"""Output directories written whole or not at all: every checkpoint, adapter and export directory k3jax writes is
filled in a temporary sibling and renamed into place only when complete, so a failed or interrupted write never
leaves a half-written directory, and never destroys the one that was there.

    check_out_dir("out/", overwrite=False, flag="--export")   # before any compute: InputError naming flag and dir
    with staged_dir("out/", overwrite=False) as tmp:          # tmp: an empty sibling of out/
        write files into tmp                                  # an exception: tmp removed, out/ untouched
    # on leaving the block: out/ is tmp, a previous out/ removed only once the new one is in place

In a multi-process (``jax.distributed``) save every process writes into one shared sibling
(``sibling(out_dir, "dist")``, given as ``tmp=``) and process 0 alone enters ``staged_dir`` to rename it.

Single files (a JSON record, a figure, a token array) take the same path through ``staged_file``:

    with staged_file("runs/x/result.json") as tmp:            # tmp: a file name beside it, not yet created
        write tmp                                             # an exception: tmp removed, the old file untouched
    # on leaving the block: tmp is renamed over runs/x/result.json (one atomic os.replace)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator

from k3jax.errors import InputError


def check_out_dir(out_dir, *, overwrite: bool, flag: str | None = None, hint: str = "pass overwrite=True") -> str:
    """The absolute path of ``out_dir`` once it may be written: it does not exist, is an empty directory, or is a
    directory and ``overwrite``. Otherwise an ``InputError`` naming ``flag`` (the option that gave the directory,
    e.g. "--export"), the directory and ``hint`` (how to allow replacing it, e.g. "pass --overwrite")."""
    path = os.path.abspath(os.fspath(out_dir))
    where = f"{flag} {out_dir}" if flag else str(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{where}: exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise InputError(f"{where}: exists and is not empty ({hint} to replace it)")
    return path


def sibling(out_dir: str, tag: str) -> str:
    """The fixed temporary sibling ``.<name>.tmp-<tag>`` of ``out_dir`` (a name every process can compute)."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    return os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.tmp-{tag}")


@contextlib.contextmanager
def staged_dir(out_dir, *, overwrite: bool = False, flag: str | None = None, hint: str = "pass overwrite=True",
               tmp: str | None = None) -> Iterator[str]:
    """Yield a temporary sibling directory of ``out_dir`` (created here, or ``tmp``, already made by the caller);
    when the block ends normally it is renamed to ``out_dir`` (``move_into_place``), when it raises it is removed
    and ``out_dir`` is left as it was. ``out_dir`` is checked first (``check_out_dir``)."""
    out_dir = check_out_dir(out_dir, overwrite=overwrite, flag=flag, hint=hint)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    if tmp is None:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
        move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged_file(path, *, suffix: str = "") -> Iterator[str]:
    """Yield a temporary file name beside ``path`` (same directory, so the rename is atomic; ``suffix`` for writers
    that append their own extension, e.g. ``np.save``'s ".npy"); when the block ends normally the file written there
    replaces ``path`` (``os.replace``), when it raises the temporary file is removed and ``path`` is left as it was.
    The parent directory is created if missing."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # host, pid and a random tag: writers on several machines sharing a filesystem never pick the same name
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}{suffix}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def move_into_place(tmp: str, out_dir: str) -> None:
    """Rename the finished directory ``tmp`` (a sibling of ``out_dir``) to ``out_dir``; an existing ``out_dir`` is
    moved aside first and removed only once the new one is in place."""
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(tmp))
        os.rename(out_dir, os.path.join(old, "d"))
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            os.rename(os.path.join(old, "d"), out_dir)  # put the old directory back
            shutil.rmtree(old, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


__all__ = ["check_out_dir", "move_into_place", "sibling", "staged_dir", "staged_file"]
