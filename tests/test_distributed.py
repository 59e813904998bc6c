"""The process group's rules (k3jax/distributed.py) in one process: the flags, the clusters the environment names,
devices per process, global batches from process-local rows, metrics event files; and, as two real processes,
that settings which differ between them exit 2 naming the flag before any compute (seconds: no model is built).
The two-process train runs are tests/train/test_multiprocess_train.py."""

import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from k3jax import distributed as dist
from k3jax.cli.main import main, simulated_cpu_devices
from k3jax.errors import InputError
from k3jax.sharding.mesh import make_mesh
from k3jax.testing import free_port
from k3jax.train.records import MetricsFile

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("launch, needle", [
    (dist.Launch("localhost:1", 2, None), "missing --process-id"),
    (dist.Launch(None, 2, 0), "missing --coordinator"),
    (dist.Launch("localhost:1", 2, 2), "--process-id 2: must be in [0, 2)"),
    (dist.Launch("localhost:1", 2, -1), "--process-id -1"),
    (dist.Launch("localhost:1", 0, 0), "--num-processes 0"),
    (dist.Launch("localhost", 2, 0), "--coordinator 'localhost': expected HOST:PORT"),
    (dist.Launch("localhost:99999", 2, 0), "expected HOST:PORT"),
    (dist.Launch("localhost:1", 2, 1, timeout_s=0), "--distributed-timeout 0"),
])
def test_bad_launch_flags_name_the_flag(launch, needle):
    with pytest.raises(InputError, match=re.escape(needle)):
        launch.check()


def test_clusters_the_environment_names():
    none = lambda pattern: False  # noqa: E731
    assert dist.cluster_named({}, none) is None
    assert dist.cluster_named({"JAX_COORDINATOR_ADDRESS": "h:1"}, none) == "jax"
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert dist.cluster_named(slurm | {"SLURM_NTASKS": "4"}, none) == "slurm"
    assert dist.cluster_named(slurm | {"SLURM_NTASKS": "1"}, none) is None  # one task: one process
    assert dist.cluster_named({"OMPI_COMM_WORLD_SIZE": "2"}, none) == "ompi"
    assert dist.cluster_named({"OMPI_COMM_WORLD_SIZE": "1"}, none) is None
    assert dist.cluster_named({}, lambda pattern: pattern == "/dev/accel*") == "tpu"
    assert dist.cluster_named({}, lambda pattern: pattern == "/dev/nvidia0") is None  # one GPU host: one process


def test_devices_per_cpu_process():
    cpu = lambda pattern: False  # noqa: E731
    assert simulated_cpu_devices(8, {}, cpu, 2) == 4
    assert simulated_cpu_devices(8, {}, cpu, 3) is None  # the mesh check names it
    assert simulated_cpu_devices(8, {"JAX_NUM_CPU_DEVICES": "4"}, cpu, 2) is None  # chosen by the caller
    assert simulated_cpu_devices(8, {"JAX_NUM_PROCESSES": "2"}, cpu, 1) is None  # a launcher's job, count unknown
    assert simulated_cpu_devices(2, {}, cpu, 2) == 1
    assert dist.Launch("h:1", 2, 0).processes({}) == 2
    assert dist.Launch().processes({"SLURM_NTASKS": "4"}) == 4
    assert dist.Launch().processes({}) is None


@pytest.mark.parametrize("spec, lead", [(PartitionSpec(None, "data"), 2), (PartitionSpec("data", None), 2),
                                        (PartitionSpec(None, ("data", "expert")), 2)])
def test_global_rows_from_process_rows(spec, lead):
    """In one process every row is this process's: the array built from its rows is the batch itself, whatever axes
    split the rows (the two-process runs check the split between processes)."""
    mesh = make_mesh({"data": 2, "expert": 4})
    sh = NamedSharding(mesh, spec)
    x = np.arange(lead * 8 * 5, dtype=np.int32).reshape(lead, 8, 5)
    rows = dist.process_rows(sh, x.shape, row_axes=2)
    np.testing.assert_array_equal(rows, np.arange(lead * 8))
    got = dist.from_process_rows(sh, x.shape, rows, x.reshape(lead * 8, 5)[rows], row_axes=2)
    assert got.sharding == sh
    np.testing.assert_array_equal(np.asarray(got), x)


def test_one_process_agrees_and_polls_alone():
    dist.agree({"steps": 3})  # nothing to compare with
    assert dist.any_process(True) is True and dist.any_process(False) is False
    assert dist.prefix() == "" and dist.is_main()
    np.testing.assert_array_equal(dist.host_value(jax.numpy.arange(3)), np.arange(3))


def _events(d: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the TensorBoard event files of ``d`` (TFRecord framing read here)."""
    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(d.iterdir()):
        data, i = f.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12:i + 12 + n])
            out += [(v.tag, ev.step, v.simple_value) for v in ev.summary.value]
            i += 12 + n + 4
    return out


def test_metrics_also_as_tensorboard_events(tmp_path):
    m = MetricsFile(str(tmp_path / "m.jsonl"), tensorboard=str(tmp_path / "tb"))
    m.write({"event": "start", "step": 0, "devices": 8, "model": "k3-tiny", "qat": False})
    m.write({"step": 1, "loss": 4.5, "finite": True, "lr": 0.001})
    m.write({"step": 2, "loss": 4.25, "eval_loss": 4.4, "finite": True, "lr": 0.002})
    m.close()
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3  # the JSONL is written as before
    ev = _events(tmp_path / "tb")
    assert ("start/devices", 0, 8.0) in ev
    assert ("train/loss", 1, 4.5) in ev and ("train/loss", 2, 4.25) in ev and ("train/eval_loss", 2,
                                                                                 pytest.approx(4.4)) in ev
    assert not any(tag.endswith(("/finite", "/model", "/qat")) for tag, _, _ in ev)


def test_unreachable_coordinator_exits_2_naming_it(capsys):
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    rc = main(["train", "--preset", "k3-tiny", "--steps", "1", "--coordinator", f"localhost:{port}",
               "--num-processes", "2", "--process-id", "1", "--distributed-timeout", "2"])
    assert rc == 2 and time.monotonic() - t0 < 30
    assert f"--coordinator localhost:{port}: not reachable within --distributed-timeout 2 s" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_processes_started_with_different_settings_exit_2_naming_the_flag(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "k3jax.cli.main", "train", "--preset", "k3-tiny", "--steps",
                               str(8 + i), "--mesh", "data=2", "--coordinator", f"localhost:{port}",
                               "--num-processes", "2", "--process-id", str(i), "--ckpt-dir", str(tmp_path / "ck")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 2, err[-2000:]
        assert f"k3 train: [process {i}/2] error: the processes were started with different --steps" in err, err
    assert not (tmp_path / "ck").exists()  # nothing written
