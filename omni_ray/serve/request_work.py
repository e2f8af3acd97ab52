"""Request work kept off the ingress's event loop: the body read within its limit, then a bounded parsing pool."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, TypeVar

from starlette.requests import Request

from omni_ray.serve.openai_protocol import OpenAIError, ServiceLimits, too_large

T = TypeVar("T")


def _over(limit: int, size: int | None = None) -> OpenAIError:
    said = f"{size} bytes" if size is not None else "larger"
    return too_large(f"request body is {said}, over the limit of {limit} bytes")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) at once when its Content-Length is over `limit`, else as soon as the bytes
    read pass it: nothing more is buffered."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _over(limit, int(length))
    pieces: list[bytes] = []
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise _over(limit)
        pieces.append(piece)
    return b"".join(pieces)


class ParsingPool:
    """Runs blocking request work (JSON, validation, audio fetching and decoding, prompt building, tokenizing) on
    `max_parsing_concurrency` threads. A request waits for a free thread at most `max_parsing_wait_s`, then gets 503
    with Retry-After. A slot is held until its work ends, even when the client has gone."""

    def __init__(self, limits: ServiceLimits) -> None:
        self.size = limits.max_parsing_concurrency
        self.wait_s = limits.max_parsing_wait_s
        self._threads = concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="ingress-parse")
        self._slots = asyncio.Semaphore(self.size)

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        try:
            await asyncio.wait_for(self._slots.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            raise OpenAIError(503, "every request parser is busy; retry later", "server_error", None, "overloaded",
                              {"Retry-After": "1"}) from None
        loop = asyncio.get_running_loop()
        try:
            future = self._threads.submit(work, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._slots.release))
        return await asyncio.wrap_future(future)
