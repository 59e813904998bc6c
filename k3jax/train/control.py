"""Run control: SIGTERM and Ctrl-C, agreed by every process of a job.

    with Stop(sigint=True) as stop:
        ...                           # a step
        if stop.poll():               # True in every process at the same step once any process was signalled
            save and return

A signal sets a flag in the process that receives it; ``poll`` (called once per step by every process) makes it
every process's with one small all-gather (``k3jax.distributed.any_process``), so a SIGTERM to any one process of a
job makes all of them finish the same step, save one checkpoint together and exit 0.
"""

from __future__ import annotations

import signal

from k3jax import distributed


class Stop:
    """``with Stop(sigint) as stop``: ``stop.hit`` becomes "sigterm" on SIGTERM — and, with ``sigint``, "sigint"
    on SIGINT (Ctrl-C) — and the loop then finishes its step, saves a checkpoint and returns. A second SIGINT raises
    KeyboardInterrupt at once. The previous handlers are restored on exit; a SIGINT the process ignores (a
    background job) stays ignored."""

    NAMES = {signal.SIGTERM: "sigterm", signal.SIGINT: "sigint"}

    def __init__(self, sigint: bool = False):
        self.sigint = sigint
        self.hit: str | None = None  # this process's signal
        self.agreed: str | None = None  # the stop every process agreed on (``poll``)
        self.prev: dict = {}

    def _on(self, signum, frame):
        if signum == signal.SIGINT and self.hit is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now
        self.hit = self.hit or self.NAMES[signum]

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT) if self.sigint else (signal.SIGTERM,):
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            try:
                self.prev[sig] = signal.signal(sig, self._on)
            except ValueError:  # not the main thread: no handler (the run is then only stopped by its caller)
                break
        return self

    def __exit__(self, *exc):
        for sig, handler in self.prev.items():
            signal.signal(sig, handler)

    def poll(self) -> str | None:
        """The stop every process agrees on after this step: this process's own signal ("sigterm" / "sigint"), or
        "sigterm" when only another process was signalled; None to go on. Every process calls it at each step."""
        mine = self.hit  # read once: a signal arriving during the all-gather counts at the next step, everywhere
        if self.agreed is None and distributed.any_process(mine is not None):
            self.agreed = mine or "sigterm"
        return self.agreed


__all__ = ["Stop"]
