"""Two local CPU processes (jax.distributed + gloo, 4 devices each) run EP forward + backward on a 2 × 4 mesh; the
result must equal the single-process dense reference. Bounded by timeouts so it never hangs."""

import importlib.util
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import experts_dense
from k3jax.sharding.expert_parallel import ExpertParallel
from k3jax.sharding.mesh import make_mesh
from k3jax.testing import TOL, assert_close, free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_multihost_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("ep_multihost_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.multiprocess
def test_two_process_ep_matches_single_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"worker {i} failed (rc {p.returncode}):\n" + (logs[i][-3000:] if i < len(logs)
                                                                                 else "")
    res = [dict(np.load(tmp_path / f"proc{i}.npz")) for i in range(2)]

    w = _worker_module()
    z, ids, wts, w1, w3, w2 = (jnp.asarray(x) for x in w.problem())
    act = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
    argnums = (0, 2, 3, 4, 5)
    (ref_loss, ref_y), ref_g = jax.value_and_grad(w.loss_fn(experts_dense, act), argnums=argnums, has_aux=True)(
        z, ids, wts, w1, w3, w2)
    ep = ExpertParallel(make_mesh({"data": 2, "expert": 4}), "ep")
    (_, sp_y), sp_g = jax.jit(jax.value_and_grad(w.loss_fn(ep, act), argnums=argnums, has_aux=True))(
        z, ids, wts, w1, w3, w2)
    for r in res:
        assert_close(r["y"], ref_y, TOL["fp32_shallow"], name="multi-process y vs dense")
        assert_close(r["y"], sp_y, TOL["fp32_shallow"], name="multi-process y vs single-process EP")
        assert_close(r["loss"], ref_loss, TOL["fp32_shallow"], name="loss")
        for i in range(len(argnums)):
            assert_close(r[f"g{i}"], ref_g[i], TOL["fp32_vs_fp64"], name=f"grad {i} vs dense")
            assert_close(r[f"g{i}"], sp_g[i], TOL["fp32_vs_fp64"], name=f"grad {i} vs single-process EP")
    np.testing.assert_array_equal(res[0]["y"], res[1]["y"])
