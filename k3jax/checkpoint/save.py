"""Write k3jax params back in the official K3 checkpoint layout, byte-exactly (docs/checkpoint.md §11.5–11.7, §11.9).

    save(params, cfg, "out/")          # model-00001-of-000010.safetensors ... + index + config.json

- One decoder layer per shard (shard k = layer k-1), the model-level tensors in shard L+1; file names
  ``model-{k:05d}-of-{total:06d}.safetensors`` (six-digit total). For the full K3 config the total is 96 and the two
  vision shards are copied byte for byte from ``vision_from`` when given.
- Headers come from ``safetensors_layout.shard_layout``: compact JSON, dtype rank then byte order of names, space
  padding to 8 bytes, no ``__metadata__``; data contiguous in header order.
- Routed experts are written as compressed-tensors MXFP4 (``weight_packed`` + ``weight_scale``) when
  ``expert_format == "mxfp4"``, packed with the "even" scale rule — or, for a model trained with QAT on another
  rule, that rule (``scale_rule``; ``export_trained`` passes the run's ``qat_weight_rule``); already-packed leaves
  (``w1_packed`` / ``w1_scale``, as returned by ``load(..., keep_experts_packed=True)``) are written as they are.
- ``model.safetensors.index.json``: indent 2, no trailing newline, ``metadata.total_size`` = payload bytes, keys in
  byte order. ``config.json``: indent 2, sorted keys, no trailing newline (the release's format).
- Everything is written into a temporary sibling directory that is renamed into place only when complete
  (``k3jax.checkpoint.atomic``): a failed save leaves an existing ``out_dir`` as it was.
- In a multi-process (``jax.distributed``) run, or with arrays this process cannot address whole, every process calls
  ``save`` and writes only the tensors it holds into the shared directory (``save_dist``); the bytes are the
  single-process ``save``'s.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint import save_dist
from k3jax.checkpoint.atomic import check_out_dir, sibling, staged_dir
from k3jax.checkpoint.container import INDEX_NAME, MANIFEST_NAME, read_header, sha256_file
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.safetensors_layout import shard_file_name, shard_layout
from k3jax.config import K3Config, RunConfig, architecture, from_hf, to_hf_dict
from k3jax.distributed import any_process, barrier
from k3jax.layers.experts import PACKED_PARTS, holds_packed, packed_name
from k3jax.model import leaf_location
from k3jax.model.functional import packed_expert_paths
from k3jax.pytree import get_path
from k3jax.quant import pack_experts

# ------------------------------------------------------------------------------------------------- config.json

def _preset_json(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "presets", f"{name}.config.json")


def config_json(cfg: K3Config) -> bytes:
    """HF ``config.json`` bytes that ``k3jax.config.from_hf`` parses back to ``cfg``'s architecture.

    For the kimi-k3 / kimi-linear-48b architectures the shipped preset files are returned byte for byte (the
    release's config); otherwise the dict from the key table (``k3jax.config.to_hf_dict``), with the release's
    ``quantization_config`` block for MXFP4 experts.
    """
    for preset in ("kimi-k3", "kimi-linear-48b"):
        p = _preset_json(preset)
        if os.path.exists(p) and architecture(from_hf(p)) == architecture(cfg):
            with open(p, "rb") as f:
                return f.read()
    qc = None
    if cfg.expert_format == "mxfp4":
        with open(_preset_json("kimi-k3"), encoding="utf-8") as f:
            qc = json.load(f)["text_config"]["quantization_config"]
    return json.dumps(to_hf_dict(cfg, qc), indent=2, sort_keys=True).encode("utf-8")


# ------------------------------------------------------------------------------------------------------ values

def _host(x) -> np.ndarray:
    return np.asarray(x)


class _ShardValues:
    """Per-shard conversion k3jax leaf → HF tensor bytes; each expert stack is packed once per shard, float stacks
    with the scale rule ``rule``.

    Specs address the per-layer view (``("layers", l, ...)``); a stacked leaf is read once to host and row l taken
    from it (a numpy view)."""

    def __init__(self, params, cfg: K3Config, rule: str = "even"):
        self.params, self.cfg, self.rule = params, cfg, rule
        self._packed: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._hosts: dict[tuple, np.ndarray] = {}

    def _view(self, path: tuple) -> np.ndarray:
        """Host value of the per-layer-view leaf ``path``."""
        spath, g = leaf_location(path, self.cfg)
        if spath not in self._hosts:
            self._hosts[spath] = _host(get_path(self.params, spath))
        x = self._hosts[spath]
        return x if g is None else x[g]

    def get(self, spec: nm.TensorSpec) -> np.ndarray:
        if spec.transform == "mxfp4":
            path = spec.path
            if path not in self._packed:
                experts = get_path(self.params, leaf_location(path[:-1], self.cfg)[0])
                w = path[-1]
                if holds_packed(experts):
                    self._packed[path] = tuple(
                        self._view((*path[:-1], packed_name(w, part))).astype(np.uint8, copy=False)
                        for part in PACKED_PARTS)
                else:  # the run's QAT grid; "even" = compressed-tensors (docs/numerics.md §10.2–10.3)
                    p, s = pack_experts(self._view(path), rule=self.rule, name=spec.name)
                    self._packed[path] = (np.asarray(p, np.uint8), np.asarray(s, np.uint8))
            p, s = self._packed[path]
            return p[spec.expert] if spec.part == "packed" else s[spec.expert]
        value = self._view(spec.path)
        try:
            return nm.leaf_to_hf(value, spec)
        except ValueError as e:
            raise CheckpointError(f"cannot convert leaf {'/'.join(map(str, spec.path))}: {e}",
                                  tensor=spec.name) from None


# -------------------------------------------------------------------------------------------------------- save

def write_shard(path: str, specs: list, values) -> int:
    """Write one safetensors file at ``path`` holding ``specs`` (name-map ``TensorSpec``s) in the official header
    layout, each tensor's bytes from ``values.get(spec)`` (a shard's leaves, or a dict of adapter tensors).
    Returns its payload bytes."""
    lay = shard_layout((s.name, s.dtype, s.shape) for s in specs)
    by_name = {s.name: s for s in specs}
    with open(path, "wb") as f:
        f.write(lay.prefix())
        for name in lay.names:
            s = by_name[name]
            a = np.ascontiguousarray(values.get(s))
            if a.dtype != nm.np_dtype(s.dtype) or tuple(a.shape) != tuple(s.shape):
                raise CheckpointError(f"value {a.dtype}{list(a.shape)} does not match {s.dtype}{list(s.shape)}",
                                      tensor=name)
            f.write(a.view(np.uint8).reshape(-1).data)
    if os.path.getsize(path) != lay.file_bytes:
        raise CheckpointError(f"wrote {os.path.getsize(path)} bytes, expected {lay.file_bytes}", file=path)
    return lay.payload_bytes


def index_json(weight_map: dict[str, str], total_size: int) -> bytes:
    """The release's index format: indent 2, no trailing newline, metadata = {total_size}, keys in byte order."""
    wm = {k: weight_map[k] for k in sorted(weight_map, key=lambda n: n.encode("utf-8"))}
    return json.dumps({"metadata": {"total_size": int(total_size)}, "weight_map": wm}, indent=2).encode("utf-8")


def save(params, cfg: K3Config, out_dir, *, layout: str | None = None, expert_format: str | None = None,
         vision_from: str | None = None, overwrite: bool = False, manifest: bool = False,
         progress: bool = False, scale_rule: str = "even") -> dict:
    """Write ``params`` (the k3jax tree for ``cfg``) as an official-layout checkpoint at ``out_dir``.

    Args:
      params: nested dict of arrays (jax or numpy), as from ``init_params`` or ``load``; in a multi-process run,
        the global arrays, with every process calling ``save`` (each writes the tensors it holds; module doc).
      cfg: its config; ``expert_format`` defaults to ``cfg.expert_format``.
      out_dir: created atomically (temp dir + rename). An existing one is replaced only with ``overwrite=True``.
      vision_from: for the full K3 config, a release directory whose vision shards are copied byte for byte.
      manifest: also write ``SHA256SUMS`` (checked by ``load(..., verify=True)``).
      scale_rule: the MXFP4 scale rule float expert stacks are packed with (docs/numerics.md §10.2): "even", the
        release's (compressed-tensors) bytes, unless the model trained on another QAT grid (``export_trained``).
        Experts held packed are written as they are.
    Returns: {"files": [...], "total_size": payload bytes, "dir": out_dir}.
    """
    layout = layout or nm.default_layout(cfg)
    fmt = expert_format or cfg.expert_format
    out_dir = check_out_dir(out_dir, overwrite=overwrite)
    dist = save_dist.needs_distributed(params)
    tmp = None
    if dist:  # every process writes its own tensors into one directory (k3jax/checkpoint/save_dist.py)
        tmp = sibling(out_dir, "dist")
        if jax.process_index() == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp)  # a previous distributed save that died
        barrier(f"k3jax save: start {out_dir}")
        if jax.process_index() != 0:  # process 0 alone renames the directory into place
            shards = list(nm.shard_tensors(cfg, layout, fmt))
            weight_map, total_size, files = save_dist.write_shards(params, cfg, tmp, shards, scale_rule)
            barrier(f"k3jax save: done {out_dir}")
            if any_process(False):
                raise CheckpointError("process 0 failed to finish the checkpoint", file=out_dir)
            return {"dir": out_dir, "files": files, "total_size": total_size}
    failed = written = False
    try:
        with staged_dir(out_dir, overwrite=overwrite, tmp=tmp) as tmp:
            shards = nm.shard_tensors(cfg, layout, fmt)
            total = nm.num_shards(cfg, layout)
            if dist:
                # (raises in every process alike when a process failed: then no final barrier is owed)
                weight_map, total_size, files = save_dist.write_shards(params, cfg, tmp, list(shards), scale_rule)
                written = True
            else:
                weight_map, total_size, files = {}, 0, []
                it = shards
                if progress:
                    from tqdm import tqdm  # only for a progress bar; not loaded otherwise
                    it = tqdm(shards, desc="save", unit="shard")
                for fname, specs in it:
                    total_size += write_shard(os.path.join(tmp, fname), specs, _ShardValues(params, cfg, scale_rule))
                    weight_map.update((s.name, fname) for s in specs)
                    files.append(fname)
            if nm.has_vision_shards(cfg, layout) and vision_from is not None:
                for k in range(cfg.num_layers + 2, total + 1):
                    fname = shard_file_name(k, total)
                    src = os.path.join(os.fspath(vision_from), fname)
                    h = read_header(src, fname)
                    shutil.copyfile(src, os.path.join(tmp, fname))
                    total_size += sum(e.nbytes for e in h.entries.values())
                    weight_map.update((n, fname) for n in h.entries)
                    files.append(fname)
            with open(os.path.join(tmp, INDEX_NAME), "wb") as f:
                f.write(index_json(weight_map, total_size))
            with open(os.path.join(tmp, "config.json"), "wb") as f:
                f.write(config_json(cfg.replace(expert_format=fmt)))
            if manifest:
                with open(os.path.join(tmp, MANIFEST_NAME), "w", encoding="utf-8") as f:
                    f.writelines(f"{sha256_file(os.path.join(tmp, n))}  {n}\n" for n in files)
    except BaseException:
        failed = True
        raise
    finally:
        if dist and written:  # process 0 tells the others whether the directory is in place
            barrier(f"k3jax save: done {out_dir}")
            any_process(failed)
    return {"dir": out_dir, "files": files, "total_size": total_size}


def export_trained(params, cfg: K3Config, settings: RunConfig, out_dir: str, *, overwrite: bool = False) -> dict:
    """A trained model in the official layout (``save``'s summary plus its ``expert_format``), given the run
    settings it trained with: packed MXFP4 experts when the run trained with QAT — on the grid it trained on, its
    ``qat_weight_rule`` (the fake-quant grid is the export grid) — or held them packed (a frozen-expert run: written
    as their own bytes), BF16 otherwise. An existing non-empty ``out_dir`` is replaced only with ``overwrite``."""
    fmt = "mxfp4" if settings.qat != "off" or packed_expert_paths(params) else "bf16"
    rule = settings.qat_weight_rule if settings.qat != "off" else "even"
    # a job of several processes writes what each holds (k3jax/checkpoint/save_dist.py): nothing is gathered whole
    params = params if save_dist.needs_distributed(params) else jax.device_get(params)
    r = save(params, cfg.replace(expert_format=fmt), out_dir, overwrite=overwrite, scale_rule=rule)
    r["expert_format"] = fmt
    return r


__all__ = ["config_json", "export_trained", "index_json", "save", "write_shard"]
