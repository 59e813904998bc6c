"""Output directories written whole or not at all (k3jax/checkpoint/atomic.py): a failed write leaves what was
there, an existing non-empty directory is replaced only when asked, and the export commands check theirs before
any compute."""

import os

import pytest

from k3jax.checkpoint.atomic import check_out_dir, staged_dir
from k3jax.checkpoint.save import export_trained, save
from k3jax.cli.main import main
from k3jax.config import RunConfig, get_preset
from k3jax.errors import InputError

TINY = get_preset("k3-tiny")


def _mine(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    return d


def _siblings(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def test_staged_dir_replaces_only_when_complete_and_asked(tmp_path):
    d = _mine(tmp_path)
    with pytest.raises(InputError, match="--export .*out: exists and is not empty .pass --overwrite"):
        check_out_dir(d, overwrite=False, flag="--export", hint="pass --overwrite")
    with pytest.raises(RuntimeError), staged_dir(d, overwrite=True) as tmp:
        (open(os.path.join(tmp, "half.bin"), "wb")).close()
        raise RuntimeError("the writer failed")
    assert sorted(os.listdir(d)) == ["keep.txt"] and _siblings(tmp_path) == ["out"]  # untouched, no temp left
    with staged_dir(d, overwrite=True) as tmp:
        open(os.path.join(tmp, "new.bin"), "wb").close()
    assert sorted(os.listdir(d)) == ["new.bin"] and _siblings(tmp_path) == ["out"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        check_out_dir(tmp_path / "file", overwrite=True)


def test_a_trained_export_never_replaces_silently_and_a_failed_save_keeps_the_old(tmp_path):
    d = _mine(tmp_path)
    with pytest.raises(InputError, match="exists and is not empty"):
        export_trained({}, TINY, RunConfig(), str(d))
    with pytest.raises(KeyError):  # no parameters to write: fails after the temporary directory was made
        save({}, TINY, d, overwrite=True)
    assert (d / "keep.txt").read_text() == "mine" and _siblings(tmp_path) == ["out"]


@pytest.mark.parametrize("extra", [[], ["--merge-adapter", "ADAPTER"]], ids=["export", "merge"])
def test_k3_export_refuses_a_non_empty_out_before_loading(extra, tmp_path, capsys, monkeypatch):
    import importlib

    import k3jax.model as model_mod

    load_mod = importlib.import_module("k3jax.checkpoint.load")  # the module (the package exports its function)

    def boom(*a, **k):
        raise AssertionError("loaded or initialised parameters")

    # k3jax.cli.export imports both at module level: imported before the patches (so that it never binds ``boom``
    # for the tests after this one), its own names patched too
    export_mod = importlib.import_module("k3jax.cli.export")
    monkeypatch.setattr(load_mod, "load", boom)
    monkeypatch.setattr(model_mod, "init_params", boom)
    for name in ("load", "init_params"):
        monkeypatch.setattr(export_mod, name, boom, raising=False)
    d = _mine(tmp_path)
    base = tmp_path / "base"  # what --from's parse checks (a directory with a config.json); never read
    base.mkdir()
    (base / "config.json").write_text("{}")
    src = ["--from", str(base)] if extra else ["--preset", "k3-tiny"]
    assert main(["export", str(d), *src, *[str(base) if a == "ADAPTER" else a for a in extra]]) == 2
    err = capsys.readouterr().err
    assert f"OUT {d}: exists and is not empty" in err and "--overwrite" in err, err
    assert (d / "keep.txt").read_text() == "mine"
