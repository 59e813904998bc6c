"""What a training run writes to its ``--metrics`` JSONL file, one record per line (appended, flushed each line):

    {"event": "start", "step", "devices", "mesh", "strategy", "param_bytes_per_device", ...}   once per (re)start
    {"event": "compile", "lower_s", "compile_s", "argument_bytes_per_device", ...}            the first step's compile
    {"step", "loss", "total_loss", "grad_norm", "finite", "lr", "tokens_per_s", "mfu", ...}    every step
    {"event": "eval", "step": 0, "eval_loss"}                                                 --eval-at-start
    {"event": "sigterm" | "sigint", "step", "checkpoint"}                                     stopped by a signal

A re-run of a finished run takes no step and writes nothing.

The records are built here from plain values (the step's device metrics, the compiled step, byte counts), so the
loop only decides when to write them; so is the line printed every --log-every steps when no progress bar is shown
(``progress_line``).
"""

from __future__ import annotations

import json
import time

import numpy as np


class MetricsFile:
    """The run's JSONL file (``path`` None: writes nothing) and, with ``tensorboard``, TensorBoard event files in
    that directory beside it (tensorboardX's SummaryWriter: every numeric field of a record with a step, as the
    scalar ``EVENT/FIELD``, EVENT "train" for step records)."""

    def __init__(self, path: str | None, *, tensorboard: str | None = None):
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (closed by close())
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # loaded only for a run that asks for event files

            self._tb = SummaryWriter(tensorboard)

    def write(self, rec: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()
        if self._tb is not None and isinstance(rec.get("step"), int):
            kind = rec.get("event", "train")
            for k, v in rec.items():
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", v, rec["step"])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def to_json(x):
    """A device or NumPy value as a JSON number or (nested) list."""
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def step_record(m: dict, step: int, dt: float, *, tokens: int, lr: float, flops_per_token: float | None,
                peak_flops: float | None) -> dict:
    """The record of (1-based) ``step`` from the step's metrics ``m`` (host values), its wall time ``dt`` and the
    ``tokens`` it trained on; MFU when the FLOPs per token and the peak are known."""
    tps = tokens / dt
    clipped = np.argwhere(m["qk_clipped"])
    return {"step": step, "loss": float(m["ce"]), "total_loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "finite": bool(m["finite"]), "lr": float(lr), "tokens_per_s": tps,
            "mfu": flops_per_token * tps / peak_flops if peak_flops else None,
            "load_max_over_mean": to_json(m["load_ratio"]), "qb_bias_range": to_json(m["bias_range"]),
            "mla_max_logit": to_json(np.max(m["max_logit"], axis=-1)) if m["max_logit"].size else [],
            "qk_clip_events": [[int(i), int(h), float(m["max_logit"][i, h])] for i, h in clipped]}


def compile_ahead(jitted, *args) -> tuple[object, dict]:
    """(the compiled function, its ``compile`` record): lower and compile seconds and the compiler's per-device
    argument / output / temporary bytes (when the backend reports them)."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    mem = {} if ma is None else {"argument_bytes_per_device": int(ma.argument_size_in_bytes),
                                 "output_bytes_per_device": int(ma.output_size_in_bytes),
                                 "temp_bytes_per_device": int(ma.temp_size_in_bytes)}
    return compiled, {"event": "compile", "lower_s": t1 - t0, "compile_s": t2 - t1, **mem}


def compile_summary(rec: dict, mesh: str, strategy: str) -> str:
    """The one log line of a ``compile`` record (with the placed state's ``param_bytes_per_device`` and
    ``opt_state_bytes_per_device`` added to it)."""
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    mem = (f"{mib(rec['argument_bytes_per_device'])} arguments, {mib(rec['temp_bytes_per_device'])} temporaries; "
           if "argument_bytes_per_device" in rec else "")
    return (f"train step compiled in {rec['lower_s'] + rec['compile_s']:.1f} s (lower {rec['lower_s']:.1f} s) on "
            f"mesh {mesh} ({strategy}): per device {mem}parameters {mib(rec['param_bytes_per_device'])}, "
            f"optimizer state {mib(rec['opt_state_bytes_per_device'])}")


def progress_line(step: int, steps: int, loss: float, *, tokens_per_s: float, eta_s: float) -> str:
    """The --log-every line: ``step 10/300: loss 3.2145, 1,234 tokens/s, eta 0:05:12``."""
    eta = int(round(eta_s))
    return (f"step {step}/{steps}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s, "
            f"eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")


__all__ = ["MetricsFile", "compile_ahead", "compile_summary", "progress_line", "step_record", "to_json"]
