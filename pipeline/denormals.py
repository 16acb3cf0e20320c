"""Denormal floats flushed to zero: the tails of a softmax over 1,024 keys are denormal, and x86 computes
them about a hundred times slower unless the thread's MXCSR flushes them (FTZ) and reads them as zero
(DAZ). The readings do not change; the time does (an encoder 175 -> 46 ms on one CPU, 224 -> 94 ms for
the float original; docs/export.md).

The mode is per thread and sticky: ONNX Runtime's ``session.set_denormal_as_zero`` sets a session's
own pool threads, and the thread that creates the process's *first* session (never clears it, never
again for a later session); ``torch.set_flush_denormal`` sets the calling thread; a thread starts with
its creator's mode. So a package sets the mode of the thread that reads with it (:func:`set_thread`),
whichever thread that is (a serving worker, a Ray actor's, Triton's). Torch-free: the MacaRT and Triton
side environments import it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import sys
from typing import Iterator

import numpy as np

# the ONNX Runtime session config entry (ORT >= 1.5; onnxruntime 1.12, MacaRT's base, has it)
SESSION_ENTRY = "session.set_denormal_as_zero"

_TINY = np.array([1e-40], dtype=np.float32)  # a denormal float32


def flushing() -> bool:
    """Whether this thread reads denormals as zero (numpy computes on the calling thread)."""
    return bool((_TINY * np.float32(1.0))[0] == 0.0)


def set_thread(flush: bool) -> bool:
    """This thread's mode: ``flush`` True sets FTZ/DAZ, False clears them (x86-64 Linux: the MXCSR through
    the C library's fegetenv/fesetenv; elsewhere through torch where it is imported). Returns whether the
    thread now flushes as asked. ONNX Runtime cannot do it: only the first session of a process sets the
    thread that creates it (``std::call_once`` in its session init)."""
    if flushing() == flush:
        return True
    if not _set_mxcsr(flush):
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_flush_denormal(flush)
    return flushing() == flush


# x86-64 MXCSR: FTZ (flush results to zero, bit 15) and DAZ (read denormal inputs as zero, bit 6)
_FTZ_DAZ = 0x8040
_MXCSR_OFFSET = 28  # glibc's x86-64 fenv_t: the x87 environment (28 bytes), then __mxcsr (4 bytes)


@functools.lru_cache(maxsize=1)
def _libm():
    """The C math library, where glibc's fenv functions are (x86-64 Linux only; None elsewhere)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    import ctypes.util

    name = ctypes.util.find_library("m")
    return ctypes.CDLL(name) if name else None


def _set_mxcsr(flush: bool) -> bool:
    libm = _libm()
    if libm is None:
        return False
    env = (ctypes.c_ubyte * 32)()
    if libm.fegetenv(ctypes.byref(env)) != 0:
        return False
    mxcsr = int.from_bytes(bytes(env[_MXCSR_OFFSET:_MXCSR_OFFSET + 4]), "little")
    mxcsr = (mxcsr | _FTZ_DAZ) if flush else (mxcsr & ~_FTZ_DAZ)
    env[_MXCSR_OFFSET:_MXCSR_OFFSET + 4] = list(mxcsr.to_bytes(4, "little"))
    return libm.fesetenv(ctypes.byref(env)) == 0


@contextlib.contextmanager
def thread_mode(flush: bool) -> Iterator[bool]:
    """This thread in ``flush``'s mode for the block, back to its own after it; yields whether the mode
    could be set (clearing needs torch)."""
    before = flushing()
    done = set_thread(flush)
    try:
        yield done
    finally:
        set_thread(before)
