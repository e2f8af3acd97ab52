"""The one checkpoint loader: reads a stage's slice of a local safetensors checkpoint into our modules."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

_EXPERT_KEY = re.compile(r"^(?P<base>(?:.*\.)?experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _shard_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({checkpoint / name for name in weight_map.values()})
    single = checkpoint / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {checkpoint}")


def read_tensors(checkpoint: Path, prefix: str, only: tuple[str, ...] = ("",)) -> dict[str, torch.Tensor]:
    """Tensors under `prefix` (stripped) whose remaining key starts with one of `only`. Nothing else is read."""
    out: dict[str, torch.Tensor] = {}
    for shard in _shard_files(Path(checkpoint)):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix) and key[len(prefix) :].startswith(only):
                    out[key[len(prefix) :]] = f.get_tensor(key)
    if not out:
        raise KeyError(f"checkpoint {checkpoint} has no tensors under '{prefix}'")
    return out


def read_rows(checkpoint: Path, key: str, rows: list[int]) -> torch.Tensor:
    """Selected rows of one 2-D tensor (e.g. a few embedding rows) without reading the rest."""
    for shard in _shard_files(Path(checkpoint)):
        with safe_open(str(shard), framework="pt") as f:
            if key in f.keys():
                sl = f.get_slice(key)
                return torch.stack([sl[r : r + 1][0] for r in rows])
    raise KeyError(f"checkpoint {checkpoint} has no tensor '{key}'")


def fuse_expert_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint keys (experts.{e}.gate_proj/up_proj/down_proj) → stacked gate_up_proj / down_proj."""
    grouped: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = _EXPERT_KEY.match(key)
        if match:
            grouped[match["base"]][int(match["index"])][match["proj"]] = tensor
        else:
            out[key] = tensor
    for base, experts in grouped.items():
        order = sorted(experts)
        if order != list(range(len(order))):
            raise KeyError(f"{base}: expert indices are not contiguous")
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in order]
        )
        out[f"{base}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


def load_module(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Strict load: every parameter must be present and every tensor used; shapes must match."""
    expected = dict(module.state_dict())
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise KeyError(f"{type(module).__name__}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for key, value in tensors.items():
        if expected[key].shape != value.shape:
            raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != model {tuple(expected[key].shape)}")
    module.load_state_dict(tensors, strict=True)


@torch.no_grad()
def random_module(factory: Callable[[], nn.Module], device: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Build a module directly on `device` with random weights (norm scales 1, biases 0, the rest N(0, 0.02)).

    For speed work without a checkpoint: full-size models initialise on the GPU in seconds."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = factory()
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    return module.to(device=device, dtype=dtype).eval()
