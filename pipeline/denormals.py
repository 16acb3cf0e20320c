"""Denormal floats flushed to zero: the tails of a softmax over 1,024 keys are denormal, and x86 computes
them about a hundred times slower unless the thread's MXCSR flushes them (FTZ) and reads them as zero
(DAZ). The readings do not change; the time does (an encoder 175 -> 46 ms on one CPU, 224 -> 94 ms for
the float original; docs/export.md).

Both switches are per thread and sticky: ONNX Runtime's ``session.set_denormal_as_zero`` sets the
thread that creates the session (and its own pool threads) and never clears it, and
``torch.set_flush_denormal`` sets the calling thread; a thread starts with its creator's mode. So a
package sets the mode of the thread that reads with it (:func:`set_thread`), whichever thread that is
(a serving worker, a Ray actor's, Triton's). Torch-free: the MacaRT and Triton side environments
import it.
"""
from __future__ import annotations

import contextlib
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
    """This thread's mode: ``flush`` True sets FTZ/DAZ, False clears them. Through torch where it is
    imported (both ways), else through an ONNX Runtime session created on this thread (it can only set).
    Returns whether the thread now flushes as asked."""
    if flushing() == flush:
        return True
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_flush_denormal(flush)
    elif flush:
        _ort_flush()
    return flushing() == flush


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


_MODEL: bytes | None = None


def _ort_flush() -> None:
    """ONNX Runtime sets the creating thread's FTZ/DAZ when a session asks for it: a one-node session."""
    global _MODEL
    import onnxruntime as ort

    if _MODEL is None:
        try:
            from onnx import TensorProto, helper
        except ImportError:  # a runtime-only environment: its sessions set the threads that create them
            return

        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "flush",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        _MODEL = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()
    so = ort.SessionOptions()
    so.add_session_config_entry(SESSION_ENTRY, "1")
    so.log_severity_level = 3
    ort.InferenceSession(_MODEL, so, providers=["CPUExecutionProvider"])
