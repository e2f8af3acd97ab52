"""Error types shared by the API layers: client mistakes, a replica at capacity, and server-side stage failures."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad audio, unknown voice, out-of-range parameter): a client error."""


class StageError(RuntimeError):
    """A stage replica failed while serving the request: a server error."""


class CapacityError(RuntimeError):
    """A replica has no room for another request right now (try again shortly): 503 with Retry-After."""
