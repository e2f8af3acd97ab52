"""Incremental Server-Sent Events parser that tolerates events split across arbitrary reads."""

from __future__ import annotations

import re

_CR = 0x0D
_EOL = re.compile(rb"\r\n|\r|\n")


class SSEParser:
    """Feed raw bytes as they arrive; get back the `data` payload of every event completed so far.

    Follows the WHATWG event-stream rules that matter here: lines end in LF, CRLF or CR; a blank line
    dispatches the event; several `data:` lines join with "\\n"; one space after the colon is dropped;
    comment lines (leading ":") and other fields (`event`, `id`, `retry`) are ignored. Lines are split
    on bytes before decoding, so a UTF-8 character split across two reads is decoded intact.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[str] = []
        self._has_data = False

    def feed(self, chunk: bytes) -> list[str]:
        """Consume `chunk`; return the payloads of the events it completed, in order."""
        buf = self._buf
        scan = len(buf)  # bytes already in the buffer hold no line end (except a held-back final CR)
        if scan and buf[-1] == _CR:
            scan -= 1
        buf.extend(chunk)
        events: list[str] = []
        start = 0
        while True:
            m = _EOL.search(buf, max(start, scan))
            if m is None:
                break
            if m.group() == b"\r" and m.end() == len(buf):
                break  # a CR at the very end may be the first half of CRLF: wait for more bytes
            self._line(bytes(buf[start:m.start()]), events)
            start = m.end()
        del buf[:start]
        return events

    def close(self) -> list[str]:
        """End of stream: a held-back final CR still ends its line; an event lacking its blank line is dropped."""
        events: list[str] = []
        if self._buf.endswith(b"\r"):
            self._line(bytes(self._buf[:-1]), events)
        self._buf.clear()
        self._data = []
        self._has_data = False
        return events

    def _line(self, raw: bytes, events: list[str]) -> None:
        if not raw:
            if self._has_data:
                events.append("\n".join(self._data))
            self._data = []
            self._has_data = False
            return
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
            self._has_data = True


def parse_sse(body: bytes) -> list[str]:
    """All complete event payloads in a whole body (convenience for tests and small responses)."""
    parser = SSEParser()
    return parser.feed(body) + parser.close()
