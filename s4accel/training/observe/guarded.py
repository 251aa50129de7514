"""A tracker that cannot stop training: every call runs in the tracker's own thread, retried, bounded in time, and
a tracker that keeps failing is disabled with one warning while the run goes on (`GuardedTracker`)."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import warnings
from collections.abc import Callable

from accelerate.tracking import GeneralTracker, on_main_process


class _Worker:
    """One thread that makes every call of one tracker, in order, so that a call can be waited for with a time limit
    (a hung network call must not hang the run). The same thread each time: trackers keep state per thread (MLflow's
    active run). A daemon: a call that never returns does not keep the process from exiting."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.current: tuple[str, float] | None = None  # (what, since when) the thread is running now
        threading.Thread(target=self._serve, name=f"tracker {name}", daemon=True).start()
        atexit.register(self.drain)  # a run ended by an error still writes the records it logged before

    def _serve(self):
        while True:
            what, call, box, done = self.jobs.get()
            self.current = (what, time.monotonic())
            try:
                box.append((True, call()))
            except BaseException as e:  # handed back to the caller, which decides
                box.append((False, e))
            self.current = None
            done.set()

    def submit(self, what: str, call: Callable[[], object]) -> tuple[list, threading.Event]:
        box, done = [], threading.Event()
        self.jobs.put((what, call, box, done))
        return box, done

    def run(self, what: str, call: Callable[[], object], timeout: float):
        """`call()` in the thread, after the calls submitted before it; TimeoutError after `timeout` seconds."""
        box, done = self.submit(what, call)
        if not done.wait(timeout):
            raise TimeoutError
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def drain(self, timeout: float = 10.0) -> None:
        """Wait, at most `timeout` seconds, for the calls queued so far (not at all behind a call that hangs)."""
        if not self.stuck(1.0):
            self.submit("flush", lambda: None)[1].wait(timeout)

    def stuck(self, timeout: float) -> str | None:
        """What the thread has been running for more than `timeout` seconds, if anything."""
        current = self.current
        return current[0] if current is not None and time.monotonic() - current[1] > timeout else None


class GuardedTracker(GeneralTracker):
    """Runs another tracker so that it cannot stop training. Accelerate calls `start`, then
    `store_init_configuration(config)`: the inner tracker is built (`make(config["run_id"])`) and started at the
    second, since the run's id is read from the checkpoint after the trackers were made. Every call (starting,
    `store_init_configuration`, `log`, `finish`) is tried up to `retries` times with `backoff_s * 2^attempt` seconds
    between tries (a missing package is not retried), after which the tracker is disabled with a warning and later
    calls do nothing. A call that does not return within `timeout_s` disables it at once.

    `log` does not wait: its call is queued for the tracker's thread and training goes on (waiting for the thread
    cost ~0.5 ms a call on a 2-core machine, a few % of a small model's step). When `BACKLOG` calls are waiting (a
    tracker slower than training), `log` waits for its own; `finish` and `flush` wait for every call queued."""

    main_process_only = True
    requires_logging_directory = False
    BACKLOG = 64

    def __init__(self, name: str, make: Callable[[str | None], GeneralTracker], retries: int = 3,
                 backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep, timeout_s: float = 120.0):
        self.name = name
        super().__init__()
        self.make, self.retries, self.backoff_s, self.sleep = make, retries, backoff_s, sleep
        self.timeout_s = timeout_s
        self.inner: GeneralTracker | None = None
        self.disabled = False
        self.worker: _Worker | None = None

    @property
    def tracker(self):
        return self.inner.tracker if self.inner is not None else None

    def _guarded(self, what: str, call: Callable[[], None]) -> None:
        """`call`, tried as `_tries` does, in the tracker's thread; waits for it and the calls queued before it."""
        if self.disabled:
            return
        if self.worker is None:
            self.worker = _Worker(self.name)
        try:
            self.worker.run(what, lambda: self._tries(what, call), self.timeout_s)
        except TimeoutError:  # still running in its thread: nothing more is asked of this tracker
            self._timed_out(self.worker.stuck(0) or what)

    def _timed_out(self, what: str) -> None:
        self.disabled = True
        warnings.warn(f"tracker {self.name!r}: {what} did not return within {self.timeout_s:g}s; disabled, "
                      "training goes on without it", stacklevel=3)

    def _tries(self, what: str, call: Callable[[], None]) -> None:
        """In the tracker's thread: `call`, up to `retries` times; the tracker disabled with a warning if it fails."""
        if self.disabled:
            return
        error = None
        for attempt in range(self.retries):
            try:
                call()
                return
            except ImportError as e:  # the tracker's package is not installed: retrying cannot help
                error = e
                break
            except Exception as e:  # a tracker's own failure (network, disk, server) must not end the run
                error = e
                if attempt + 1 < self.retries:
                    self.sleep(self.backoff_s * 2**attempt)
        self.disabled = True
        if what != "finish" and self.inner is not None:
            try:  # close what it opened (an MLflow run): it failed already
                self.inner.finish()
            except Exception:
                pass
        detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
        warnings.warn(f"tracker {self.name!r}: {what} failed ({type(error).__name__}: {detail}); disabled, "
                      "training goes on without it", stacklevel=2)

    @on_main_process
    def start(self):
        pass  # started with the configuration, which carries the run's id

    @on_main_process
    def store_init_configuration(self, values: dict):
        def start():
            if self.inner is None:
                self.inner = self.make(values.get("run_id"))
            self.inner.start()

        self._guarded("start", start)
        self._guarded("store_init_configuration", lambda: self.inner.store_init_configuration(values))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        if self.disabled:
            return
        if self.worker is None:
            self.worker = _Worker(self.name)
        stuck = self.worker.stuck(self.timeout_s)
        if stuck:
            return self._timed_out(stuck)
        values = dict(values)  # the caller's dict may change once this returns
        if self.worker.jobs.qsize() >= self.BACKLOG:
            return self._guarded("log", lambda: self.inner.log(values, step=step, **kwargs))
        self.worker.submit("log", lambda: self._tries("log", lambda: self.inner.log(values, step=step, **kwargs)))

    def flush(self) -> None:
        """Wait until every call queued so far has run (within `timeout_s`)."""
        if self.worker is not None:
            self._guarded("flush", lambda: None)

    @on_main_process
    def finish(self):
        self._guarded("finish", lambda: self.inner.finish())
