"""The Talker runner in-process: stopping at codec EOS, the text-proportional frame limit, waiting on text, steps
launched before the previous one is collected, the codec feedback its MTP passes sum, and a step's new prompts built
as one batch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, Qwen3OmniMoeConfig

from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

GREEDY_TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05)


@pytest.fixture(scope="module")
def parts(tiny_checkpoint: Path) -> dict[str, Any]:
    config = Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Good morning!"}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    text = config.thinker_config.text_config
    thinker = ThinkerRunner(
        load_thinker(tiny_checkpoint, config, "cpu", torch.float32), config,
        SlotKVCache(text.num_hidden_layers, 2, 256, text.num_key_value_heads, text.head_dim, torch.float32, "cpu"),
    )
    seq = ThinkerSequence("t", list(ids), SamplingParams(temperature=0.0), 12, frozenset(), for_talker=True)
    thinker.admit(seq)
    outputs = []
    while seq.finish_reason is None:
        outputs += thinker.step([seq])
    return {"config": config, "checkpoint": tiny_checkpoint, "thinker_outputs": outputs, "prompt_ids": list(ids)}


def _runner(parts: dict[str, Any], prefill_graph_tokens: int | None = None, split: bool = False) -> TalkerRunner:
    config = parts["config"]
    text = config.talker_config.text_config
    cache = SlotKVCache(text.num_hidden_layers, 2, 512, text.num_key_value_heads, text.head_dim, torch.float32, "cpu")
    return TalkerRunner(load_talker(parts["checkpoint"], config, "cpu", torch.float32), config, cache, max_batch=2,
                        prefill_graph_tokens=prefill_graph_tokens, split_large_prefills=split)


def _run(runner: TalkerRunner, seq: TalkerSequence, max_steps: int = 500) -> list[list[int]]:
    frames = []
    for _ in range(max_steps):
        if seq.finish_reason is not None:
            break
        assert runner.ready(seq)
        frames += [o.codes for o in runner.step([seq]) if o.codes is not None]
    runner.release(seq)
    return frames


def _run_pipelined(runner: TalkerRunner, seq: TalkerSequence, max_steps: int = 500) -> tuple[list[list[int]], list[Any]]:
    """As the engine loop runs a pipelined runner: launch step N+1, then collect step N. Returns the frames and every
    output, in order."""
    outputs: list[Any] = []
    pending = None
    for _ in range(max_steps):
        launched = runner.launch([seq]) if seq.finish_reason is None else None
        if pending is not None:
            outputs += runner.collect(pending)
        pending = launched
        if pending is None and seq.finish_reason is not None:
            break
    runner.release(seq)
    return [o.codes for o in outputs if o.codes is not None], outputs


def test_frame_limit_is_proportional_to_the_text(parts: dict[str, Any]) -> None:
    runner = _runner(parts)
    speaker = parts["config"].talker_config.speaker_id["ethan"]
    seq = TalkerSequence("a", GREEDY_TALKER, speaker, max_frames=4096, frames_per_text_token=2.0, frame_budget_base=3)
    runner.admit(seq)
    seq.hear(parts["thinker_outputs"])
    frames = _run(runner, seq)
    assert len(seq.text_embeds) == 11  # 12 reply tokens: the last one is never fed back, so never spoken
    assert len(frames) == 3 + 2 * 11
    assert seq.finish_reason == "length"  # random weights never emit codec EOS: reported as a length stop
    assert all(len(f) == 16 and all(0 <= c < 2048 for c in f) for f in frames)


def test_codec_eos_stops_the_request_without_a_frame(parts: dict[str, Any]) -> None:
    runner = _runner(parts)
    config = parts["config"]
    speaker = config.talker_config.speaker_id["ethan"]
    reference = TalkerSequence("r", GREEDY_TALKER, speaker, max_frames=6)
    runner.admit(reference)
    reference.hear(parts["thinker_outputs"])
    first = _run(runner, reference)[0][0]
    # Make codec EOS outscore the group-0 code the model picks for its first frame: a real weight edit.
    eos = config.talker_config.codec_eos_token_id

    def speak_with_eos_favoured(seq: TalkerSequence, pipelined: bool = False) -> tuple[int, list[list[int]]]:
        head = runner.model.codec_head.weight
        with torch.no_grad():
            saved = head[eos].clone()
            head[eos] = head[first] * 50
        try:
            runner.admit(seq)
            slot = seq.slot
            seq.hear(parts["thinker_outputs"])
            if not pipelined:
                return slot, _run(runner, seq)
            frames, outputs = _run_pipelined(runner, seq)
            # the step launched after the EOS step (before its codes were read) reports nothing
            assert [o.finish_reason for o in outputs] == [None] * len(frames) + ["stop"]
            return slot, frames
        finally:
            with torch.no_grad():
                head[eos] = saved

    seq = TalkerSequence("e", GREEDY_TALKER, speaker, max_frames=6)
    slot, frames = speak_with_eos_favoured(seq)
    assert seq.finish_reason == "stop"
    assert len(frames) < 6
    assert bool(runner.seen[slot, eos])  # the step that ended it sampled EOS as its group-0 code
    late = TalkerSequence("p", GREEDY_TALKER, speaker, max_frames=6)
    assert speak_with_eos_favoured(late, pipelined=True)[1] == frames  # EOS read a step late: the same reply
    assert late.finish_reason == "stop" and late.frames == len(frames)
    # Benchmark mode: the same EOS-loving weights, but EOS is never sampled and the frame cap ends the reply.
    forced = TalkerSequence("n", GREEDY_TALKER, speaker, max_frames=6, ignore_eos=True)
    slot, frames = speak_with_eos_favoured(forced)
    assert forced.finish_reason == "length" and len(frames) == 6 and not bool(runner.seen[slot, eos])


def test_thinker_ignore_eos_runs_to_max_tokens(parts: dict[str, Any]) -> None:
    config, checkpoint = parts["config"], parts["checkpoint"]
    text = config.thinker_config.text_config
    runner = ThinkerRunner(
        load_thinker(checkpoint, config, "cpu", torch.float32), config,
        SlotKVCache(text.num_hidden_layers, 2, 256, text.num_key_value_heads, text.head_dim, torch.float32, "cpu"),
    )
    first = parts["thinker_outputs"][0].token  # the greedy first reply token: make it a stop token
    prompt = parts["prompt_ids"]
    stopping = ThinkerSequence("s", prompt, SamplingParams(temperature=0.0), 10, frozenset({first}))
    ignoring = ThinkerSequence("i", prompt, SamplingParams(temperature=0.0), 10, frozenset({first}), ignore_eos=True)
    for seq in (stopping, ignoring):
        runner.admit(seq)
        while seq.finish_reason is None:
            runner.step([seq])
    assert stopping.output_ids == [first] and stopping.finish_reason == "stop"
    assert len(ignoring.output_ids) == 10 and ignoring.finish_reason == "length"


def test_talker_waits_for_text_it_has_not_received(parts: dict[str, Any]) -> None:
    runner = _runner(parts)
    seq = TalkerSequence("w", GREEDY_TALKER, parts["config"].talker_config.speaker_id["ethan"], max_frames=50)
    runner.admit(seq)
    outputs = parts["thinker_outputs"]
    assert not runner.ready(seq)  # nothing yet
    seq.hear([replace(outputs[0], talker_embed=None)], done=False)  # prefill states only: no reply token yet
    assert not runner.ready(seq)
    seq.hear(outputs[:1], done=False)  # the Thinker's prefill step relays reply token 0's embedding with them
    assert runner.ready(seq)
    runner.step([seq])  # prefill, frame 1
    assert not runner.ready(seq)  # step 0 needs reply token 1: not sent yet
    seq.hear(outputs[1:3], done=False)  # embeddings of reply tokens 1 and 2
    for _ in range(2):
        assert runner.ready(seq)
        runner.step([seq])
    assert not runner.ready(seq)  # step 2 needs reply token 3
    seq.end_text()
    assert runner.ready(seq) and seq.text_end_received is not None  # the Thinker finished: tts_eos, then tts_pad
    assert seq.text_read_launched is None  # every step so far read a reply token
    runner.step([seq])  # step 2 reads tts_eos: the first step past the reply's tokens
    assert seq.text_end_received <= seq.text_read_launched
    first_past = seq.text_read_launched
    runner.step([seq])  # tts_pad: the time kept is the first step's
    assert seq.text_read_launched == first_past


def test_seeded_sampled_speech_repeats_and_filters_only_top_k_candidates(parts: dict[str, Any]) -> None:
    from omni_ray.models.qwen3_omni.talker import MTP_SAMPLING, FrameSampling

    runner = _runner(parts)
    speaker = parts["config"].talker_config.speaker_id["ethan"]
    sampling = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=3)
    # the released sampling filters 64 candidates per row, never a sort of the whole codebook
    assert FrameSampling.of([sampling], [MTP_SAMPLING]) == FrameSampling(True, 64, 64)
    assert FrameSampling.of([GREEDY_TALKER], [GREEDY_TALKER]) == FrameSampling(False)

    def speak(params: SamplingParams) -> list[list[int]]:
        seq = TalkerSequence("s", params, speaker, max_frames=8)
        runner.admit(seq)
        seq.hear(parts["thinker_outputs"])
        return _run(runner, seq)

    first = speak(sampling)
    assert len(first) == 8 and speak(sampling) == first  # same seed, same frames
    assert first != speak(GREEDY_TALKER)  # it really sampled


def test_a_prefill_without_bucket_padding_speaks_the_same_frames(parts: dict[str, Any]) -> None:
    """Two Talker prompts of 48 positions (39 user states) prefilled as one batch at their bucket (2 rows x 64
    positions), at their own length rounded up to 16 (2 x 48, `prefill_graph_tokens=0`), and as two parts of one row
    at the bucket (`split_large_prefills` past 64 tokens): the same frames."""
    from omni_ray.bench import _talker_seqs

    frames = []
    # the bucket; the prompts' own length; parts of one row each at the bucket (`split_large_prefills`, 2 x 64 > 64)
    for graph_tokens, split in ((None, False), (0, False), (64, True)):
        torch.manual_seed(3)  # the same random Thinker states each time
        seqs = _talker_seqs(parts["config"], 2, 39, 6, GREEDY_TALKER)
        runner = _runner(parts, graph_tokens, split)
        for seq in seqs:
            runner.admit(seq)
        assert runner._prompt_length(seqs[0]) == 48
        made: dict[str, list[list[int]]] = {seq.request_id: [] for seq in seqs}
        while any(seq.finish_reason is None for seq in seqs):
            for out in runner.step([seq for seq in seqs if seq.finish_reason is None]):
                if out.codes is not None:
                    made[out.request_id].append(out.codes)
        frames.append(made)
    assert frames[0] == frames[1] == frames[2] and all(len(codes) == 16 for codes in frames[0].values())


def test_early_prefill_speaks_what_the_whole_prompt_prefill_speaks(parts: dict[str, Any]) -> None:
    """Early prefill (text-only prompts): the Talker builds the Thinker's prefix from the prompt ids, prefills all
    but the prompt's last position before the first reply token exists, and runs that position as its first decode
    step once the token arrives. Its frames are the whole-prompt prefill's; with no reply text it stops."""
    config, outputs = parts["config"], parts["thinker_outputs"]
    speaker = config.talker_config.speaker_id["ethan"]
    whole_runner = _runner(parts)
    whole = TalkerSequence("w", GREEDY_TALKER, speaker, max_frames=30)
    whole_runner.admit(whole)
    whole.hear(outputs)
    expected = _run(whole_runner, whole)

    text = config.talker_config.text_config
    assets = load_talker(parts["checkpoint"], config, "cpu", torch.float32, thinker_embeddings=True)
    runner = TalkerRunner(assets, config, SlotKVCache(text.num_hidden_layers, 2, 512, text.num_key_value_heads,
                                                      text.head_dim, torch.float32, "cpu"), max_batch=2)
    seq = TalkerSequence("e", GREEDY_TALKER, speaker, max_frames=30)
    runner.admit(seq)
    seq.prefix, seq.early = assets.prompt_prefix(parts["prompt_ids"], config), True
    relayed = outputs[0].talker_prefix  # what the Thinker sends after its prefill: the same tensors
    assert all(torch.equal(seq.prefix[key], relayed[key].cpu()) for key in relayed)
    assert runner.ready(seq)  # before any reply token
    assert runner.step([seq]) == []  # prefilled, no frame yet
    assert not runner.ready(seq)  # the prompt's last position needs the first reply token
    seq.hear(outputs)
    assert _run(runner, seq) == expected and len(expected) == 30
    # one prefill batch each: the early one's last position ran as a decode step
    assert (runner.prefills.batches, runner.prefills.sequences) == (1, 1)
    assert (whole_runner.prefills.batches, whole_runner.prefills.sequences) == (1, 1)

    silent = TalkerSequence("s", GREEDY_TALKER, speaker, max_frames=30)
    runner.admit(silent)
    silent.prefix, silent.early = assets.prompt_prefix(parts["prompt_ids"], config), True
    runner.step([silent])
    silent.thinker_done = True  # the Thinker ended without a reply token
    assert runner.ready(silent)
    assert [(o.codes, o.finish_reason) for o in runner.step([silent])] == [(None, "stop")]


def test_steps_launched_ahead_speak_what_steps_run_one_at_a_time(parts: dict[str, Any]) -> None:
    """The engine launches step N+1 before it collects step N. The frames and the ends are the same (and each frame
    its step); a Thinker end that arrives between a step's launch and its collection still cuts the reply at the
    text-proportional limit."""
    runner = _runner(parts)
    speaker = parts["config"].talker_config.speaker_id["ethan"]

    def speech(name: str) -> TalkerSequence:
        seq = TalkerSequence(name, GREEDY_TALKER, speaker, max_frames=4096, frames_per_text_token=2.0, frame_budget_base=3)
        runner.admit(seq)
        return seq

    one_at_a_time = speech("a")
    one_at_a_time.hear(parts["thinker_outputs"])
    expected = _run(runner, one_at_a_time)
    ahead = speech("b")
    ahead.hear(parts["thinker_outputs"])
    assert runner.frame_steps == len(expected)
    frames, outputs = _run_pipelined(runner, ahead)
    assert frames == expected and len(frames) == 3 + 2 * 11
    assert [o.finish_reason for o in outputs] == [None] * (len(frames) - 1) + ["length"]
    # each frame carries its step on the runner's clock, which the vocoder ends its aligned chunks on; alone, a
    # request starts it again at 0 (so it is chunked the same way every time)
    assert [o.step for o in outputs] == list(range(len(frames)))

    first, second = speech("x"), speech("y")  # a request joining one that speaks shares its clock
    first.hear(parts["thinker_outputs"])
    second.hear(parts["thinker_outputs"])
    assert [o.step for _ in range(3) for o in runner.step([first])] == [0, 1, 2]
    assert sorted((o.request_id, o.step) for o in runner.step([first, second])) == [("x", 3), ("y", 3)]
    runner.release(first)
    runner.release(second)

    late = speech("c")  # the Thinker's end arrives after the step making frame 25 was launched
    late.hear(parts["thinker_outputs"], done=False)
    pending = None
    collected: list[Any] = []
    while len(collected) < 25:
        launched = runner.launch([late])
        if pending is not None:
            collected += runner.collect(pending)
        pending = launched
    late.thinker_done = True
    collected += runner.collect(pending)  # frame 26 (launched before the end was known) is dropped
    assert [o.codes for o in collected if o.codes is not None] == expected
    assert (collected[-1].codes, collected[-1].finish_reason) == (None, "length")
    assert late.frames == len(expected)
    runner.release(late)


def test_thinker_steps_launched_ahead_make_what_steps_run_one_at_a_time(parts: dict[str, Any]) -> None:
    """Launching Thinker step N+1 before collecting step N gives the same tokens, ends and Talker inputs; a stop
    token learnt a step late drops the row stepped after it."""
    config, checkpoint, prompt = parts["config"], parts["checkpoint"], parts["prompt_ids"]
    text = config.thinker_config.text_config
    runner = ThinkerRunner(
        load_thinker(checkpoint, config, "cpu", torch.float32), config,
        SlotKVCache(text.num_hidden_layers, 2, 256, text.num_key_value_heads, text.head_dim, torch.float32, "cpu"),
    )

    def launched_ahead(seq: ThinkerSequence) -> list[Any]:
        runner.admit(seq)
        outputs: list[Any] = []
        pending = None
        while seq.finish_reason is None or pending is not None:
            launched = runner.launch([seq]) if seq.finish_reason is None else None
            if pending is not None:
                outputs += runner.collect(pending)
            pending = launched
        runner.release(seq)
        return outputs

    expected = parts["thinker_outputs"]  # one step at a time, 12 tokens
    ahead = launched_ahead(ThinkerSequence("a", prompt, SamplingParams(temperature=0.0), 12, frozenset(), for_talker=True))
    assert [(o.token, o.finish_reason) for o in ahead] == [(o.token, o.finish_reason) for o in expected]
    assert ahead[-1].finish_reason == "length" and ahead[-1].talker_embed is None
    for got, want in zip(ahead, expected):
        assert (got.talker_embed is None) == (want.talker_embed is None)
        if want.talker_embed is not None:
            assert torch.equal(got.talker_embed, want.talker_embed)
    assert set(ahead[0].talker_prefix) == set(expected[0].talker_prefix)

    third = expected[2].token  # a stop token at the third reply token: the fourth step is already launched then
    stopping = ThinkerSequence("s", prompt, SamplingParams(temperature=0.0), 12, frozenset({third}))
    ahead = launched_ahead(stopping)
    assert [(o.token, o.finish_reason) for o in ahead] == [(o.token, None) for o in expected[:2]] + [(third, "stop")]
    assert stopping.output_ids == [o.token for o in expected[:3]] and stopping.num_made == 4


def test_feedback_is_the_frames_summed_code_embedding(parts: dict[str, Any]) -> None:
    """What a frame hands the next Talker step, summed pass by pass, is `frame_embedding` of its codes (sampled)."""
    runner = _runner(parts)
    sampled = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=11)
    seq = TalkerSequence("s", sampled, parts["config"].talker_config.speaker_id["ethan"], max_frames=4)
    runner.admit(seq)
    seq.hear(parts["thinker_outputs"])
    codes, feedback = [], []
    while seq.finish_reason is None:
        codes += [o.codes for o in runner.step([seq]) if o.codes is not None]
        feedback.append(runner.feedback[seq.slot].clone())
    runner.release(seq)
    assert len(codes) == 4
    with torch.inference_mode():
        expected = runner.model.frame_embedding(torch.tensor(codes))
    assert torch.equal(torch.stack(feedback), expected)


def test_a_batch_of_prompts_is_each_prompt_built_alone(parts: dict[str, Any]) -> None:
    """The Talker builds a step's new prompts in one batch (projections over every request's states at once): each
    equals the prompt built alone, for user turns of different lengths, a multimodal position, two speakers, and
    the early prompts (before the first reply token) too."""
    from omni_ray.bench import _talker_seqs

    torch.manual_seed(5)
    seqs = []
    for index, (positions, speaker) in enumerate([(7, 2302), (19, 2301), (12, 2302)]):
        seq = _talker_seqs(parts["config"], 1, positions, 2, GREEDY_TALKER)[0]
        seq.request_id, seq.speaker_id = f"p{index}", speaker
        seqs.append(seq)
    seqs[1].prefix["user_multimodal"][4] = True  # type: ignore[index]  # read through the hidden projection
    runner = _runner(parts)
    for early in (False, True):
        with torch.inference_mode():
            batch = runner._prompts(seqs, early)
            alone = [runner._prompts([seq], early)[0] for seq in seqs]
        assert [p.shape[0] for p in batch] == [n + (8 if early else 9) for n in (7, 19, 12)]
        for together, single in zip(batch, alone):
            torch.testing.assert_close(together, single, rtol=1e-5, atol=1e-6)
