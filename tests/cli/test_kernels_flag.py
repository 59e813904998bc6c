"""``--kernels`` end to end: the Pallas paths (pallas_kernels/mla, the KDA chunk kernel; Pallas' interpreter on this
CPU) give the XLA paths' logits and tokens — `k3 logits` within 3e-5 relative, cached greedy generation the same
tokens wherever the XLA run's top-2 logit margin exceeds 1e-3 and its logits within 3e-5 —, and a kernel that
cannot run for a command is an exit 2 naming it, before any weight is read or compiled."""

import numpy as np
import pytest

from k3jax.checkpoint.load import shipped_checkpoint
from k3jax.cli.main import main
from k3jax.testing import rel_rms

BOUND = 3e-5


def _logits(ckpt, tokens, out, kernels, *more):
    assert main(["logits", ckpt, "--tokens", tokens, "--out", str(out), "--kernels", kernels, *more]) == 0
    return np.load(out)


def _compare_logits(ckpt, tokens, tmp_path, *more):
    xla = _logits(ckpt, tokens, tmp_path / "xla.npy", "xla", *more)
    pallas = _logits(ckpt, tokens, tmp_path / "pallas.npy", "pallas", *more)
    real = ~np.isnan(xla[..., 0])
    assert (np.isnan(pallas[..., 0]) == ~real).all()
    err = rel_rms(pallas[real], xla[real])
    print(f"k3 logits --kernels pallas vs xla: rel-RMS {err:.2e}")
    assert err <= BOUND


def test_logits_pallas_equals_xla_k3_tiny(tiny, tmp_path):
    _compare_logits(*tiny, tmp_path)


@pytest.mark.slow
def test_logits_pallas_equals_xla_on_a_context_mesh(tiny, tmp_path):
    """--mesh context=2: the KDA kernel inside the sequence's shard_map, the MLA flash kernel per shard over the
    gathered latent with its queries mirror-balanced."""
    _compare_logits(*tiny, tmp_path, "--mesh", "context=2")


@pytest.mark.slow
def test_logits_pallas_equals_xla_k3_mini(tmp_path):
    ckpt = shipped_checkpoint()
    if ckpt is None:
        pytest.skip("no shipped k3-mini in this install")
    rows = np.frombuffer(b"def main(argv):\n    parser = argparse.ArgumentParser()\n" * 3, np.uint8)
    np.save(tmp_path / "t.npy", np.stack([rows[:96], rows[40:136]]).astype(np.int32))
    _compare_logits(ckpt, str(tmp_path / "t.npy"), tmp_path)


def _generate(args, tmp_path, kernels):
    out, lg = tmp_path / f"{kernels}.npy", tmp_path / f"{kernels}_logits.npy"
    assert main(["generate", *args, "--greedy", "--out", str(out), "--logits-out", str(lg), "--kernels",
                 kernels]) == 0
    return np.load(out), np.load(lg)


def _compare_generation(args, tmp_path):
    """Tokens equal up to the first position where the XLA run's top-2 margin is at most 1e-3 (a near-tie either
    path may break its own way; the two runs then continue different texts), logits within the bound there."""
    tx, lx = _generate(args, tmp_path, "xla")
    tp, lp = _generate(args, tmp_path, "pallas")
    for b in range(tx.shape[0]):
        top2 = np.sort(lx[b], -1)[:, -2:]
        close = np.nonzero(top2[:, 1] - top2[:, 0] <= 1e-3)[0]
        n = int(close[0]) + 1 if close.size else tx.shape[1]
        assert (tx[b, :n] == tp[b, :n]).all(), (b, tx[b], tp[b])
        err = rel_rms(lp[b, :n], lx[b, :n])
        print(f"row {b}: {n} tokens compared, logits rel-RMS {err:.2e}")
        assert err <= BOUND


@pytest.mark.slow
def test_cached_generation_pallas_equals_xla_k3_tiny(tiny, tmp_path):
    ckpt, tokens = tiny
    _compare_generation(["--ckpt", ckpt, "--tokens", tokens, "--max-new-tokens", "12"], tmp_path)


@pytest.mark.manual
def test_cached_generation_pallas_equals_xla_k3_mini(tmp_path):
    ckpt = shipped_checkpoint()
    if ckpt is None:
        pytest.skip("no shipped k3-mini in this install")
    _compare_generation(["--ckpt", ckpt, "--prompt", "def main(argv):\n", "--max-new-tokens", "48"], tmp_path)


@pytest.mark.parametrize("argv,match", [
    (["plan", "--preset", "k3-tiny", "--compile", "--target", "cpu:4", "--mesh", "data=4", "--kernels", "pallas"],
     "--kernels pallas --target cpu:4: the packed-expert Pallas kernel compiles for TPU targets"),
    (["plan", "--preset", "kimi-k3", "--compile", "--target", "tpu:v5p:4x4x4", "--mesh", "tensor=4,expert=16",
      "--mode", "decode", "--context", "8192", "--kernels", "pallas"],
     "the KDA chunk kernel cannot run here: it runs on one tpu device"),
])
def test_a_kernel_that_cannot_run_exits_2_naming_it(tiny, tmp_path, capsys, argv, match):
    ckpt, tokens = tiny
    argv = [{"CKPT": ckpt, "TOK": tokens, "OUT": str(tmp_path / "o.npy")}.get(a, a) for a in argv]
    assert main(argv) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "o.npy").exists()


def test_a_cache_the_kernel_cannot_tile_is_an_input_error():
    """The kernel's own refusal (here Triton's: k3-tiny's 8-wide key slice is no power of two >= 16) reaches `k3`
    as an InputError naming the kernel and the reason (exit 2), not a traceback."""
    import jax
    import jax.numpy as jnp

    from k3jax.errors import InputError
    from k3jax.layers import backends

    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
        with pytest.raises(InputError, match="--kernels pallas: the MLA decode kernel cannot run here: mla_decode: "
                                             "the Triton schedule cannot tile a key rope width Hr of 8"):
            jax.eval_shape(lambda *a: backends.mla_decode(*a[:6], q_pos=a[6], kv_len=a[7], scale=0.2),
                           z(1, 1, 4, 16), z(1, 1, 4, 8), z(1, 64, 32), z(1, 64, 8), z(32, 4, 16), z(32, 4, 16),
                           jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
