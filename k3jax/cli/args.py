"""The flags several `k3` commands share, declared once (docs/cli.md §1): where the model comes from (``--ckpt DIR``
or ``--preset NAME``: ``add_model_source``; a checkpoint as ``DIR`` or ``--ckpt DIR``: ``add_checkpoint_dir``), with
``checkpoint_arg`` and ``preset_arg`` checking the value when the command line is parsed (exit 2 naming the flag);
``--strict-config`` (``add_strict_config``); a forward-only command's ``--mesh data=N,context=M``
(``parse_mesh_arg``); the process group of a command that runs the model on a mesh (``add_distributed``: started by
``k3jax.cli.main`` through ``k3jax.distributed``). Loading what the flags name is library code:
``k3jax/checkpoint/source.py``."""

from __future__ import annotations

import argparse
import os

import jax

from k3jax.checkpoint.source import checkpoint_error
from k3jax.config import KERNELS, PRESETS, ConfigError, get_preset, with_kernels
from k3jax.distributed import INIT_TIMEOUT_S
from k3jax.errors import InputError
from k3jax.layers.backends import kernel_target
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.placement import resolve_mesh


def checkpoint_arg(path: str) -> str:
    """argparse ``type`` of every flag that names a checkpoint directory to read (``--ckpt``, ``--init``,
    ``--from``, ``--compare``, a positional DIR): a missing one is a parse error naming the flag (exit 2)."""
    if (msg := checkpoint_error(path)) is not None:
        raise argparse.ArgumentTypeError(msg)
    return path


def preset_arg(name: str) -> str:
    """argparse ``type`` of every ``--preset``: a name of the preset table (``k3jax.config.PRESETS``)."""
    try:
        get_preset(name)
    except ConfigError as e:  # "unknown preset ...; known presets: ...", the table's own wording
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def preset_help(text: str) -> str:
    """A ``--preset`` flag's help: ``text`` and the preset table's names."""
    return f"{text}; one of {', '.join(PRESETS)}"


def add_model_source(parser, preset_text: str):
    """``--ckpt DIR`` or ``--preset NAME`` (one of them; neither: the shipped k3-mini) of a command that runs a
    model; ``preset_text`` is the --preset help's opening. Returns the mutually exclusive group."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--ckpt", type=checkpoint_arg, metavar="DIR",
                     help="checkpoint directory (HF layout; default: the shipped k3-mini)")
    src.add_argument("--preset", type=preset_arg, metavar="NAME", help=preset_help(preset_text))
    return src


def add_checkpoint_dir(parser, what: str) -> None:
    """A checkpoint to read given as the positional ``DIR`` or as ``--ckpt DIR`` (``checkpoint_dir`` takes the one
    given); ``what`` is DIR's help."""
    parser.add_argument("dir", nargs="?", type=checkpoint_arg, metavar="DIR", help=what)
    parser.add_argument("--ckpt", default=None, type=checkpoint_arg, metavar="DIR",
                        help="checkpoint directory (same as the positional DIR)")


def checkpoint_dir(args) -> str:
    """The checkpoint directory from the positional DIR or ``--ckpt`` (exactly one of them)."""
    if args.dir and args.ckpt and os.path.abspath(args.dir) != os.path.abspath(args.ckpt):
        raise InputError(f"give the checkpoint once: DIR {args.dir!r} and --ckpt {args.ckpt!r} differ")
    d = args.dir or args.ckpt
    if not d:
        raise InputError("give a checkpoint directory (DIR or --ckpt DIR)")
    return d


def add_strict_config(parser, of: str = "the checkpoint") -> None:
    """``--strict-config``: unknown keys in ``of``'s config.json are errors, not warnings (``config.from_hf``)."""
    parser.add_argument("--strict-config", action="store_true", help=f"unknown keys in {of}'s config.json are errors")


def add_distributed(parser) -> None:
    """``--coordinator HOST:PORT --num-processes N --process-id I`` (all three or none) and
    ``--distributed-timeout S``: this command as one process of a ``jax.distributed`` job (``k3jax.distributed``;
    without them, a cluster the environment names is detected by JAX, else one process)."""
    g = parser.add_argument_group("many processes (jax.distributed; README: Many hosts)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address and a free port, the same in "
                   "every process (default: the cluster's, detected by JAX on a TPU slice, SLURM or Open MPI)")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 <= I < N")
    g.add_argument("--distributed-timeout", type=int, metavar="S", default=None,
                   help=f"seconds to wait for every process to join (default {INIT_TIMEOUT_S})")


KERNELS_HELP = ("which kernels run: auto (default) = the Pallas kernels on a GPU or TPU wherever one runs for this "
                "command (KDA chunks, KDA's decode step on TPU, MLA latent attention, packed MXFP4 experts), XLA "
                "elsewhere and on a CPU; xla = "
                "every op's XLA path; pallas = every kernel, in Pallas' interpreter on a CPU (slow: for checking the "
                "kernels against the XLA paths), exit 2 naming a kernel that cannot run. A per-op flag ({ops}) wins "
                "over it for its op")


def add_kernels(parser, ops: str = "none here") -> None:
    """``--kernels {auto,xla,pallas}`` (``config.with_kernels``); ``ops``: the per-op flags of this command that
    override it, for the help."""
    parser.add_argument("--kernels", choices=KERNELS, default="auto", help=KERNELS_HELP.format(ops=ops))


def kernel_run(args, run, mesh=None, *, context: bool | None = None, **overrides):
    """``run`` with ``--kernels`` applied for this process's backend over ``mesh`` (None: one device); ``overrides``:
    the per-op flags' values (None: not given), which win. ``context``: whether sequences are split (default: a
    context axis of ``mesh`` > 1)."""
    devices = 1 if mesh is None else mesh.size
    if context is None:
        context = mesh is not None and dict(mesh.shape).get("context", 1) > 1
    return with_kernels(run, getattr(args, "kernels", "auto"), kernel_target(), context=context, devices=devices,
                        **overrides)


def parse_mesh_arg(s: str | None):
    """The mesh a forward-only command splits its rows (``data``) and their sequences (``context``) over
    (``--mesh data=N,context=M``; parameters stay whole on every device). ``k3 route``, ``k3 logits`` and
    ``k3 generate`` use it. Without ``--mesh``: none, except in a job of several processes, where a process can only
    run the model on a mesh that spans them all: ``data`` over every device of the job."""
    if s is None and jax.process_count() > 1:
        s = f"data={jax.device_count()}"
    if s is None:
        return None
    sizes, _ = resolve_mesh(s, devices=len(jax.devices()), axes=("data", "context"))
    return make_mesh({"data": sizes["data"], "context": sizes["context"]})


__all__ = ["add_checkpoint_dir", "add_distributed", "add_model_source", "add_strict_config", "checkpoint_arg",
           "checkpoint_dir", "parse_mesh_arg", "preset_arg", "preset_help"]
