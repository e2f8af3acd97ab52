"""What every family's tiny checkpoint shares: the cache, per-key generators, a byte-level BPE on the shipped corpus,
and a directory built once, atomically, under a lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

ASSETS_DIR: Path = Path(__file__).resolve().parent / "assets"
CORPUS_PATH: Path = ASSETS_DIR / "tiny_corpus.txt"
BPE_VOCAB_SIZE: int = 1000  # includes the 256-symbol byte alphabet; special tokens come after


def cache_root() -> Path:
    """Where generated checkpoints live: ``$OMNI_RAY_CACHE``, else ``~/.cache/omni-ray``."""
    return Path(os.environ.get("OMNI_RAY_CACHE") or str(Path.home() / ".cache" / "omni-ray")).expanduser()


def param_generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded from (seed, checkpoint key), so init is independent of iteration order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def train_byte_level_bpe(special_tokens: tuple[str, ...]) -> Any:
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on the shipped corpus, `special_tokens` added after it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    lines = [ln for ln in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if ln.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def read_marker(path: Path, marker_file: str) -> dict[str, Any] | None:
    """A checkpoint directory's marker (written last, before the rename), or None."""
    try:
        marker = json.loads((path / marker_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def write_atomically(out_dir: Path, write: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """`write(tmp)` fills a sibling temporary directory, which then replaces ``out_dir`` (readable by other
    workers); losing a race to a concurrent writer keeps that writer's complete copy."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        for path in [*tmp.rglob("*")]:  # mkdtemp and save_pretrained leave 0700 / 0600
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def build_once(target: Path, is_complete: Callable[[Path], bool], make: Callable[[Path], Any]) -> Path:
    """``target`` once it is complete, made by `make(target)` at most once at a time (a file lock beside it, so
    concurrent processes wait for the first)."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_complete(target):
                make(target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target
