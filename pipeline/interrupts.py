"""SIGTERM and Ctrl-C: remembered in a flag that the publish step checks, so no run publishes after a signal.

Raising ``KeyboardInterrupt`` from the handler unwinds the run at once in plain Python code, but a
native library that calls back into Python (tracing, pybind11 conversions) can swallow it and keep
going; the flag outlives that. :func:`publishing` is the commit point of an artifact folder: a
signal seen before it refuses the publish, a signal during it is deferred until the rename is done.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator

from pipeline.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []   # signals seen by this process, in order
_publishing = False         # inside a folder swap: the handler only records
_published: list[str] = []  # folders this process has swapped into place, in order


def _importing(frame) -> bool:
    """Whether the signal landed inside an import: a native module's initialisation that calls back into
    Python (pybind11 building its enums) cannot carry an exception out and aborts the process
    ("terminate called ..."); there the handler only records, and the next :func:`check` raises."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _handler(signum, frame) -> None:
    _received.append(signum)
    if not _publishing and not _importing(frame):
        raise KeyboardInterrupt


def _unraisable(unraisable) -> None:
    """The handler's ``KeyboardInterrupt`` raised inside a ``__del__`` or a callback cannot propagate:
    Python would print it as "Exception ignored in ..." with a traceback (seen: tqdm's ``__del__``).
    The flag carries the signal on, so the run still ends in one line; anything else is printed."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _received:
        return
    sys.__unraisablehook__(unraisable)


def install() -> bool:
    """Route SIGINT and SIGTERM through the flag (main thread only; False where that is impossible).
    A run starts here: what an earlier run in this process published is not this run's."""
    _published.clear()
    try:
        for sig in SIGNALS:
            signal.signal(sig, _handler)
    except ValueError:  # not the main thread of this process: leave the handlers alone
        return False
    sys.unraisablehook = _unraisable
    return True


def finished() -> None:
    """The run is over (published or failed): a later signal ends the process by the system's default
    action, silently, instead of raising inside interpreter shutdown (atexit callbacks print tracebacks)."""
    try:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
    except ValueError:  # not the main thread
        pass


def received() -> bool:
    return bool(_received)


def reset() -> None:
    """Forget earlier signals and publishes (tests that run stages in-process)."""
    _received.clear()
    _published.clear()


def message(where: str = "") -> str:
    """The one line an interrupted run ends with, naming the first signal seen and, when the run had
    already swapped folders into place (a signal after a stage's publish, or in a later stage of
    ``stage=all``), those folders: they are new, what came after them is untouched."""
    name = f" ({signal.Signals(_received[0]).name})" if _received else ""
    head = f"interrupted{name}{' ' + where if where else ''}"
    if _published:
        done = _published[0] if len(_published) == 1 else f"{len(_published)} folders, the last {_published[-1]}"
        return f"{head}; it had published {done}; nothing else changed"
    return f"{head}; previous artifacts left as they were"


def check(where: str = "") -> None:
    """Raise :class:`Interrupted` when a signal has been seen."""
    if _received:
        raise Interrupted(message(where))


@contextlib.contextmanager
def publishing(what: str) -> Iterator[None]:
    """The commit point: refuse when a signal came first; defer one that comes during the block."""
    global _publishing
    check(f"before publishing {what}")
    seen = len(_received)
    _publishing = True
    try:
        yield
    finally:
        _publishing = False
    _published.append(what)
    if len(_received) > seen:  # the signal came during the swap: it is done, stop right after it
        name = signal.Signals(_received[seen]).name
        raise Interrupted(f"interrupted ({name}) while publishing {what}, which is now the new folder; "
                          f"nothing after it ran")


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """A signal during the block is only recorded (the next :func:`check` raises): for a step whose
    result must be in hand before it can be undone (a temporary folder: made, then cleaned on failure)."""
    global _publishing
    before = _publishing
    _publishing = True
    try:
        yield
    finally:
        _publishing = before


def start_up_over() -> None:
    """Hydra's own start-up, which ``_main`` runs inside :func:`recorded`, is over (the run or the sweep
    starts: :class:`pipeline.hydra_hooks.StartUpOver`): a signal raises again, one recorded during it now."""
    global _publishing
    _publishing = False
    if _received:  # Hydra turns an exception from a callback into a warning; KeyboardInterrupt passes
        raise KeyboardInterrupt


def worker_init() -> None:
    """Process-pool workers: the parent alone handles Ctrl-C (the whole process group gets it) and a
    SIGTERM from the pool's own terminate() ends a worker silently, never with a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
