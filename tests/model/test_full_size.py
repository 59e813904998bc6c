"""Full-size Kimi K3 as an NNX module with no memory and no mesh: ``nnx.eval_shape`` of ``K3Model``."""

import json
import os
import subprocess
import sys

_PROBE = r"""
# The kernel's RSS high-water mark survives exec, so a child of a big pytest worker would start at the worker's
# peak: reset it first (Linux clear_refs 5), then read VmHWM at the end.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
import json
import jax
from flax import nnx
from k3jax.config import get_preset
from k3jax.model import K3Model, count_params

model = nnx.eval_shape(lambda: K3Model(get_preset("kimi-k3"), rngs=nnx.Rngs(0)))
state = nnx.state(model, nnx.Param)
leaves = jax.tree.leaves(state)
print(json.dumps({"leaves": len(leaves), "all_sds": all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves),
                  "params": count_params(state), "meshes": len(jax.sharding.get_abstract_mesh().axis_names),
                  "peak_rss": next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                                   if l.startswith("VmHWM:"))}))
"""


def test_full_size_kimi_k3_nnx_eval_shape_no_mesh_under_1gb():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device: no mesh of any size is around
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["all_sds"] and out["leaves"] > 0
    assert out["meshes"] == 0  # no mesh context was needed
    assert out["params"] == 2_779_484_476_000  # docs/checkpoint.md §12.1 (A_log counted as [H], 96 per KDA layer)
    assert out["peak_rss"] < 1 << 30, f"peak RSS {out['peak_rss'] / 2**20:.0f} MiB"
