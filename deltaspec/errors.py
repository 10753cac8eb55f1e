"""User-facing errors: one clear sentence saying what is wrong and what would work.

Everything a user can cause (a bad path, a bad config, a bad request) raises `DeltaspecError`;
the CLI and the server print its message instead of a traceback.
"""


class DeltaspecError(Exception):
    """An error caused by the user's input, with a message meant to be shown as it is."""
