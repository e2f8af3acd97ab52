"""Error types shared by the API layers: client mistakes, a replica at capacity, and server-side stage failures."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad audio, unknown voice, out-of-range parameter): a client error."""


class StageError(RuntimeError):
    """A stage replica failed while serving the request: a server error."""


class CapacityError(RuntimeError):
    """A replica has no room for another request right now (try again shortly): 503 with Retry-After.
    `retry_after_s`: when the replica expects to have room again (None: it cannot say)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, float | None]]:  # pickled with its retry_after_s
        return type(self), (str(self), self.retry_after_s)
