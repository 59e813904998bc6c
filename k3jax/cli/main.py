"""`k3` — the k3jax command line.

    k3 run                               the shipped k3-mini: held-out loss + routing summary (the main job)
    k3 plan  --preset kimi-k3 --json     parameters / bytes / per-device memory, without allocating anything
    k3 bench NAME --json                 benchmarks (k3 bench --list)
    k3 route --ckpt DIR --text F --json  routing analysis: loads, co-activation, specialization, drift
    k3 ablate FILE.toml --out DIR        one-factor ablations over paired seeds, with an A/A noise floor
    k3 generate --prompt TEXT            sample with the hybrid KDA-state + MLA-latent cache

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser sets ``func``.
Every parser is a ``K3ArgumentParser``: no abbreviated flags, and an unrecognized flag's error says what was likely
meant. A closed stdout (``k3 plan --tensors | head``) ends any command quietly with exit 0. On a CPU-only machine a
one-process ``--mesh`` (or ``--devices N``) that asks for more devices than exist starts that many simulated CPU
devices (``simulated_cpu_devices``), said in one line on stderr.
Exit status (docs/cli.md): 0 success; 1 the work ran and a check failed — or k3jax itself failed, which ends
with the traceback; 2 bad input (``k3jax.errors.InputError``: a flag, file, tensor or field, named in the message,
found before any compute). Only validated input errors exit 2: a ValueError from inside jax or k3jax is a bug, not
a message to the user.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import importlib
import importlib.util
import math
import os
import select
import sys
import warnings

from k3jax.errors import InputError

# This module imports no jax, nor any k3jax module that may: JAX_PLATFORMS must be set (``jax_platforms_override``)
# and the simulated CPU devices chosen (``start_simulated_cpu_devices``) before jax starts, and tests/conftest.py
# imports it before jax; so jax, the config and the mesh parser are imported inside the functions that use them.

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
    "tokenize": "k3jax.cli.tokenize",
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


# Device files of the accelerators JAX would pick over the CPU: TPU (accel, vfio), NVIDIA GPU, AMD GPU.
ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia0", "/dev/kfd")
# Set in a jax.distributed job, or by a launcher that starts several processes.
_MULTIPROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_WORLD_SIZE_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE")


def devices_asked(args) -> tuple[str, int] | None:
    """(the flag as given, the devices it asks for) of a command's ``--mesh AXIS=N,...`` (the product of its sizes,
    read by ``sharding.placement.parse_mesh``) or ``--devices N``; None without them, for a malformed mesh (the
    command reports it) and for ``k3 plan`` (its ``--target cpu:N`` starts its own devices)."""
    mesh = getattr(args, "mesh", None)
    if isinstance(mesh, str):
        from k3jax.sharding.placement import parse_mesh  # imports jax: kept out of module level (see above)

        try:
            return f"--mesh {mesh}", math.prod(parse_mesh(mesh).values())
        except InputError:
            return None
    n = getattr(args, "devices", None)
    return (f"--devices {n}", n) if isinstance(n, int) and not isinstance(n, bool) else None


def simulated_cpu_devices(wanted: int, environ, has_device, processes: int = 1) -> int | None:
    """How many simulated CPU devices to start before jax's backend does: ``wanted`` (what ``--mesh`` or
    ``--devices`` asks for) when it is more than one and JAX will run on the CPU — JAX_PLATFORMS=cpu (set by
    ``jax_platforms_override`` where libtpu is installed without a TPU), or JAX_PLATFORMS unset and no accelerator
    device file (``has_device(pattern)``, as there) — in one process (no jax.distributed or multi-process launcher
    variables), with the CPU device count not already chosen (XLA_FLAGS' --xla_force_host_platform_device_count,
    JAX_NUM_CPU_DEVICES); else None, and a mesh larger than the devices is the command's error. A job of
    ``processes`` CPU processes (``k3jax.distributed``) starts ``wanted / processes`` in each, when that divides."""
    if processes > 1:
        wanted, rest = divmod(wanted, processes)
        if rest:
            return None
    if wanted <= 1 and processes == 1:
        return None
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        if {p.strip() for p in platforms.split(",")} != {"cpu"}:
            return None
    elif any(has_device(pattern) for pattern in ACCELERATOR_FILES):
        return None
    if "xla_force_host_platform_device_count" in environ.get("XLA_FLAGS", "") or environ.get("JAX_NUM_CPU_DEVICES"):
        return None
    if processes == 1 and any(k in environ for k in _MULTIPROCESS_ENV):
        return None
    if processes == 1 and any(int(v) > 1 for k in _WORLD_SIZE_ENV if (v := environ.get(k, "").strip()).isdigit()):
        return None
    return wanted


def start_simulated_cpu_devices(n: int) -> bool:
    """Give XLA:CPU ``n`` devices (``jax_num_cpu_devices``); False when jax's backend has already started (a `k3`
    command called in-process after other jax work), which fixes the count."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # "should be updated before backends are initialized"
        return False
    return True


# Flags a user reaches for that a subcommand spells otherwise: (command, flag) -> what to write instead.
FLAG_HINTS = {
    ("train", "--ckpt"): "k3 train reads a checkpoint with --init DIR; its own run directory is --ckpt-dir DIR",
    ("train", "--checkpoint"): "k3 train reads a checkpoint with --init DIR; its own run directory is --ckpt-dir DIR",
    ("export", "--ckpt"): "k3 export reads a checkpoint with --from DIR",
}


class K3ArgumentParser(argparse.ArgumentParser):
    """The parser of `k3` and of each subcommand (``add_subparsers`` makes its parsers of this class): flags are
    never abbreviated (``--metric`` is not ``--metrics``), and an unrecognized flag is reported by its subcommand's
    parser with a hint: a known confusion's (``FLAG_HINTS``) or the nearest flag's name."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(ns, "command", None)
            sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
            parser = sub.choices.get(command, self) if sub is not None else self
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser._hint(command, extras)}")
        return ns

    def error(self, message):
        """argparse's error (exit 2), with a usage of more than 3 lines (`k3 train`'s is 20) cut to a pointer to
        --help, so that the message is not buried."""
        usage = self.format_usage()
        if usage.count("\n") > 3:
            usage = f"usage: {self.prog} [flags] ({self.prog} --help lists them)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")

    def _hint(self, command, extras) -> str:
        known = [o for a in self._actions for o in a.option_strings]
        hints = []
        for arg in extras:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--"):
                continue
            if (command, flag) in FLAG_HINTS:
                hints.append(FLAG_HINTS[command, flag])
            elif close := difflib.get_close_matches(flag, known, n=1, cutoff=0.75):
                hints.append(f"{flag}: did you mean {close[0]}?")
        return f" ({'; '.join(hints)})" if hints else ""


def build_parser() -> argparse.ArgumentParser:
    p = K3ArgumentParser(prog="k3", description="k3jax: Kimi K3 in JAX")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="one of these (k3 COMMAND --help: its flags)")
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
    from k3jax.config import UnknownConfigKeysWarning  # no k3jax import at module level (see above)

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UnknownConfigKeysWarning):
            print(f"k3 {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return default


def _stdout_gone() -> bool:
    """True when stdout is a pipe whose reader has gone (`k3 plan --tensors | head`), or when that cannot be told."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def main(argv=None) -> int:
    platforms = jax_platforms_override(os.environ, lambda pattern: bool(glob.glob(pattern)),
                                       importlib.util.find_spec("libtpu") is not None)
    if platforms is not None:
        os.environ["JAX_PLATFORMS"] = platforms  # before anything below imports jax
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's own flush at exit
        return rc
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe broke: a bug, with its traceback
            raise
        # the reader of stdout has what it wanted: end quietly, with stdout on devnull so that the interpreter's
        # flush at exit does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _main(argv) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a parse error naming its flag (2), already printed
        return int(e.code or 0)
    from k3jax.distributed import Launch  # jax-free until start() (see above)

    has_device = lambda pattern: bool(glob.glob(pattern))  # noqa: E731
    launch = Launch.from_args(args)
    asked = devices_asked(args)
    if asked is not None:
        procs = launch.processes(os.environ) or 1
        n = simulated_cpu_devices(asked[1], os.environ, has_device, procs)
        if n is not None and start_simulated_cpu_devices(n):  # before anything the command runs starts jax
            each = f" in each of {procs} processes" if procs > 1 else ""
            print(f"k3 {args.command}: {asked[0]} needs {asked[1]} devices and JAX runs on this machine's CPU: "
                  f"starting {n} simulated CPU devices{each}", file=sys.stderr)
    previous = _warnings_as_messages(args.command)
    started = None
    try:
        started = _start_processes(args, launch, has_device)
        rc = args.func(args)
    except InputError as e:  # bad input: exit 2 naming the field/file/tensor (anything else: traceback, exit 1)
        print(f"k3 {args.command}: {_process_prefix(started)}error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:
        if started and not isinstance(e, BrokenPipeError):  # the traceback that follows: whose it is
            print(f"k3 {args.command}: {_process_prefix(started)}failed:", file=sys.stderr)
        raise
    finally:
        warnings.showwarning = previous
    if started:
        from k3jax.distributed import shutdown

        shutdown()
    return int(rc or 0)


def _start_processes(args, launch, has_device) -> str | None:
    """This command as one process of a jax.distributed job, when its parser has the flags
    (``k3jax.cli.args.add_distributed``) and the flags or the environment name a job (``k3jax.distributed.start``)."""
    if not hasattr(args, "num_processes"):
        return None
    from k3jax.distributed import is_main, start

    how = start(launch, environ=os.environ, has_device=has_device)
    if how:  # one process speaks for the job on stdout; every one keeps stderr for its errors
        sys.stdout.flush()
        if is_main():
            # what native code prints on file descriptor 1 (gloo's connection lines) goes to stderr, so that stdout
            # holds the command's own output only (`--json`: one object); Python's stdout keeps the real one
            keep = os.dup(sys.stdout.fileno())
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
            sys.stdout = os.fdopen(keep, "w", buffering=1)
        else:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
    return how


def _process_prefix(started) -> str:
    if not started:
        return ""
    from k3jax.distributed import prefix

    return prefix()


if __name__ == "__main__":
    sys.exit(main())
