"""Run by the official package's venv: load tiny Qwen3-TTS checkpoints and report key mismatches as JSON."""

from __future__ import annotations

import json
import sys

import torch
from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
from safetensors.torch import load_file
from transformers import PreTrainedModel


def _problems(info: dict[str, list]) -> dict[str, list[str]]:
    return {kind: [str(k) for k in keys] for kind, keys in info.items() if keys}


def _differing(files: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """Keys whose loaded value is not the file's (re-initialised on load), and model keys the file lacks."""
    state = model.state_dict()
    changed = [k for k, v in files.items() if k not in state or not torch.equal(v, state[k])]
    return changed + [k for k in state if k not in files]


def check(checkpoint_dir: str) -> dict[str, object]:
    """Load the model (without its speech tokenizer) and the speech tokenizer the way the official loader does."""
    model, info = PreTrainedModel.from_pretrained.__func__(
        Qwen3TTSForConditionalGeneration, checkpoint_dir, output_loading_info=True, dtype=torch.float32
    )
    speech_dir = f"{checkpoint_dir}/speech_tokenizer"
    speech, speech_info = Qwen3TTSTokenizerV2Model.from_pretrained(
        speech_dir, output_loading_info=True, dtype=torch.float32
    )
    return {
        "model": _problems(info),
        "model_values": _differing(load_file(f"{checkpoint_dir}/model.safetensors"), model),
        "speech_tokenizer": _problems(speech_info),
        "speech_tokenizer_values": _differing(load_file(f"{speech_dir}/model.safetensors"), speech),
        "tts_model_type": model.tts_model_type,
        "tts_model_size": model.tts_model_size,
    }


if __name__ == "__main__":
    print(json.dumps({d: check(d) for d in sys.argv[1:]}))
