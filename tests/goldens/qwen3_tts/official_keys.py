"""Run by the official package's venv: the state-dict keys and shapes the official classes build from config files
(on the meta device), as JSON {path: {key: shape}}."""

from __future__ import annotations

import json
import sys

import torch
from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model


def official_shapes(path: str) -> dict[str, list[int]]:
    config = json.loads(open(path, encoding="utf-8").read())
    with torch.device("meta"):
        if config["model_type"] == "qwen3_tts":
            model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**config))
        else:
            model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**config))
    return {k: list(v.shape) for k, v in model.state_dict().items()}


if __name__ == "__main__":
    print(json.dumps({path: official_shapes(path) for path in sys.argv[1:]}))
