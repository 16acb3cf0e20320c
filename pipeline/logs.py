"""Logging for a run (``conf/hydra/job_logging/pipeline.yaml``): INFO on stdout, warnings on stderr.

Library modules log through ``logging.getLogger(__name__)``; only the CLI configures handlers."""
from __future__ import annotations

import logging


class BelowWarning(logging.Filter):
    """Passes records below WARNING: the stdout handler's share (warnings go to stderr)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING
