"""Run by the fish-speech venv (the official source on PYTHONPATH, see make_venv.sh): write the official S2 Pro
prompts (no reference, one, two, a long text), prefill logits, greedy frames and sampling distributions on the tiny
checkpoint of one seed.

Usage: make_goldens.py --seed N --out FILE [--project-python PY | --checkpoint DIR]

The tiny checkpoint (`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` in the official
layout) is written by the project's own `omni_ray.models.s2_pro.checkpoint.write_tiny_checkpoint`, run by the
project's python (`--project-python`), unless `--checkpoint` names one already written. The model and its tokenizer
load through the official `init_model`; each prompt is the one the official `generate_long` builds and hands to
`generate` (it is run, with `generate` wrapped to record its arguments and output). The official code is only
imported here, never copied."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from fish_speech.models.text2semantic import inference
from fish_speech.models.text2semantic.inference import RAS_WIN_SIZE, decode_one_token_ar, generate_long, init_model
from fish_speech.models.text2semantic.llama import _remap_fish_qwen3_omni_keys
from fish_speech.tokenizer import IM_END_TOKEN

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
FISH_SPEECH_COMMIT = "3dd1f85"
FRAMES = 10  # the prefill's frame and 9 decode steps
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 1}  # top_k=1: greedy, and RAS cannot change a token
TEXT = "The quiet harbour woke slowly as the boats came in."  # no speaker tag: generate_long makes one batch
# Several sentences, 375 bytes, no speaker tag: generate_long splits text only at speaker tags (turns grouped up to
# chunk_length bytes), so this is one batch and one generate call too (checked: official_prompt fails otherwise).
LONG_TEXT = ("The quiet harbour woke slowly as the boats came in. Gulls circled above the masts, calling to one "
             "another over the grey water, while the fishermen hauled their nets onto the stone pier. An old woman "
             "sold tea from a cart by the lighthouse, and children ran between the crates of silver fish. By noon the "
             "fog had lifted, and the whole town could see the islands far out to sea.")
# The cases: (text, references); each reference is (codes frames, text); its codes [num_codebooks, frames] are drawn
# in 0..codebook_size-1 from torch.Generator().manual_seed(1000 + seed), the references of all cases in this order.
CASES = {
    "plain": (TEXT, []),
    "one_reference": (TEXT, [(8, "Hello from the reference speaker.")]),
    "two_references": (TEXT, [(5, "First voice here."), (6, "<|speaker:1|>Second voice, already tagged.")]),
    "long_text": (LONG_TEXT, []),
}
# The official API's default sampling (the engine's DEFAULT_SAMPLING) and RAS's redraw (inference.py's RAS_HIGH_*):
# the distributions the official `logits_to_probs` gives them on one case's first-frame logits are recorded.
DEFAULT_SAMPLING = {"temperature": 0.8, "top_p": 0.8, "top_k": 30}
DISTRIBUTION_CASE = "plain"
# generate_long refuses a prompt longer than max_seq_len - 2048; the tiny checkpoint's max_seq_len is 512, so the
# config's max_seq_len reads this value while generate_long builds the prompt (only) and 512 again inside generate.
GUARD_MAX_SEQ_LEN = 4096


def write_checkpoint(project_python: str, seed: int, out_dir: Path) -> Path:
    code = ("import sys; from pathlib import Path; "
            "from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint; "
            "write_tiny_checkpoint(Path(sys.argv[1]), int(sys.argv[2]))")
    subprocess.run([project_python, "-c", code, str(out_dir), str(seed)], cwd=REPO_ROOT, check=True)
    return out_dir


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_load(model: Any, directory: Path) -> None:
    """from_pretrained loads with strict=False and only logs the result: fail here on any missing, unexpected or
    reshaped key, or a value that did not arrive; and unless the tokenizer loaded (it sets the config's semantic
    ids) and its semantic ids and vocabulary equal config.json's."""
    weights = _remap_fish_qwen3_omni_keys(OrderedDict(load_file(str(directory / "model.safetensors"))))
    state = model.state_dict()
    missing = sorted(set(state) - set(weights))
    unexpected = sorted(set(weights) - set(state))
    reshaped = sorted(k for k in set(state) & set(weights) if state[k].shape != weights[k].shape)
    changed = sorted(k for k in set(state) & set(weights) if k not in reshaped and not torch.equal(state[k], weights[k]))
    if missing or unexpected or reshaped or changed:
        raise SystemExit(f"official load mismatch: missing={missing} unexpected={unexpected} "
                         f"reshaped={reshaped} changed={changed}")
    config = json.loads((directory / "config.json").read_text())
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise SystemExit("the official loader did not load the tokenizer")
    want = (config["semantic_start_token_id"], config["semantic_end_token_id"])
    for name, got in (("tokenizer", (tokenizer.semantic_begin_id, tokenizer.semantic_end_id)),
                      ("model config", (model.config.semantic_begin_id, model.config.semantic_end_id))):
        if got != want:
            raise SystemExit(f"the {name}'s semantic ids {got} differ from config.json's {want}")
    sizes = (len(tokenizer.get_vocab()), config["text_config"]["vocab_size"], model.config.vocab_size)
    if len(set(sizes)) != 1:
        raise SystemExit(f"vocabulary sizes differ (tokenizer, config.json, model): {sizes}")


def make_references(seed: int, config: Any) -> dict[str, list[tuple[torch.Tensor, str]]]:
    """Each case's references: (codes [num_codebooks, frames] in 0..codebook_size-1, text)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return {name: [(torch.randint(0, config.codebook_size, (config.num_codebooks, n), generator=gen), text)
                   for n, text in refs] for name, (_, refs) in CASES.items()}


def official_prompt(model: Any, text: str,
                    references: list[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, list[list[int]]]:
    """Runs the official `generate_long` (greedy, FRAMES new tokens) with `inference.generate` wrapped: returns the
    one prompt it built (Conversation, encode_for_inference) and the frames the official `generate` gave on it
    (which stop after EOS)."""
    calls: list[tuple[torch.Tensor, list[list[int]]]] = []
    official_generate, max_seq_len = inference.generate, model.config.max_seq_len

    def recording_generate(**kwargs: Any) -> torch.Tensor:
        model.config.max_seq_len = max_seq_len
        prompt = kwargs["prompt"]
        if kwargs["audio_masks"] is not None or kwargs["audio_parts"] is not None:
            raise SystemExit("the official prompt has audio parts: the goldens do not cover them")
        clear_caches(model)
        seq = official_generate(**kwargs)
        calls.append((prompt.clone(), [[int(v) for v in col] for col in seq[:, prompt.shape[1]:].T.tolist()]))
        model.config.max_seq_len = GUARD_MAX_SEQ_LEN
        return seq

    inference.generate = recording_generate
    model.config.max_seq_len = GUARD_MAX_SEQ_LEN
    try:
        for _ in generate_long(model=model, device="cpu", decode_one_token=decode_one_token_ar, text=text,
                               max_new_tokens=FRAMES, prompt_text=[t for _, t in references] or None,
                               prompt_tokens=[c for c, _ in references] or None, **SAMPLING):
            pass
    finally:
        inference.generate, model.config.max_seq_len = official_generate, max_seq_len
    if len(calls) != 1:
        raise SystemExit(f"generate_long called generate {len(calls)} times, not once")
    return calls[0]


def clear_caches(model: Any) -> None:
    for layer in [*model.layers, *model.fast_layers]:
        layer.attention.kv_cache.k_cache.zero_()
        layer.attention.kv_cache.v_cache.zero_()


@torch.inference_mode()
def run(model: Any, prompt: torch.Tensor,
        bias: torch.Tensor) -> tuple[list[list[int]], list[float], float, list[float]]:
    """The official `generate`'s steps with the official `decode_one_token_ar`, not stopping at EOS: the prefill on
    the whole prompt (input_pos arange) gives frame 0, then 9 decode steps under the MATH SDPA kernel with the RAS
    window, as `decode_n_tokens` runs them. Returns the frames, the raw token logits at the prompt's last position
    and the smallest top-1 minus top-2 logit gap of the greedy choices, and the fast AR's logits of codebook 1 in
    frame 0 (after the greedy code 0)."""
    clear_caches(model)
    dtype = next(model.parameters()).dtype
    temperature = torch.tensor(SAMPLING["temperature"], dtype=dtype)
    top_p = torch.tensor(SAMPLING["top_p"], dtype=dtype)
    rows, length = prompt.shape
    seen: list[torch.Tensor] = []  # the slow model's token logits of each step
    gaps: list[float] = []  # each greedy choice's top-1 minus top-2 logit (the token biased; codebooks 1..9)
    fast_seen: list[torch.Tensor] = []
    official_forward, official_fast = model.forward_generate, model.forward_generate_fast

    def gap(logits: torch.Tensor) -> float:
        top = torch.topk(logits.reshape(-1).double(), 2).values
        return float(top[0] - top[1])

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = official_forward(*args, **kwargs)
        seen.append(result.logits.detach().clone())
        gaps.append(gap(result.logits[0, -1] + bias.reshape(-1)))
        return result

    def spy_fast(x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        logits = official_fast(x, input_pos)
        if int(input_pos[0]) > 0:  # position 0's logits are discarded
            gaps.append(gap(logits))
            fast_seen.append(logits.detach().reshape(-1).clone())
        return logits

    model.forward_generate, model.forward_generate_fast = spy, spy_fast
    try:
        first = decode_one_token_ar(model, prompt.view(1, rows, -1), torch.arange(0, length, dtype=torch.long),
                                    temperature, top_p, SAMPLING["top_k"], bias, None, None)
        prefill_logits = seen[0][0, -1]
        frames, cur = [first.view(-1)], first.view(1, rows, -1)
        input_pos = torch.tensor([length], dtype=torch.int)
        previous = torch.zeros((rows, RAS_WIN_SIZE), dtype=torch.int)
        for _ in range(FRAMES - 1):
            with sdpa_kernel(SDPBackend.MATH):
                nxt = decode_one_token_ar(model=model, x=cur, input_pos=input_pos, previous_tokens=previous,
                                          temperature=temperature, top_p=top_p, top_k=SAMPLING["top_k"],
                                          semantic_logit_bias=bias, audio_masks=None, audio_parts=None).clone()
            input_pos += 1
            cur = nxt.view(1, rows, -1)
            previous = previous.roll(-1, dims=1)
            previous[:, -1] = nxt.view(rows, -1)[:, 0]
            frames.append(nxt.view(-1))
    finally:
        del model.forward_generate, model.forward_generate_fast
    assert len(gaps) == FRAMES * model.config.num_codebooks
    return ([[int(v) for v in f.tolist()] for f in frames], rounded(prefill_logits), float(f"{min(gaps):.6g}"),
            rounded(fast_seen[0]))


def rounded(values: torch.Tensor) -> list[float]:
    return [float(f"{v:.6g}") for v in values.tolist()]


def official_distribution(logits: list[float], bias: torch.Tensor | None, sampling: dict[str, float]) -> dict[str, Any]:
    """The official `logits_to_probs` (as `sample` calls it) on the recorded `logits` (plus `bias`): the ids it keeps
    and their probabilities."""
    x = torch.tensor(logits, dtype=torch.float32)
    if bias is not None:
        x = x + bias.reshape(-1)
    probs = inference.logits_to_probs(x, temperature=torch.tensor(sampling["temperature"]),
                                      top_p=torch.tensor(sampling["top_p"]), top_k=int(sampling["top_k"]))
    ids = torch.nonzero(probs > 0).reshape(-1)
    return {"ids": ids.tolist(), "probs": [float(f"{v:.8g}") for v in probs[ids].tolist()]}


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with each list of numbers on one line."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, list) and obj and isinstance(obj[0], (list, dict)):
        return "[\n" + ",\n".join(pad + dumps(v, indent + 1) for v in obj) + "\n" + " " * indent + "]"
    return json.dumps(obj, separators=(", ", ": "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--project-python", default="python3", help="writes the tiny checkpoint")
    source.add_argument("--checkpoint", type=Path, help="a tiny checkpoint already written for --seed")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.checkpoint or write_checkpoint(args.project_python, args.seed, Path(tmp) / "s2_pro")
        model, _ = init_model(str(directory), "cpu", torch.float32, compile=False)  # the official loading path
        check_load(model, directory)
        checkpoint = {name: sha256(directory / name) for name in
                      ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")}
    config = model.config
    model.setup_caches(max_batch_size=1, max_seq_len=config.max_seq_len, dtype=torch.float32)
    model._cache_setup_done = True  # `generate` keeps these caches
    eos_id = model.tokenizer.get_token_id(IM_END_TOKEN)
    # The bias the official `generate` builds: semantic ids and <|im_end|> allowed.
    bias = torch.full((1, 1, config.vocab_size), float("-inf"))
    bias[0, 0, config.semantic_begin_id: config.semantic_end_id + 1] = 0.0
    bias[0, 0, eos_id] = 0.0

    cases = {}
    distribution: dict[str, Any] = {}
    for name, references in make_references(args.seed, config).items():
        text = CASES[name][0]
        prompt, official = official_prompt(model, text, references)
        frames, logits, margin, fast_logits = run(model, prompt, bias)
        stop = next((i + 1 for i, f in enumerate(frames) if f[0] == eos_id), FRAMES)
        if official != frames[:stop]:
            raise SystemExit(f"{name}: the official generate gave {official}, the per-step run {frames[:stop]}")
        cases[name] = {
            "text": text,
            "references": [{"codes": codes.tolist(), "text": text} for codes, text in references],
            "prompt": prompt.tolist(),
            "prefill_logits": logits,
            "frames": frames,
            "min_greedy_margin": margin,
            "official_generate_frames": len(official),
        }
        if name == DISTRIBUTION_CASE:
            ras = {"temperature": inference.RAS_HIGH_TEMP, "top_p": inference.RAS_HIGH_TOP_P,
                   "top_k": DEFAULT_SAMPLING["top_k"]}
            wide = {**DEFAULT_SAMPLING, "top_p": 0.95}  # top_k binds here
            draws = {"token_default": ("token", DEFAULT_SAMPLING), "token_ras": ("token", ras),
                     "codebook1_default": ("codebook1", DEFAULT_SAMPLING), "codebook1_ras": ("codebook1", ras),
                     "codebook1_top_p_0.95": ("codebook1", wide)}
            distribution = {
                "case": name,
                "codebook1_code0": frames[0][1],
                "codebook1_logits": fast_logits,
                "distributions": {
                    key: {"logits": which, "sampling": params,
                          **official_distribution(logits if which == "token" else fast_logits,
                                                  bias if which == "token" else None, params)}
                    for key, (which, params) in draws.items()},
            }

    golden = {
        "seed": args.seed,
        "fish_speech_commit": FISH_SPEECH_COMMIT,
        "torch": torch.__version__,
        "checkpoint_sha256": checkpoint,
        "eos_id": eos_id,
        "semantic_ids": [config.semantic_begin_id, config.semantic_end_id],
        "sampling": SAMPLING,
        "kv_cache_len": model.max_seq_len,
        "notes": ("prompt: [1 + num_codebooks, T], the one the official generate_long builds (system message, user "
                  "message with text, assistant message opened with modality voice; encode_for_inference) from text "
                  "and references (codes [num_codebooks, frames], row 0 the semantic codebook). Frames: the prefill "
                  "on the whole prompt gives frame 0, then 9 decode steps with the official decode_one_token_ar; "
                  "each frame is [token, code0..code9], code0 = clamp(token - semantic_begin, 0, codebook_size - 1). "
                  "Generation does NOT stop at eos_id (<|im_end|>): an EOS frame is recorded and decoding goes on "
                  "with it as the next input. Only semantic ids and eos_id are allowed for the token. "
                  "prefill_logits: the raw (unbiased) token logits at the prompt's last position, 6 significant "
                  "digits. official_generate_frames: how many leading frames the official generate() (which stops "
                  "after EOS), called by generate_long, produced, all equal to these. min_greedy_margin: over the "
                  "100 greedy choices (the biased token, codebooks 1..9), the smallest top-1 minus top-2 logit gap."),
        "cases": cases,
        "sampling_distribution": distribution,
    }
    args.out.write_text(dumps(golden) + "\n")
    eos = {name: sum(f[0] == eos_id for f in case["frames"]) for name, case in cases.items()}
    lengths = {name: len(case["prompt"][0]) for name, case in cases.items()}
    print(f"seed {args.seed}: wrote {args.out.name}; prompt lengths {lengths}; EOS frames {eos}")


if __name__ == "__main__":
    main()
