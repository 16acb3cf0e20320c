"""The errors a user sees: each is printed as a single line, exit code 2 (``pipeline.__main__``).

Library code raises the subclass that says what kind of thing was wrong, with the facts (the file,
the field, the value, the limit); only the CLI turns it into ``error: <message>``.
"""
from contextlib import contextmanager
from typing import Iterator


class PipelineError(Exception):
    """Bad input or a failed check: the message is the whole story, no traceback."""


class ConfigError(PipelineError):
    """A config value is out of range or names something that cannot be (``model.batch_size=0``)."""


class InputError(PipelineError):
    """A file or folder the user gave is missing, unreadable or malformed (a non-UTF-8 formulas file)."""


def check_range(key: str, value, low=None, high=None, why: str = "") -> None:
    """Refuse a number outside [low, high] naming the key (``model.batch_size=0: must be >= 1``)."""
    if (low is not None and value < low) or (high is not None and value > high):
        bound = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise ConfigError(f"{key}={value}: must be {bound}{f' ({why})' if why else ''}")


class ImageError(InputError):
    """An image that cannot be decoded or is refused (a decompression bomb)."""


class SchemaError(InputError):
    """A package or model folder whose JSON does not have the fields and types it must."""


class OutputError(PipelineError):
    """Somewhere the run must write is not writable (a missing folder, a file where a folder goes)."""


class Interrupted(PipelineError):
    """SIGTERM or Ctrl-C arrived: the run stops and publishes nothing."""


@contextmanager
def optional_part(what: str, off: str) -> Iterator[None]:
    """A part of a stage that a setting turns off: an error inside it names the part and the
    setting (``quantize.original (...): <the error>; quantize.original=false turns it off``), so a
    failure an hour into ``stage=all`` says what to change. An interrupt passes unchanged."""
    try:
        yield
    except Interrupted:
        raise
    except PipelineError as exc:
        raise type(exc)(f"{what}: {exc}; {off} turns it off") from None
