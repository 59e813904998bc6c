"""`k3 logits`, `k3 generate`, `k3 route` and `k3 export` as one jax.distributed job of 2 local CPU processes × 4
devices (scripts/multiprocess.sh, gloo collectives) against one process × 8 devices (in this process: the suite's 8
simulated CPU devices) on the same mesh.

The bounds: `k3 logits` within 1e-6 rel-RMS (``TOL["fp32_shallow"]``: the same program, its collectives split
between processes) with NaN at the same padding positions; `k3 generate` the same tokens, greedy and sampled (and the
same as one device without a mesh: same seed, same tokens on any mesh), its ``--logits-out`` within 1e-6; every
figure of `k3 route --json` within 1e-6 (the exact loads equal), the plots written once, by process 0;
`k3 export --from` and `--preset` byte-identical, every file. The default suite runs the export of a checkpoint (the
cheap one: no model compile, ~15 s); the others compile the model in three processes (1-2 min each) and are
``manual``.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from k3jax.cli.main import main
from k3jax.testing import TOL, assert_close, job_env

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "multiprocess.sh"
K3 = [sys.executable, "-m", "k3jax.cli.main"]
MESH = "data=2,context=4"


def _env(cache: Path) -> dict:
    return job_env(cache, ROOT)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


def _two(args: list, cache: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """`k3 ARGS` as 2 processes (scripts/multiprocess.sh); asserts both exit 0."""
    r = subprocess.run(["bash", str(LAUNCH), "2", *K3, *args], env=_env(cache), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"2 processes failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    return r


def _one(args: list, capsys) -> str:
    """`k3 ARGS` in this process (8 devices); its stdout."""
    capsys.readouterr()
    assert main(args) == 0
    return capsys.readouterr().out


def _json(stdout: str) -> dict:
    """The --json object: the one line of stdout that is a JSON object (gloo prints its own connection lines to
    process 0's stdout)."""
    objs = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(objs) == 1, stdout[-3000:]
    return json.loads(objs[0])


def _files(d: str) -> dict:
    return {name: (Path(d) / name).read_bytes() for name in sorted(os.listdir(d))}


def test_export_from_two_processes_is_byte_identical(tiny, tmp_path, cache, capsys):
    """`k3 export OUT --from CKPT --manifest`: 2 processes (each reading and writing the experts it holds) write the
    bytes one process writes, every file (shards, index, config.json, SHA256SUMS)."""
    ckpt, _ = tiny
    args = ["export", "--from", ckpt, "--manifest"]
    _one([args[0], str(tmp_path / "one"), *args[1:]], capsys)
    r = _two([args[0], str(tmp_path / "two"), *args[1:]], cache)
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == sorted(two) and "SHA256SUMS" in one
    assert [k for k in one if one[k] != two[k]] == []
    assert one == {**_files(ckpt), "SHA256SUMS": one["SHA256SUMS"]}  # the input's own bytes
    assert sum(line.startswith("wrote ") for line in r.stdout.splitlines()) == 1  # process 0 alone speaks


@pytest.mark.manual
def test_export_preset_two_processes_is_byte_identical(tmp_path, cache, capsys):
    """`k3 export OUT --preset k3-tiny --seed 3`: the init drawn whole on every device of the job, each tensor
    written once."""
    t0 = time.perf_counter()
    _one(["export", str(tmp_path / "one"), "--preset", "k3-tiny", "--seed", "3"], capsys)
    t1 = time.perf_counter()
    _two(["export", str(tmp_path / "two"), "--preset", "k3-tiny", "--seed", "3"], cache)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    print(f"export --preset: one {t1 - t0:.0f} s, two {time.perf_counter() - t1:.0f} s")


@pytest.mark.manual
def test_logits_two_processes_like_one(tiny, tmp_path, cache, capsys):
    """`k3 logits --mesh data=2,context=4` (ragged rows: 3 padded to 4 over data, T = 30 to 32 over context): the
    logits of 2 processes within 1e-6 of one process's; without --mesh, 2 processes split the rows over their
    devices (data=2) and agree with the one-device logits within the mesh bound."""
    ckpt, tokens = tiny
    t0 = time.perf_counter()
    _one(["logits", ckpt, "--tokens", tokens, "--out", str(tmp_path / "one.npy"), "--mesh", MESH], capsys)
    _one(["logits", ckpt, "--tokens", tokens, "--out", str(tmp_path / "single.npy")], capsys)
    t1 = time.perf_counter()
    r = _two(["logits", ckpt, "--tokens", tokens, "--out", str(tmp_path / "two.npy"), "--mesh", MESH], cache)
    t2 = time.perf_counter()
    _two(["logits", ckpt, "--tokens", tokens, "--out", str(tmp_path / "data.npy")], cache)
    one, single = np.load(tmp_path / "one.npy"), np.load(tmp_path / "single.npy")
    two, data = np.load(tmp_path / "two.npy"), np.load(tmp_path / "data.npy")
    real = ~np.isnan(one)
    assert real[..., 0].sum() == 58 and all((np.isnan(x) == ~real).all() for x in (two, data, single))
    err = assert_close(two[real], one[real], TOL["fp32_shallow"], name="2 processes vs 1, same mesh")
    assert_close(data[real], single[real], TOL["fp32_mesh_vs_single"], name="2 processes data=2 vs one device")
    assert sum(line.startswith("wrote ") for line in r.stdout.splitlines()) == 1
    print(f"logits rel-RMS {err:.1e}; one process {t1 - t0:.0f} s (two runs), two {t2 - t1:.0f} s")


def _generate(tokens, out: Path) -> list:
    return ["generate", "--tokens", tokens, "--max-new-tokens", "6", "--json", "--out", str(out / "tokens.npy"),
            "--logits-out", str(out / "logits.npy")]


@pytest.mark.manual
@pytest.mark.parametrize("mesh", [MESH, "data=8"])
@pytest.mark.parametrize("sampling", [["--greedy"], ["--temperature", "1.2", "--top-p", "0.95", "--seed", "4"]],
                         ids=["greedy", "sampled"])
def test_generate_two_processes_like_one(tiny, tmp_path, cache, capsys, mesh, sampling):
    """`k3 generate --mesh MESH` as 2 processes: the tokens of one process on that mesh and of one device without a
    mesh (3 ragged prompts: rows padded to the data axis, prompts to the context split); --logits-out within 1e-6
    of one process's on the same mesh."""
    ckpt, tokens = tiny
    runs = {}
    for name, extra in (("single", []), ("one", ["--mesh", mesh]), ("two", ["--mesh", mesh])):
        (tmp_path / name).mkdir()
        args = [*_generate(tokens, tmp_path / name), "--ckpt", ckpt, *sampling, *extra]
        t0 = time.perf_counter()
        out = _two(args, cache).stdout if name == "two" else _one(args, capsys)
        runs[name] = (_json(out), np.load(tmp_path / name / "tokens.npy"), np.load(tmp_path / name / "logits.npy"),
                      time.perf_counter() - t0)
    (j1, t1, l1, s1), (j2, t2, l2, s2), (j0, t0_, l0, _) = runs["one"], runs["two"], runs["single"]
    assert t1.shape == (3, 6)
    np.testing.assert_array_equal(t2, t1)
    np.testing.assert_array_equal(t1, t0_)
    assert j2["rows"] == j1["rows"] == j0["rows"]
    err = assert_close(l2, l1, TOL["fp32_shallow"], name="--logits-out, 2 processes vs 1")
    assert_close(l1, l0, TOL["fp32_mesh_vs_single"], name="--logits-out, mesh vs one device")
    print(f"generate {mesh} {sampling[0]}: logits rel-RMS {err:.1e}; one process {s1:.0f} s, two {s2:.0f} s")


def _close(a, b, where: str = "") -> None:
    """Every number of two JSON values within 1e-6 relative (NaN equals NaN), everything else equal."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-6 * max(1.0, abs(a)), (where, a, b)
    else:
        assert a == b, (where, a, b)


@pytest.mark.manual
def test_route_two_processes_like_one(tiny, tmp_path, cache, capsys):
    """`k3 route --mesh data=2,context=4 --compare CKPT --plots DIR --json` (rows windowed at --seq-len 16): every
    figure of 2 processes within 1e-6 of one process's, the loads exact; process 0 alone writes the plots."""
    ckpt, tokens = tiny
    args = ["route", "--ckpt", ckpt, "--tokens", tokens, "--seq-len", "16", "--batch", "2", "--compare", ckpt,
            "--mesh", MESH, "--json"]
    t0 = time.perf_counter()
    one = _json(_one([*args, "--plots", str(tmp_path / "one")], capsys))
    t1 = time.perf_counter()
    two = _json(_two([*args, "--plots", str(tmp_path / "two")], cache).stdout)
    assert one["tokens"] == two["tokens"] == 58
    assert [d["load"] for d in two["layers"]] == [d["load"] for d in one["layers"]]
    assert [os.path.basename(p) for p in two.pop("plots")] == [os.path.basename(p) for p in one.pop("plots")]
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))
    one.pop("peak_rss_bytes"), two.pop("peak_rss_bytes")
    _close(two, one)
    print(f"route: one process {t1 - t0:.0f} s, two {time.perf_counter() - t1:.0f} s")


@pytest.mark.manual
def test_merge_adapter_is_refused_in_two_processes(tiny, tmp_path, cache):
    """`k3 export --merge-adapter` runs in one process: a job of 2 exits 2 naming the flag, before reading anything."""
    ckpt, _ = tiny
    r = subprocess.run(["bash", str(LAUNCH), "2", *K3, "export", str(tmp_path / "out"), "--from", ckpt,
                        "--merge-adapter", str(tmp_path / "adapter")], env=_env(cache), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "--merge-adapter runs in one process" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "out").exists()
