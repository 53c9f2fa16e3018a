"""Errors shared by every part of the toolkit."""


class PortingError(Exception):
    """An error caused by the user's input or files (bad checkpoint, bad config, bad flag).

    The CLI prints its message without a traceback and exits with status 2. Messages name the
    offending file, key or field.
    """
