"""User-facing errors: one clear sentence saying what is wrong and what would work.

Everything a user can cause (a bad path, a bad config, a bad request) raises `DeltaspecError`;
the CLI and the server print its message instead of a traceback. A request that fails while it generates, by its
own doing, raises `RequestError`, which the server answers as a client error.
"""


class DeltaspecError(Exception):
    """An error caused by the user's input, with a message meant to be shown as it is."""


class RequestError(DeltaspecError):
    """A failure one request caused while it was generating (its constraint gave out): that request ends with this
    sentence as a client error, never a server error. The engine records a failed sequence's error as
    `error_text`; `request_error_message` finds this kind again in that text."""


def error_text(exc: BaseException) -> str:
    """How the engine records a sequence's failure: the exception's type name and its message."""
    return f"{type(exc).__name__}: {exc}"


def request_error_message(text: str | None) -> str | None:
    """The sentence of a `RequestError` recorded by `error_text`, or None for any other failure."""
    prefix = f"{RequestError.__name__}: "
    return text[len(prefix) :] if text is not None and text.startswith(prefix) else None
