"""`k3`'s exit codes (docs/cli.md): 2 only for validated bad input (``InputError``, named in one line on stderr);
any other exception is a bug in k3jax and leaves with its traceback and exit 1, never dressed up as bad input. And
what every subcommand's parser shares (k3jax/cli/main.py): no abbreviated flags, help on every flag, hints for
unrecognized flags, one wording for a missing checkpoint, the preset table in the help, a quiet exit on a closed
stdout, simulated CPU devices for a --mesh on a CPU-only machine."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3jax.cli import inspect as inspect_cli
from k3jax.cli.main import build_parser, devices_asked, main, simulated_cpu_devices
from k3jax.config import PRESETS
from k3jax.errors import InputError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def somewhere(tmp_path):
    """A directory that passes the parse-time checkpoint check (it has a config.json)."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_input_error_exits_2_with_one_line(monkeypatch, capsys, somewhere):
    def bad(args):
        raise InputError("--frobs 3: must be even")

    monkeypatch.setattr(inspect_cli, "run", bad)
    assert main(["inspect", somewhere]) == 2
    assert capsys.readouterr().err == "k3 inspect: error: --frobs 3: must be even\n"


def test_an_internal_value_error_is_not_bad_input(monkeypatch, somewhere):
    def broken(args):
        raise ValueError("operands could not be broadcast together")  # e.g. from inside jax or numpy

    monkeypatch.setattr(inspect_cli, "run", broken)
    with pytest.raises(ValueError, match="broadcast"):
        main(["inspect", somewhere])


def test_an_internal_error_exits_1_with_its_traceback(somewhere):
    code = ("import sys; from k3jax.cli import inspect as i; from k3jax.cli.main import main\n"
            "def broken(args): raise ValueError('operands could not be broadcast together')\n"
            f"i.run = broken\nsys.exit(main(['inspect', {somewhere!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "ValueError: operands could not be broadcast" in r.stderr


def _subparsers():
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return p, sub.choices


def test_every_parser_refuses_abbreviations_and_documents_every_flag():
    top, subs = _subparsers()
    assert top.allow_abbrev is False
    missing = []
    for name, sp in subs.items():
        assert sp.allow_abbrev is False, name
        missing += [f"k3 {name} {'/'.join(a.option_strings) or a.dest}" for a in sp._actions
                    if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, f"flags without help: {missing}"


@pytest.mark.parametrize("argv, words", [
    (["train", "--metric", "m.jsonl"], "unrecognized arguments: --metric m.jsonl (--metric: did you mean --metrics?)"),
    (["train", "--ckpt-d", "runs/x"], "unrecognized arguments: --ckpt-d runs/x (--ckpt-d: did you mean --ckpt-dir?)"),
    (["train", "--ckpt", "x"], "unrecognized arguments: --ckpt x (k3 train reads a checkpoint with --init DIR; its "
                               "own run directory is --ckpt-dir DIR)"),
    (["plan", "--preset", "k3-tiny", "--tensor"], "unrecognized arguments: --tensor"),
], ids=["metric", "ckpt-d", "train-ckpt", "tensor"])
def test_an_abbreviated_or_unknown_flag_exits_2_with_a_hint(argv, words, capsys):
    with pytest.raises(SystemExit) as e:  # the parser alone: nothing runs, even where the abbreviation was taken
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"k3 {argv[0]}: error: {words}" in err, err
    assert main(argv) == 2 and words in capsys.readouterr().err


def test_every_preset_flag_lists_and_checks_the_preset_table(capsys):
    _, subs = _subparsers()
    plan_preset = next(a for a in subs["plan"]._actions if "--preset" in a.option_strings)
    assert all(name in plan_preset.help for name in PRESETS), plan_preset.help
    for name, sp in subs.items():
        for a in sp._actions:
            if "--preset" in a.option_strings:
                assert all(n in a.help for n in PRESETS), (name, a.help)
                with pytest.raises(SystemExit):
                    sp.parse_args(["--preset", "kimi-k9"])
                assert "known presets: " + ", ".join(sorted(PRESETS)) in capsys.readouterr().err


def test_a_missing_checkpoint_is_worded_once_for_every_subcommand(tmp_path, capsys):
    missing, empty = str(tmp_path / "nope"), tmp_path / "empty"
    empty.mkdir()
    text, out = str(tmp_path / "t.txt"), str(tmp_path / "out.npy")
    cases = {
        "DIR": [["inspect", "CK"], ["logits", "CK", "--tokens", "t.npy", "--out", out]],
        "--ckpt": [["inspect", "--ckpt", "CK"], ["route", "--ckpt", "CK", "--text", text],
                   ["generate", "--ckpt", "CK", "--prompt", "hi"], ["run", "--ckpt", "CK"]],
        "--from": [["export", str(tmp_path / "x"), "--from", "CK"]],
        "--init": [["train", "--init", "CK", "--steps", "1"]],
        "--compare": [["route", "--preset", "k3-tiny", "--compare", "CK", "--text", text]],
    }
    for ck, why in ((missing, "no such directory"), (str(empty), "no config.json in it")):
        for flag, argvs in cases.items():
            for argv in argvs:
                assert main([ck if a == "CK" else a for a in argv]) == 2, argv
                err = capsys.readouterr().err
                want = f"k3 {argv[0]}: error: argument {flag}: {ck}: not a checkpoint directory ({why})\n"
                assert err.endswith(want), err
    assert sorted(os.listdir(tmp_path)) == ["empty"] and not os.listdir(empty)  # nothing ran, nothing written
    from k3jax.checkpoint.source import model_config  # the library path: the same words, after the flag

    with pytest.raises(InputError, match=f"^--ckpt {missing}: not a checkpoint directory \\(no such directory\\)$"):
        model_config(ckpt=missing, preset=None)


def test_a_closed_stdout_ends_quietly_with_exit_0():
    """`k3 plan --preset kimi-k3 --tensors | head`: the reader goes away before k3 is done; no traceback, and no
    "Exception ignored" from the interpreter's flush at exit."""
    proc = subprocess.Popen([sys.executable, "-m", "k3jax.cli.main", "plan", "--preset", "k3-tiny", "--tensors"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # before k3 writes its first line (24 kB of them: several writes)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


@pytest.mark.parametrize("env, devices, want", [
    ({"JAX_PLATFORMS": "cpu"}, (), 8),                                   # main's override on a libtpu machine
    ({}, (), 8),                                                         # no accelerator: JAX picks the CPU
    ({"JAX_PLATFORMS": ""}, (), 8),
    ({"JAX_PLATFORMS": "cpu"}, ("/dev/accel*",), 8),                     # the user chose the CPU
    ({}, ("/dev/nvidia0",), None),                                       # a real accelerator: its own devices
    ({}, ("/dev/accel*",), None),
    ({"JAX_PLATFORMS": "cuda"}, (), None),
    ({"JAX_PLATFORMS": "cpu,tpu"}, (), None),
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, (), None),  # count chosen
    ({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}, (), None),
    ({"JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": "h:1234"}, (), None),  # multi-process
    ({"JAX_PLATFORMS": "cpu", "SLURM_NTASKS": "2"}, (), None),
    ({"JAX_PLATFORMS": "cpu", "SLURM_NTASKS": "1", "XLA_FLAGS": "--xla_cpu_foo"}, (), 8),
])
def test_simulated_cpu_devices_only_for_one_cpu_process(env, devices, want):
    assert simulated_cpu_devices(8, env, lambda pattern: pattern in devices) == want
    assert simulated_cpu_devices(1, env, lambda pattern: pattern in devices) is None  # one device exists anyway


@pytest.mark.parametrize("argv, want", [
    (["route", "--mesh", "data=2,context=2"], ("--mesh data=2,context=2", 4)),
    (["logits", "--mesh", "data=2", "--tokens", "t.npy", "--out", "o.npy"], ("--mesh data=2", 2)),
    (["train", "--mesh", "data=2,expert=4"], ("--mesh data=2,expert=4", 8)),
    (["train", "--devices", "4"], ("--devices 4", 4)),
    (["train"], None),
    (["route", "--mesh", "data=two"], None),                                  # malformed: the command says so
    (["plan", "--preset", "k3-tiny", "--mesh", "expert=8"], None),            # --target cpu:N does its own
])
def test_devices_asked_reads_mesh_and_devices(argv, want):
    assert devices_asked(build_parser().parse_args(argv)) == want


def test_a_mesh_on_a_cpu_only_machine_starts_simulated_devices():
    """A one-process `k3 route --mesh data=2` with JAX on the CPU and no device count set: one line on stderr, and
    the command sees 2 devices (its run is a probe here: the compile is not what is tested)."""
    code = ("import sys; from k3jax.cli import args as cli_args, route; from k3jax.cli.main import main\n"
            "def probe(args):\n"
            "    import jax; print(jax.device_count(), dict(cli_args.parse_mesh_arg(args.mesh).shape))\n"
            "route.run = probe\nsys.exit(main(['route', '--preset', 'k3-tiny', '--mesh', 'data=2']))")
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", **({"XLA_FLAGS": flags} if flags else {}))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("2 {'data': 2"), r.stdout
    assert [line for line in r.stderr.splitlines() if "simulated" in line] == [
        "k3 route: --mesh data=2 needs 2 devices and JAX runs on this machine's CPU: starting 2 simulated CPU "
        "devices"], r.stderr
