"""Audio a request names by URL (data:, http(s):, file:) fetched within limits: chat audio_url parts, speech ref_audio."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import numpy as np
import soundfile as sf

from omni_ray.audio import AudioDecodeError, audio_duration_seconds
from omni_ray.serve.openai_protocol import AudioUrlPart, ChatCompletionRequest, ServiceLimits, bad_request, too_large


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise urllib.error.URLError(f"redirect to a non-http(s) URL refused: {newurl}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


FETCH_PIECE = 1 << 16


def _fetch_http(url: str, timeout: float, max_bytes: int, param: str) -> bytes:
    """The URL's body; `timeout` bounds each read (the socket's) and the whole transfer (checked between reads)."""
    request = urllib.request.Request(url, headers={"User-Agent": "omni-ray"})
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.build_opener(_HttpOnlyRedirects).open(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise too_large(f"audio_url is {length} bytes, over the limit of {max_bytes}", param)
            pieces: list[bytes] = []
            size = 0
            while size <= max_bytes:
                if time.monotonic() > deadline:
                    raise bad_request(f"fetching audio_url timed out after {timeout:g}s", param, "audio_url_fetch_failed")
                piece = response.read(min(FETCH_PIECE, max_bytes + 1 - size))
                if not piece:
                    break
                pieces.append(piece)
                size += len(piece)
            data = b"".join(pieces)
    except urllib.error.HTTPError as exc:
        raise bad_request(f"could not fetch audio_url: HTTP {exc.code}", param, "audio_url_fetch_failed") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise bad_request(f"could not fetch audio_url: {exc}", param, "audio_url_fetch_failed") from exc
    if len(data) > max_bytes:
        raise too_large(f"audio_url is over the limit of {max_bytes} bytes", param)
    return data


def _read_local(url: str, limits: ServiceLimits, param: str) -> bytes:
    """file:// only inside allowed_local_audio_dirs, judged on the realpath (so no symlink escapes)."""
    if not limits.allowed_local_audio_dirs:
        raise bad_request("local file access is disabled on this server", param, "local_files_disabled")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_request("file:// URLs must not name a remote host", param)
    real = os.path.realpath(urllib.request.url2pathname(parts.path))
    roots = [os.path.realpath(d) for d in limits.allowed_local_audio_dirs]
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise bad_request("access to this local file is not allowed", param, "local_file_not_allowed")
    try:
        with os.fdopen(os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise bad_request("audio_url does not name a regular file", param)
            data = f.read(limits.max_url_bytes + 1)
    except OSError as exc:
        raise bad_request(f"could not read local audio file: {exc.strerror or exc}", param) from exc
    if len(data) > limits.max_url_bytes:
        raise too_large(f"local audio file is over the limit of {limits.max_url_bytes} bytes", param)
    return data


def _resolve_one(url: str, limits: ServiceLimits, param: str) -> dict[str, Any]:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":  # data:[<mime>][;base64],<payload>; base64 passes through to the prompt builder's check
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise bad_request("malformed data: URL (no ',')", param)
        if header.lower().endswith(";base64"):
            return {"type": "input_audio", "input_audio": {"data": payload}}
        return {"type": "audio", "audio": urllib.parse.unquote_to_bytes(payload)}
    if scheme in ("http", "https"):
        if not limits.allow_audio_urls:
            raise bad_request("http(s) audio_url is disabled on this server; send input_audio", param,
                              "audio_url_disabled")
        return {"type": "audio", "audio": _fetch_http(url, limits.url_fetch_timeout_s, limits.max_url_bytes, param)}
    if scheme == "file":
        return {"type": "audio", "audio": _read_local(url, limits, param)}
    raise bad_request(f"unsupported audio_url scheme {scheme!r}; use data:, http(s): or file:", param)


def audio_bytes(value: str, limits: ServiceLimits, param: str) -> bytes:
    """The bytes of audio given as a URL (data:, http(s): or file: as the limits allow) or as plain base64."""
    if not urllib.parse.urlsplit(value).scheme:  # base64 holds no ':'
        return _base64(value, param)
    part = _resolve_one(value, limits, param)
    if part["type"] == "input_audio":
        return _base64(part["input_audio"]["data"], param)
    return bytes(part["audio"])


def _base64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{param} is not valid base64: {exc}", param, "invalid_base64") from exc


def read_reference_audio(value: str, limits: ServiceLimits, param: str = "ref_audio") -> tuple[np.ndarray, int]:
    """Reference speech (`value` as `audio_bytes` takes it) decoded at its own rate: (samples [n] or [n, channels],
    sample rate). 413 over max_audio_seconds (read from the header first), 400 when it does not decode. Blocking:
    the ingress runs it on its parsing pool."""
    return decode_reference_bytes(audio_bytes(value, limits, param), limits, param)


def decode_reference_bytes(data: bytes, limits: ServiceLimits, param: str) -> tuple[np.ndarray, int]:
    """An audio file's bytes decoded at their own rate, as `read_reference_audio` does (413 over max_audio_seconds by
    the header, 400 `invalid_audio` when they do not decode). Blocking."""
    try:
        seconds = audio_duration_seconds(data)
    except AudioDecodeError as exc:
        raise bad_request(f"{param}: {exc}", param, "invalid_audio") from exc
    if seconds > limits.max_audio_seconds:
        msg = f"{param} is {seconds:.1f}s, over the limit of {limits.max_audio_seconds:g}s"
        raise too_large(msg, param, "audio_too_long")
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise bad_request(f"{param}: could not decode the audio: {exc}", param, "invalid_audio") from exc
    return np.ascontiguousarray(samples), int(rate)


def check_audio_duration(messages: list[dict[str, Any]], limits: ServiceLimits) -> None:
    """413 when the clips of pipeline `messages` total over max_audio_seconds (header read; bad audio skipped)."""
    total = 0.0
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            try:
                if part["type"] == "audio":
                    total += audio_duration_seconds(bytes(part["audio"]))
                elif part["type"] == "input_audio":
                    total += audio_duration_seconds(base64.b64decode(part["input_audio"]["data"], validate=True))
            except (AudioDecodeError, binascii.Error, ValueError):
                continue  # the prompt builder reports it
    if total > limits.max_audio_seconds:
        msg = f"input audio totals {total:.1f}s, over the limit of {limits.max_audio_seconds:g}s"
        raise too_large(msg, "messages", "audio_too_long")


def resolve_audio_urls_blocking(request: ChatCompletionRequest, limits: ServiceLimits) -> ChatCompletionRequest:
    """A copy whose audio_url parts carry their audio (see to_pipeline_messages); also enforces max_audio_seconds.
    It blocks (fetches, reads files, decodes headers): the ingress runs it on its parsing pool."""
    resolved = request.model_copy(deep=True)
    for i, message in enumerate(resolved.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if isinstance(part, AudioUrlPart):
                param = f"messages.{i}.content.{j}.audio_url.url"
                part._resolved = _resolve_one(part.audio_url.url, limits, param)
    check_audio_duration(resolved.to_pipeline_messages(), limits)
    return resolved


async def resolve_audio_urls(request: ChatCompletionRequest, limits: ServiceLimits) -> ChatCompletionRequest:
    """resolve_audio_urls_blocking on a thread."""
    return await asyncio.to_thread(resolve_audio_urls_blocking, request, limits)
