"""`k3` — the k3jax command line.

    k3 run                               the shipped k3-mini: held-out loss + routing summary (the main job)
    k3 plan  --preset kimi-k3 --json     parameters / bytes / per-device memory, without allocating anything
    k3 bench NAME --json                 benchmarks (k3 bench --list)
    k3 route --ckpt DIR --text F --json  routing analysis: loads, co-activation, specialization, drift
    k3 ablate FILE.toml --out DIR        one-factor ablations over paired seeds, with an A/A noise floor
    k3 generate --prompt TEXT            sample with the hybrid KDA-state + MLA-latent cache

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser sets ``func``.
Exit status (../shared/CLI.md): 0 success; 1 the work ran and a check failed — or k3jax itself failed, which ends
with the traceback; 2 bad input (``k3jax.errors.InputError``: a flag, file, tensor or field, named in the message,
found before any compute). Only validated input errors exit 2: a ValueError from inside jax or k3jax is a bug, not
a message to the user.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import os
import sys

# subcommand -> module (imported lazily so `k3 --help` stays fast and one broken module does not hide the rest)
SUBCOMMANDS = {
    "run": "k3jax.cli.run",
    "plan": "k3jax.cli.plan",
    "bench": "k3jax.cli.bench",
    "inspect": "k3jax.cli.inspect",
    "logits": "k3jax.cli.logits",
    "export": "k3jax.cli.export",
    "train": "k3jax.cli.train",
    "ablate": "k3jax.cli.ablate",
    "route": "k3jax.cli.route",
    "generate": "k3jax.cli.generate",
}


def jax_platforms_override(environ, has_device, libtpu_installed: bool) -> str | None:
    """The JAX_PLATFORMS value to set before jax starts, or None to leave the environment alone.

    libtpu (the dev extra) lets one process at a time use it (/tmp/libtpu_lockfile), and a JAX process allowed to
    try the TPU backend takes that lock for its lifetime even when it falls back to the CPU, so on a machine without
    a TPU a second `k3` (or a test worker) would fail with "Internal error when accessing libtpu". So: "cpu" when
    JAX_PLATFORMS is unset, libtpu is installed and there is no TPU (no /dev/accel*, no /dev/vfio/<n>) and no NVIDIA
    GPU (/dev/nvidia0: left alone, so JAX picks the GPU as usual). ``has_device(pattern)`` says whether a device
    file matching the glob pattern exists.
    """
    if "JAX_PLATFORMS" in environ or not libtpu_installed:
        return None
    if has_device("/dev/accel*") or has_device("/dev/vfio/[0-9]*") or has_device("/dev/nvidia0"):
        return None
    return "cpu"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="k3jax: Kimi K3 in JAX")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in SUBCOMMANDS.values():
        try:
            importlib.import_module(mod).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return p


def _warnings_as_messages(command: str):
    """Print k3jax's own warnings (e.g. unknown config keys) as one ``k3 CMD: warning: ...`` line on stderr,
    instead of Python's ``file:line: Category: ...`` plus the source line; other warnings keep the default."""
    import warnings

    from k3jax.hf_config import UnknownConfigKeysWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UnknownConfigKeysWarning):
            print(f"k3 {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return default


def main(argv=None) -> int:
    platforms = jax_platforms_override(os.environ, lambda pattern: bool(glob.glob(pattern)),
                                       importlib.util.find_spec("libtpu") is not None)
    if platforms is not None:
        os.environ["JAX_PLATFORMS"] = platforms  # before anything below imports jax
    from k3jax.errors import InputError

    parser = build_parser()
    args = parser.parse_args(argv)
    import warnings

    previous = _warnings_as_messages(args.command)
    try:
        rc = args.func(args)
    except InputError as e:  # bad input: exit 2 naming the field/file/tensor (anything else: traceback, exit 1)
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = previous
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
