"""The one error type a user sees: printed as a single line, exit code 2."""


class PipelineError(Exception):
    """Bad input or a failed check: the message is the whole story, no traceback."""
