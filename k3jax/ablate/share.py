"""One `k3 ablate` study spread over N workers that share its output directory (`k3 ablate FILE --out DIR --worker
I/N`): which worker trains which run, which worker writes the files several runs share, and how a worker waits for
what another one writes.

    share = parse_worker("1/4")                       # Share(index=1, count=4); bad text: InputError naming --worker
    mine = share.mine("budgets/b0", jobs)             # this worker's runs of that phase, in the phase's order
    recs = wait_until(probe, "tune/b0", share=share, log=print)   # polls until probe() has its value

A study is a sequence of phases, each one directory of runs listed in a fixed order: a plain ablation's grid is one
phase ("", ``runner.grid``'s seed-major order); a scaling study has per budget its tuning runs ("tune/<budget>", in
file order) and its grid ("budgets/<budget>"), which needs its tuning phase complete. The assignment:

1. run k of phase P goes to worker (k + h(P)) mod N, with h(P) = sha256(P) mod N;
2. so every worker gets floor(n / N) or ceil(n / N) of each phase's n runs, and which workers get a phase's extra
   runs changes from phase to phase (a study of many small phases does not load worker 0 with every extra run);
3. it depends on the file and N only: a worker re-run with the same I/N gets the same share and resumes it;
4. the files a phase's runs share (init_plan.json and seeds/seed-<s>.npz, ``k3jax.ablate.same_init``) are written
   by the worker of run 0 (``owns_shared``) before it trains anything; every other worker waits for them.

Waiting is polling: a look at the directory, then a sleep that doubles from half a second up to ``poll_s``, with a
log line whenever what is missing changes; ``timeout_s`` (default: none) ends the wait with ``IncompleteError``.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from k3jax.errors import InputError

FIRST_SLEEP_S = 0.5


class IncompleteError(RuntimeError):
    """Runs or shared files a command needs are not in the output directory: a report asked for before every run
    finished (``--report-only``), or a worker that gave up waiting for another worker (its ``timeout_s``)."""


@dataclass(frozen=True)
class Share:
    """Worker ``index`` of ``count`` (``parse_worker``); ``poll_s``: the longest sleep between two looks at the
    directory; ``timeout_s``: how long one wait may last (None: as long as it takes)."""

    index: int
    count: int
    poll_s: float = 10.0
    timeout_s: float | None = None

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def worker_of(self, phase: str, k: int) -> int:
        """The worker that trains run ``k`` of ``phase`` (steps 1-2 of the module docstring)."""
        offset = int.from_bytes(hashlib.sha256(phase.encode()).digest()[:8], "big") % self.count
        return (k + offset) % self.count

    def mine(self, phase: str, jobs: list) -> list:
        """This worker's runs among ``jobs`` (a phase's runs in its order), in that order."""
        return [j for k, j in enumerate(jobs) if self.worker_of(phase, k) == self.index]

    def owns_shared(self, phase: str) -> bool:
        """Whether this worker writes ``phase``'s shared files (the worker of its run 0)."""
        return self.worker_of(phase, 0) == self.index


def parse_worker(text: str) -> Share:
    """``--worker I/N`` as a Share; anything but two integers with 0 <= I < N is an InputError naming --worker."""
    m = re.fullmatch(r"\s*(-?\d+)\s*/\s*(-?\d+)\s*", text or "")
    if m is None:
        raise InputError(f"--worker {text!r}: expected I/N, this worker's index and the number of workers "
                         "(e.g. --worker 0/4)")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1:
        raise InputError(f"--worker {text}: N = {n}, the number of workers, must be at least 1")
    if not 0 <= i < n:
        raise InputError(f"--worker {text}: I = {i} must be in [0, {n}) (workers are numbered from 0)")
    return Share(i, n)


def wait_until[T](probe: Callable[[], tuple[T | None, str]], what: str, *, share: Share,
                  log: Callable[[str], None], sleep: Callable[[float], None] = time.sleep) -> T:
    """Poll ``probe`` until it returns a value: it returns (value or None, what is still missing, in words). Logs
    one line when the wait starts and one whenever the missing part changes; raises ``IncompleteError`` after
    ``share.timeout_s``."""
    t0 = time.monotonic()
    nap, said = min(FIRST_SLEEP_S, share.poll_s), None
    while True:
        value, missing = probe()
        if value is not None:
            if said is not None:
                log(f"[worker {share.label}] {what}: ready after {time.monotonic() - t0:.0f} s")
            return value
        waited = time.monotonic() - t0
        if share.timeout_s is not None and waited >= share.timeout_s:
            raise IncompleteError(f"worker {share.label}: gave up after {waited:.0f} s (--wait-timeout) waiting "
                                  f"for {what}: {missing}; re-run the same command to continue")
        if missing != said:
            log(f"[worker {share.label}] waiting for {what}: {missing}; looking again every {share.poll_s:g} s "
                "at most")
            said = missing
        sleep(nap if share.timeout_s is None else max(0.0, min(nap, share.timeout_s - waited)))
        nap = min(2 * nap, share.poll_s)


__all__ = ["FIRST_SLEEP_S", "IncompleteError", "Share", "parse_worker", "wait_until"]
