"""Full-size random S2 Pro checkpoints in the official layout (published config, released codec's geometry, a
tokenizer with the published ids), for benchmarks at the real model's size without its weights."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from omni_ray.models.s2_pro.checkpoint import CONTROL_TOKENS, DEFAULT_SEED, random_codec_weights, weight_layout
from omni_ray.models.s2_pro.codec import CODEC_FILE, CodecConfig
from omni_ray.models.s2_pro.dual_ar_model import PUBLISHED_CONFIG
from omni_ray.models.s2_pro.prompt import IM_END, semantic_token
from omni_ray.tiny_checkpoints import build_once, cache_root, read_marker, train_byte_level_bpe, write_atomically

RANDOM_FORMAT = 1  # bump when what the writer produces changes
MARKER_FILE = "omni_ray_random.json"  # written last: a directory without it is unfinished
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 2 << 30  # tensors per shard, about 2 GiB each (the released checkpoint is sharded too)
INIT_STD = 0.02  # every matrix N(0, 0.02) (logits of unit size through the tied embeddings), norm scales 1
# The published tokenizer's ids (the released tokenizer.json; config.json names eos, pad, audio pad, semantic range).
PUBLISHED_IDS: dict[str, int] = {"<|endoftext|>": 151643, "<|im_start|>": 151644, IM_END: 151645,
                                 "<|pad|>": 151669, "<|audio_pad|>": 151677}


def published_token_ids(config: dict[str, Any]) -> dict[str, int]:
    """Every control token's and semantic token's id as the published tokenizer places them: those it names at their
    ids, the other control tokens (whose ids serving never reads) in their order in the free ids from 151646, each
    `<|semantic:i|>` at `semantic_start_token_id` + i."""
    ids = dict(PUBLISHED_IDS)
    free = iter(i for i in range(PUBLISHED_IDS[IM_END] + 1, config["semantic_start_token_id"])
                if i not in PUBLISHED_IDS.values())
    for token in CONTROL_TOKENS:
        if token not in ids:
            ids[token] = next(free)
    count = config["semantic_end_token_id"] - config["semantic_start_token_id"] + 1
    ids.update({semantic_token(i): config["semantic_start_token_id"] + i for i in range(count)})
    return ids


def write_published_tokenizer(out_dir: Path, config: dict[str, Any]) -> dict[str, int]:
    """`tokenizer.json` and `tokenizer_config.json` whose special tokens have the published ids and whose vocabulary
    is the published size (`text_config.vocab_size`): the tiny checkpoints' byte-level BPE (its ~1000 tokens at
    ids 0..999, so text encodes to few ids, as in the tiny checkpoints), then unreachable filler entries
    (`<|filler:i|>`: no merge produces them, so no text encodes to them) at every id up to the vocabulary's end that
    no special token takes, and the control and semantic tokens as special tokens at their published ids. Prompts
    are laid out exactly as with the released tokenizer; only ordinary text maps to other ids. Returns the special
    tokens' ids."""
    special = published_token_ids(config)
    vocab_size = int(config["text_config"]["vocab_size"])
    state = json.loads(train_byte_level_bpe(()).to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    if max(vocab.values()) >= min(special.values()):
        raise RuntimeError("the BPE vocabulary overlaps the published special-token ids")
    taken = set(vocab.values()) | set(special.values())
    vocab.update({f"<|filler:{i}|>": i for i in range(vocab_size) if i not in taken})
    vocab.update(special)
    state["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda item: item[1]))
    state["added_tokens"] = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}
                             for token, i in sorted(special.items(), key=lambda item: item[1])]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(state, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END, "pad_token": "<|pad|>",
        "bos_token": None, "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
    }, indent=2) + "\n")
    return special


def _draw(key: str, shape: tuple[int, ...], generator: torch.Generator, device: str) -> torch.Tensor:
    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    tensor = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, INIT_STD, generator=generator)
    return tensor.cpu()


def weight_shards(layout: dict[str, tuple[int, ...]], shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """The layout's keys in order, grouped into shards of about `shard_bytes` bfloat16 bytes each."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, shape in layout.items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_random_weights(out_dir: Path, config: dict[str, Any], seed: int = DEFAULT_SEED,
                         device: str | None = None) -> Iterator[tuple[str, float]]:
    """`model-*-of-*.safetensors` and their index: bfloat16 weights of `config`'s official layout, drawn on `device`
    (default: the GPU when there is one) from one generator, one shard in memory at a time. Yields (shard, seconds)
    as each is written."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    layout = weight_layout(config)
    shards = weight_shards(layout)
    weight_map = {}
    for index, keys in enumerate(shards):
        start = time.perf_counter()
        name = _shard_name(index, len(shards))
        save_file({key: _draw(key, layout[key], generator, device) for key in keys}, str(out_dir / name),
                  metadata={"format": "pt"})
        weight_map.update({key: name for key in keys})
        yield name, time.perf_counter() - start
    total = sum(2 * math.prod(shape) for shape in layout.values())
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")


def write_random_checkpoint(out_dir: Path, seed: int = DEFAULT_SEED, device: str | None = None,
                            config_file: Path = PUBLISHED_CONFIG, codec: CodecConfig = CodecConfig()) -> Path:
    """A full-size random S2 Pro in the official layout into `out_dir`: `config.json` (the published one), the
    tokenizer (`write_published_tokenizer`), sharded bfloat16 Dual-AR weights and the codec's `codec.pth` (float32,
    the tiny codec's scaling rules at the released geometry), then the marker."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(config_file).read_text())
    ids = write_published_tokenizer(out_dir, config)
    if ids[IM_END] != config["eos_token_id"]:
        raise RuntimeError(f"{IM_END} is {ids[IM_END]}, the config's eos {config['eos_token_id']}")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for _ in write_random_weights(out_dir, config, seed, device):
        pass
    torch.save({f"generator.{k}": v.contiguous() for k, v in random_codec_weights(codec, seed).items()},
               out_dir / CODEC_FILE)
    (out_dir / MARKER_FILE).write_text(json.dumps({"format": RANDOM_FORMAT, "seed": seed,
                                                   "config": Path(config_file).name}) + "\n")
    return out_dir


def random_checkpoint_dir(seed: int = DEFAULT_SEED, config_file: Path = PUBLISHED_CONFIG) -> Path:
    """Cache location of the full-size random checkpoint (`$OMNI_RAY_CACHE` or `~/.cache/omni-ray`)."""
    return cache_root() / f"s2-pro-random-v{RANDOM_FORMAT}-{Path(config_file).stem}-seed{seed}"


def _is_complete(path: Path, seed: int, config_file: Path) -> bool:
    marker = read_marker(path, MARKER_FILE)
    return (marker is not None and marker.get("format") == RANDOM_FORMAT and marker.get("seed") == seed
            and marker.get("config") == Path(config_file).name)


def ensure_random_checkpoint(seed: int = DEFAULT_SEED, config_file: Path = PUBLISHED_CONFIG) -> Path:
    """The full-size random checkpoint of (seed, config), written once per machine (safe under concurrent callers:
    the other stages wait for the first)."""
    target = random_checkpoint_dir(seed, config_file)
    complete = lambda path: _is_complete(path, seed, config_file)  # noqa: E731
    return build_once(target, complete, lambda path: write_atomically(
        path, lambda tmp: write_random_checkpoint(tmp, seed, config_file=config_file), complete))
