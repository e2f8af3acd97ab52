"""Where an S2 Pro deployment's files come from: a checkpoint in the official layout, the tiny default, or full-size
random weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omni_ray.config import ModelSource
from omni_ray.models.s2_pro.checkpoint import DEFAULT_SEED, write_tiny_checkpoint
from omni_ray.models.s2_pro.codec import CODEC_FILE
from omni_ray.models.s2_pro.dual_ar_model import PUBLISHED_CONFIG, S2ProConfig
from omni_ray.models.s2_pro.random_checkpoint import ensure_random_checkpoint
from omni_ray.tiny_checkpoints import build_once, cache_root, read_marker, write_atomically

TINY_FORMAT = 1  # bump when the tiny checkpoint's generator changes what it writes
MARKER_FILE = "omni_ray_tiny.json"  # written last: a directory without it is unfinished
REQUIRED_FILES = ("config.json", "tokenizer.json", CODEC_FILE)


@dataclass(frozen=True)
class S2ProModelFiles:
    """A checkpoint directory (config, Dual-AR weights, tokenizer, `codec.pth`) and its config."""

    directory: Path
    config: S2ProConfig


def tiny_checkpoint_dir(seed: int = DEFAULT_SEED) -> Path:
    """Cache location of the generated tiny checkpoint (`$OMNI_RAY_CACHE` or `~/.cache/omni-ray`)."""
    return cache_root() / f"s2-pro-tiny-v{TINY_FORMAT}-seed{seed}"


def _is_complete(path: Path, seed: int) -> bool:
    marker = read_marker(path, MARKER_FILE)
    return marker is not None and marker.get("format") == TINY_FORMAT and marker.get("seed") == seed


def ensure_tiny_checkpoint(seed: int = DEFAULT_SEED) -> Path:
    """The tiny checkpoint of `seed` (`write_tiny_checkpoint`), generated once (safe under concurrent callers)."""
    def write(out: Path) -> None:
        write_tiny_checkpoint(out, seed)
        (out / MARKER_FILE).write_text(json.dumps({"format": TINY_FORMAT, "seed": seed}) + "\n")

    target = tiny_checkpoint_dir(seed)
    return build_once(target, lambda path: _is_complete(path, seed),
                      lambda path: write_atomically(path, write, lambda done: _is_complete(done, seed)))


def resolve_model(source: ModelSource) -> S2ProModelFiles:
    """A checkpoint as is; the tiny checkpoint of `source.tiny_seed` (made on first use); or, with `random_weights`,
    a full-size random checkpoint of `source.config` (default: the published config) in the official layout, written
    once per machine into the cache (`random_checkpoint.ensure_random_checkpoint`)."""
    if source.random_weights:
        directory = ensure_random_checkpoint(source.tiny_seed or DEFAULT_SEED, Path(source.config or PUBLISHED_CONFIG))
    elif source.path is None:
        directory = ensure_tiny_checkpoint(source.tiny_seed or DEFAULT_SEED)
    else:
        directory = Path(source.path)
        missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} has no {', '.join(missing)}: not an S2 Pro checkpoint")
    return S2ProModelFiles(directory, S2ProConfig.from_checkpoint(directory))
