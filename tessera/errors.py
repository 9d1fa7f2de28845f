"""User-facing errors: the CLI prints their message as one line, without a traceback."""


class TesseraError(Exception):
    """Bad input or an impossible request, explained in one sentence."""
