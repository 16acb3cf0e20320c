"""Hydra callbacks the root config declares (``hydra.callbacks`` in conf/config.yaml)."""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback

from pipeline import interrupts


class StartUpOver(Callback):
    """Hydra's start-up ends where the run or the sweep starts. ``_main`` runs Hydra inside
    :func:`interrupts.recorded`: a signal while Hydra composes the config would become OmegaConf's error and
    Hydra would print its traceback. From here a signal raises again (a sweep's parent waiting on its jobs
    included), and one recorded during the start-up raises now."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        interrupts.start_up_over()

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        interrupts.start_up_over()
