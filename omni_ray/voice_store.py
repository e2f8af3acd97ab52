"""Cloned voices on disk for every speech family that clones: one safetensors file per voice, tensors and metadata."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load, save

from omni_ray.errors import InvalidRequestError

log = logging.getLogger(__name__)

VOICE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
VOICE_FORMAT = "omni-ray-voice/1"
SUFFIX = ".safetensors"
DEFAULT_MAX_VOICES = 1000
LOCK_FILE = ".lock"  # serializes the cap check and the creation among the processes of one host


class VoiceStoreError(InvalidRequestError):
    """A voice request the store refuses; `status` is the HTTP status that says why."""

    status = 400


class InvalidVoiceNameError(VoiceStoreError):
    """The name does not match `VOICE_NAME` (letters, digits, `_` and `-`, 1 to 64 of them)."""


class VoiceNotFoundError(VoiceStoreError):
    """No stored voice has this name."""

    status = 404


class VoiceExistsError(VoiceStoreError):
    """A stored voice already has this name (compared without case)."""

    status = 409


class TooManyVoicesError(VoiceStoreError):
    """The store holds its `max_voices` already: delete one first."""

    status = 409


def check_voice_name(name: str) -> str:
    """`name` if it may name a voice (it then cannot leave the store's directory), else InvalidVoiceNameError."""
    if not isinstance(name, str) or VOICE_NAME.fullmatch(name) is None:
        raise InvalidVoiceNameError(f"voice name {name!r} is not allowed: use 1 to 64 letters, digits, '_' or '-'")
    return name


def model_voices_id(checkpoint: Path) -> str:
    """A stable id of a checkpoint for its voices' directory: its directory's name and a hash of its config.json, so
    the voices of one model are never offered to another."""
    config = (Path(checkpoint) / "config.json").read_bytes()
    return f"{Path(checkpoint).resolve().name}-{hashlib.sha256(config).hexdigest()[:12]}"


def default_voices_dir(checkpoint: Path) -> Path:
    """`$OMNI_RAY_CACHE/voices/<model id>` (the cache defaults to `~/.cache/omni-ray`)."""
    cache = os.environ.get("OMNI_RAY_CACHE") or str(Path.home() / ".cache" / "omni-ray")
    return Path(cache).expanduser() / "voices" / model_voices_id(checkpoint)


@dataclass(frozen=True)
class StoredVoice:
    """A stored voice as saved: its family's tensors, its reference transcript (None without one) and metadata."""

    tensors: dict[str, torch.Tensor]
    text: str | None
    metadata: dict[str, str]


class VoiceStore:
    """Cloned voices in one directory, shared safely by every replica that opens it: a voice is written to a temporary
    file and linked into place only if its name is free (a reader sees a whole file or none), names are unique
    without case, and listing skips files that vanish or are unreadable meanwhile. Nothing is cached: a voice one
    replica stores or deletes is seen at once by the others."""

    def __init__(self, directory: Path | str, max_voices: int = DEFAULT_MAX_VOICES) -> None:
        if max_voices < 1:
            raise ValueError("max_voices must be at least 1")
        self.directory = Path(directory).expanduser()
        self.max_voices = max_voices

    def path(self, name: str) -> Path:
        """The file of voice `name` (lower-cased: one file per name whatever its case)."""
        return self.directory / f"{check_voice_name(name).lower()}{SUFFIX}"

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor], text: str | None, frames: int,
                     sample_seconds: float, extra: dict[str, str] | None = None) -> dict[str, Any]:
        """Store a family's `tensors` as voice `name`, with the reference's transcript (`text`: in-context cloning;
        None: a voice without one), its length in codec `frames` and the seconds its reference audio lasted; `extra`
        adds string metadata. InvalidVoiceNameError, VoiceExistsError or TooManyVoicesError say why not. Returns
        its `list()` entry."""
        target = self.path(name)
        cpu = {key: value.detach().to("cpu").contiguous() for key, value in tensors.items()}
        # what the voice sounds like, not when it was stored or its name: the same upload has the same digest
        digest = hashlib.sha256(save(cpu) + (text or "").encode()).hexdigest()
        metadata = {
            **(extra or {}), "format": VOICE_FORMAT, "name": name, "in_context": str(text is not None).lower(),
            "text": text or "", "frames": str(int(frames)), "seconds": repr(float(sample_seconds)),
            "created": repr(time.time()), "digest": digest,
        }
        body = save(cpu, metadata)
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._creation_lock():
            self.check_can_add(name)
            self._write_new(name, target, body)
        return _entry(metadata)

    def check_can_add(self, name: str) -> None:
        """Whether `save(name, ...)` would be refused now (its name, a voice of that name, the cap): lets a caller
        refuse before encoding a reference. `save` checks again."""
        if self.exists(name):
            raise VoiceExistsError(f"voice {name!r} already exists")
        count = len(self._voice_files())
        if count >= self.max_voices:
            raise TooManyVoicesError(f"this model stores at most {self.max_voices} voices and has {count}: "
                                     "delete one first")

    def load_tensors(self, name: str) -> StoredVoice:
        """The stored voice `name`, bit for bit as saved; VoiceNotFoundError if there is none."""
        path = self.path(name)
        try:
            body = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise VoiceNotFoundError(f"unknown voice {name!r}: {self._names_hint()}") from None
        metadata = _metadata_of_bytes(body)
        if metadata.get("format") != VOICE_FORMAT:
            raise ValueError(f"{path} is not a voice of format {VOICE_FORMAT}")
        text = metadata.get("text") if metadata.get("in_context") == "true" else None
        return StoredVoice(load(body), text or None, metadata)

    def rename(self, old: str, new: str) -> dict[str, Any]:
        """Give voice `old` the name `new` (a change of case only is allowed): its file is rewritten under the new
        name, then the old one removed. VoiceNotFoundError, VoiceExistsError or InvalidVoiceNameError say why not.
        Returns the renamed voice's `list()` entry."""
        source, target = self.path(old), self.path(new)
        if not source.is_file():
            raise VoiceNotFoundError(f"unknown voice {old!r}: {self._names_hint()}")
        with self._creation_lock():
            try:
                body = source.read_bytes()
            except FileNotFoundError:
                raise VoiceNotFoundError(f"unknown voice {old!r}: {self._names_hint()}") from None
            if target != source and target.exists():
                raise VoiceExistsError(f"voice {new!r} already exists")
            metadata = {**_metadata_of_bytes(body), "name": new}
            renamed = save(load(body), metadata)
            if target == source:
                self._replace(target, renamed)
            else:
                self._write_new(new, target, renamed)
                source.unlink(missing_ok=True)
        return _entry(metadata)

    def info(self, name: str) -> dict[str, Any]:
        """The `list()` entry of voice `name`; VoiceNotFoundError if there is none."""
        try:
            return _entry(_read_metadata(self.path(name)))
        except (FileNotFoundError, IsADirectoryError):
            raise VoiceNotFoundError(f"unknown voice {name!r}: {self._names_hint()}") from None

    def list(self) -> list[dict[str, Any]]:
        """Every stored voice, by name: {name, mode (in_context or x_vector_only), frames, seconds, created (Unix
        time), text, digest}. A file deleted, or unreadable, while listing is left out."""
        entries = []
        for path in self._voice_files():
            try:
                entries.append(_entry(_read_metadata(path)))
            except FileNotFoundError:
                continue
            except Exception as exc:  # noqa: BLE001 - a foreign or damaged file must not hide the others
                log.warning("skipping unreadable voice file %s: %s", path, exc)
        return sorted(entries, key=lambda entry: entry["name"].lower())

    def names(self) -> list[str]:
        return [entry["name"] for entry in self.list()]

    def delete(self, name: str) -> None:
        """Remove voice `name`; VoiceNotFoundError if there is none."""
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            raise VoiceNotFoundError(f"unknown voice {name!r}: {self._names_hint()}") from None

    def _voice_files(self) -> list[Path]:
        try:
            children = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        return [Path(child.path) for child in children
                if child.name.endswith(SUFFIX) and not child.name.startswith(".")
                and VOICE_NAME.fullmatch(child.name[: -len(SUFFIX)])]

    def _names_hint(self, shown: int = 10) -> str:
        """Some stored voices' names for an error message (reading at most `shown` files)."""
        files = sorted(self._voice_files())
        if not files:
            return "no voices are stored"
        names = []
        for path in files[:shown]:
            try:
                names.append(_read_metadata(path)["name"])
            except Exception:  # noqa: BLE001 - a hint only
                continue
        more = f" and {len(files) - shown} more" if len(files) > shown else ""
        return f"stored voices: {', '.join(names)}{more}"

    @contextmanager
    def _creation_lock(self) -> Iterator[None]:
        with open(self.directory / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_new(self, name: str, target: Path, body: bytes) -> None:
        """Write `body` to a temporary file, flush it to disk, then link it to `target`, which fails if `target`
        exists: a name is taken once, even by replicas on other hosts that share the directory."""
        def link(temporary: Path) -> None:
            try:
                os.link(temporary, target)
            except FileExistsError:
                raise VoiceExistsError(f"voice {name!r} already exists") from None

        self._write_then(target, body, link)

    def _replace(self, target: Path, body: bytes) -> None:
        """Rewrite the existing `target` with `body` atomically (a reader sees the old file or the new one)."""
        self._write_then(target, body, lambda temporary: os.replace(temporary, target))

    def _write_then(self, target: Path, body: bytes, publish: Callable[[Path], None]) -> None:
        """`body` written to a temporary file beside `target` and flushed to disk, then `publish`ed from it; the
        temporary file is gone afterwards, and the directory's entry flushed."""
        temporary = self.directory / f".{target.stem}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "xb") as out:
                out.write(body)
                out.flush()
                os.fsync(out.fileno())
            publish(temporary)
        finally:
            temporary.unlink(missing_ok=True)
        _fsync_directory(self.directory)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as handle:  # reads the header only
        return dict(handle.metadata() or {})


def _metadata_of_bytes(body: bytes) -> dict[str, str]:
    header_length = int.from_bytes(body[:8], "little")
    return dict(json.loads(body[8: 8 + header_length]).get("__metadata__") or {})


def _entry(metadata: dict[str, str]) -> dict[str, Any]:
    if metadata.get("format") != VOICE_FORMAT:
        raise ValueError(f"not a voice of format {VOICE_FORMAT}")
    in_context = metadata["in_context"] == "true"
    return {"name": metadata["name"], "mode": "in_context" if in_context else "x_vector_only",
            "frames": int(metadata["frames"]), "seconds": float(metadata["seconds"]),
            "created": float(metadata["created"]), "text": metadata["text"] if in_context else None,
            "digest": metadata["digest"]}
