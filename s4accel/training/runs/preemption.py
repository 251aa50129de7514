"""SIGTERM / SIGINT -> a flag the loop checks once per step, so a preempted run saves a checkpoint and exits 0.

Clusters send SIGTERM before they take a machine back (SLURM, Kubernetes; `accelerate launch`/torchrun forward it
to every worker), and Ctrl-C sends SIGINT to every process of the group. The handler only records the signal; the
loop agrees on it across processes (any process that got it stops them all) at its next check. A second SIGINT
while the first is being handled raises KeyboardInterrupt at once, for a user who does not want to wait; so does a
SIGTERM (or SIGINT) that comes `REPEAT_AFTER_S` seconds or more after the first signal: the way out of a run stuck
where the loop never gets to check (a data read that never returns), which a first SIGTERM alone would leave running
until the cluster's SIGKILL. A SIGTERM right behind the first signal is the same request delivered twice (a cluster
signals every process of the job and the launcher forwards it again; after Ctrl-C the launcher sends SIGTERM) and
only records it, so the preemption checkpoint is still written; so does one right behind it once the loop has
ended, until the process has said where the checkpoint is. The last complete checkpoint is kept either way.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time


class StopSignals:
    """Context manager installing the handlers (main thread only; elsewhere it does nothing)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    REPEAT_AFTER_S = 5.0
    """A signal this long after the first is a second request (stop now), not the first delivered twice."""

    def __init__(self):
        self.received: str | None = None
        self._first_at: float | None = None
        self._previous: dict = {}

    def interrupted(self) -> bool:
        """Whether a signal has arrived on this process (the loop agrees on it across processes)."""
        return self.received is not None

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.received is not None and (signum == signal.SIGINT and self.received == "SIGINT"
                                          or now - self._first_at >= self.REPEAT_AFTER_S):
            raise KeyboardInterrupt
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum).name, now

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
            if "LOCAL_RANK" in os.environ:  # started by a launcher (torchrun, accelerate launch)
                sigterm_when_the_launcher_dies()
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            # After a stop signal, more of the same request may still be on their way, and the process must live to
            # say where its checkpoint is: a worker whose launcher was killed gets SIGTERM once for each thread of
            # the launcher that dies (Linux sends the parent-death signal each time it moves the orphan on to the
            # next thread). Those are swallowed for REPEAT_AFTER_S; a later signal meets the previous handler.
            signal.signal(s, handler if self.received is None else functools.partial(self._after, handler))
        self._previous = {}
        return False

    def _after(self, previous, signum, frame):
        if time.monotonic() - self._first_at < self.REPEAT_AFTER_S:
            return
        previous = signal.SIG_DFL if previous is None else previous
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # its default action, now that the default is back


def sigterm_when_the_launcher_dies() -> None:
    """Ask Linux to send this process SIGTERM when its parent, the launcher, dies (`PR_SET_PDEATHSIG`): a launcher
    killed with SIGKILL forwards nothing, and its workers would train on with no one to stop or collect them. The
    SIGTERM stops the run as a preemption does: a checkpoint, then exit. Elsewhere (no prctl) nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request was made: the signal will never come
        os.kill(os.getpid(), signal.SIGTERM)
