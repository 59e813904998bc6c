"""One ``jax.distributed`` process group per `k3` job, and what every process of it does the same way.

    launch = Launch.from_args(args)            # --coordinator HOST:PORT --num-processes N --process-id I
    start(launch, environ=os.environ)          # before any jax backend starts (k3jax.cli.main does it)
    agree({"steps": 8, "mesh": "data=2"})      # every process started with the same settings, or exit 2 naming one
    stop = any_process(sigterm_seen)           # one process's SIGTERM stops them all, at the same step
    rows = process_rows(sharding, (M, b, L), row_axes=2)  # the batch rows this process's devices hold
    x = from_process_rows(sharding, (M, b, L), rows, local)   # a global batch, each process making only its rows

The distributed engine is JAX's own multi-controller runtime: this module only decides when to start it and with
what, and turns its failures into messages. A job is several processes when the three flags are given (all three,
``0 <= I < N``), or when the environment names a cluster that ``jax.distributed.initialize()`` detects by itself
(``cluster_named``: a TPU VM, a SLURM step of several tasks, Open MPI, or the ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` variables JAX reads); otherwise it is one process and nothing starts.
On the CPU the processes reduce over gloo (``jax_cpu_collectives_implementation``).

Failures: a coordinator that cannot be reached within ``--distributed-timeout`` seconds is an InputError naming the
address (exit 2). A process that dies is noticed by the others through the runtime's heartbeats
(``HEARTBEAT_S``): the coordination service then ends them with an error (a gloo collective whose peer closed its
socket fails at once), so a job never hangs on a dead peer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from k3jax.errors import InputError

# jax is imported inside the functions: `k3` (k3jax.cli.main) reads ``Launch`` and ``cluster_named`` before jax may
# start, since the simulated CPU devices and the process group must be chosen before any backend is.

# Seconds without a heartbeat after which the coordination service declares a process dead and stops the others:
# below the 120 s in which a job must notice a dead process, above a loaded machine's scheduling hiccups.
HEARTBEAT_S = 45
# Seconds a finishing process waits for the others at shutdown.
SHUTDOWN_S = 120
INIT_TIMEOUT_S = 300  # jax.distributed's own default: hosts of a pod slice may start minutes apart

# Environment variables by which a launcher names a cluster that jax.distributed.initialize() detects itself.
_JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_SLURM_ENV = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI_ENV = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")
TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")


@dataclass(frozen=True)
class Launch:
    """What the command line says of the process group: all three of coordinator, processes and id, or none."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = INIT_TIMEOUT_S

    @classmethod
    def from_args(cls, args) -> Launch:
        return cls(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                   getattr(args, "process_id", None), getattr(args, "distributed_timeout", None) or INIT_TIMEOUT_S)

    def check(self) -> None:
        """Exactly all or none of the three flags; ``0 <= I < N``; a HOST:PORT coordinator."""
        given = {"--coordinator": self.coordinator, "--num-processes": self.num_processes,
                 "--process-id": self.process_id}
        missing = [k for k, v in given.items() if v is None]
        if 0 < len(missing) < 3:
            raise InputError(f"a multi-process job needs --coordinator, --num-processes and --process-id together; "
                             f"missing {', '.join(missing)}")
        if missing:
            return
        if self.num_processes < 1:
            raise InputError(f"--num-processes {self.num_processes}: must be at least 1")
        if not 0 <= self.process_id < self.num_processes:
            raise InputError(f"--process-id {self.process_id}: must be in [0, {self.num_processes}) for "
                             f"--num-processes {self.num_processes}")
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"--coordinator {self.coordinator!r}: expected HOST:PORT (e.g. 10.0.0.2:8476)")
        if self.timeout_s < 1:
            raise InputError(f"--distributed-timeout {self.timeout_s}: must be at least 1 second")

    @property
    def given(self) -> bool:
        return self.coordinator is not None

    def processes(self, environ) -> int | None:
        """The number of processes the job will have, when the flags or the environment say it (else None)."""
        if self.given:
            return self.num_processes
        for k in ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
            if (v := environ.get(k, "").strip()).isdigit():
                return int(v)
        return None


def cluster_named(environ, has_device) -> str | None:
    """Which cluster the environment names, whose process group ``jax.distributed.initialize()`` finds by itself:
    "jax" (its own variables), "slurm" (a step of more than one task), "ompi", "tpu" (a TPU VM: one host or a pod
    slice, told apart by JAX from the VM's metadata); None: one process. ``has_device(glob)`` says whether a device
    file exists."""
    if any(k in environ for k in _JAX_ENV):
        return "jax"
    if all(k in environ for k in _SLURM_ENV) and environ["SLURM_NTASKS"].strip() not in ("", "0", "1"):
        return "slurm"
    if any(k in environ for k in _OMPI_ENV) and environ.get("OMPI_COMM_WORLD_SIZE", "2").strip() != "1":
        return "ompi"
    if any(has_device(p) for p in TPU_DEVICE_FILES):
        return "tpu"
    return None


def start(launch: Launch, *, environ, has_device) -> str | None:
    """Start the process group the flags or the environment name (``cluster_named``), before any backend starts;
    returns how it started ("flags", "jax", "slurm", "ompi", "tpu"), or None for a one-process job and when the
    group was already started (by the caller of an in-process `k3` command, who also ends it)."""
    import jax

    launch.check()
    how = "flags" if launch.given else cluster_named(environ, has_device)
    if how is None or launch.given and launch.num_processes == 1:  # one process: nothing to start
        return None
    if jax.distributed.is_initialized():  # a `k3` command called in-process inside a job: its caller owns the group
        return None
    timeout = launch.timeout_s
    if launch.given and launch.process_id != 0:  # process 0 serves the coordinator; the others must reach it
        timeout = _reach(launch.coordinator, launch.timeout_s)
    platforms = {p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    accelerator = any(has_device(p) for p in (*TPU_DEVICE_FILES, "/dev/nvidia0", "/dev/kfd"))
    if platforms == {"cpu"} or not platforms and not accelerator:  # CPU processes reduce over gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # No persistent compilation cache in a CPU job: process 0 alone writes it and every process reads what
        # process 0 compiled, and on XLA:CPU that executable is process 0's own. Measured (jax 0.12, 2 processes
        # x 4 devices, experiments/LOG.md): with the cache warm, process 1 ran k3-tiny's cached train step without
        # taking part in the collectives and left the loop at once, leaving process 0 waiting on a dead peer.
        jax.config.update("jax_enable_compilation_cache", False)
    kw = dict(initialization_timeout=timeout, heartbeat_timeout_seconds=HEARTBEAT_S,
              shutdown_timeout_seconds=SHUTDOWN_S)
    if launch.given:
        kw.update(coordinator_address=launch.coordinator, num_processes=launch.num_processes,
                  process_id=launch.process_id)
    try:
        jax.distributed.initialize(**kw)
    except Exception as e:  # the runtime's own error types differ across jax versions
        where = launch.coordinator or environ.get("JAX_COORDINATOR_ADDRESS") or f"the {how} cluster's coordinator"
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"--coordinator {where}: the process group did not start within --distributed-timeout "
                         f"{launch.timeout_s} s ({text})") from None
    return how


def _reach(coordinator: str, timeout_s: int) -> int:
    """Wait until a TCP connection to ``coordinator`` (HOST:PORT) opens, retrying (process 0 may start later) for at
    most ``timeout_s`` seconds; returns the seconds left. The runtime aborts the process when it cannot register
    with the coordinator, so this is where an unreachable one is reported (an InputError naming it)."""
    import socket
    import time

    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    start = time.monotonic()
    last: OSError | None = None
    while (left := timeout_s - (time.monotonic() - start)) > 0:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, left)):
                return max(1, int(left))
        except OSError as e:
            last = e
            time.sleep(min(0.5, max(0.0, timeout_s - (time.monotonic() - start))))
    raise InputError(f"--coordinator {coordinator}: not reachable within --distributed-timeout {timeout_s} s "
                     f"({last}); is process 0 running, and is the address one the other hosts can reach?")


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main() -> bool:
    """Whether this process writes the job's logs, metrics, progress and shared files (process 0)."""
    return process_index() == 0


def prefix() -> str:
    """"[process I/N] " in a job of several processes, else ""; every process's error messages start with it."""
    import jax

    return f"[process {jax.process_index()}/{jax.process_count()}] " if jax.process_count() > 1 else ""


def _digest(value) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()


def agree(settings: dict, *, what: str = "setting", flag=lambda k: f"--{k.replace('_', '-')}") -> None:
    """Every process was started with the same ``settings`` (a dict of JSON-able values, the same keys in every
    process): else an InputError in every process naming each differing one by its flag (``flag(key)``), before
    any compute. One small all-gather of their digests; nothing in a one-process job. (`k3` prefixes the message
    with the process's index.)"""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return
    keys = sorted(settings)
    mine = np.frombuffer(b"".join(_digest(settings[k]) for k in keys) + _digest(keys), np.uint8).reshape(-1, 32)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, keys + 1, 32]
    if not (every[:, -1] == every[0, -1]).all():
        raise InputError(f"the processes were started with different {what}s (their names differ)")
    differ = [k for i, k in enumerate(keys) if not (every[:, i] == every[0, i]).all()]
    if differ:
        who = [p for p in range(every.shape[0]) if not (every[p, :-1] == every[0, :-1]).all()]
        raise InputError(f"the processes were started with different {', '.join(map(flag, differ))} "
                         f"(processes {who} differ from process 0); start every process with the same command")


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true in any process (every process calls it at the same point); ``flag`` alone in a
    one-process job."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.array([flag], np.int32))).any())


def process_rows(sharding, shape: tuple, *, row_axes: int = 1):
    """The global rows (indices into the leading ``row_axes`` axes of ``shape``, flattened in C order; sorted) that
    this process's devices hold of an array placed by ``sharding``."""
    import numpy as np

    grid = np.arange(int(np.prod(shape[:row_axes]))).reshape(shape[:row_axes])
    held = sharding.addressable_devices_indices_map(shape).values()
    return np.unique(np.concatenate([grid[idx[:row_axes]].ravel() for idx in held]))


def from_process_rows(sharding, shape: tuple, rows, local, *, row_axes: int = 1):
    """The global array of ``shape`` placed by ``sharding`` from this process's rows only: ``local`` [len(rows),
    *shape[row_axes:]] holds the global rows ``rows`` (``process_rows``). No process makes another's rows."""
    import jax
    import numpy as np

    grid = np.arange(int(np.prod(shape[:row_axes]))).reshape(shape[:row_axes])
    at = np.full(grid.size, -1, np.int64)
    at[rows] = np.arange(len(rows))

    def part(idx):
        return local[at[grid[idx[:row_axes]]]][(slice(None),) * row_axes + tuple(idx[row_axes:])]

    return jax.make_array_from_callback(shape, sharding, part)


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (no-op in one process)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def host_value(x):
    """A global array's whole value as NumPy in every process: gathered from the processes that hold its shards when
    this one does not hold it all (small arrays: adapters, metrics)."""
    import numpy as np
    from jax.experimental import multihost_utils

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shutdown() -> None:
    """Leave the process group (every process at the end of a job: the runtime then waits for the others)."""
    import jax

    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


__all__ = ["HEARTBEAT_S", "INIT_TIMEOUT_S", "Launch", "agree", "any_process", "barrier", "cluster_named",
           "from_process_rows", "host_value", "is_main", "prefix", "process_index",
           "process_rows", "shutdown", "start"]
