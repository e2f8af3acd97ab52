"""GPU: CUDA-graph replay of the Thinker, Talker and MTP gives eager's and the CPU's tokens and codes. Skipped without CUDA."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, Qwen3OmniMoeConfig

from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.loop import run_to_end
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TALKER_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.05)


def _think(
    checkpoint: Path, device: str, dtype: torch.dtype, cuda_graphs: bool, prompts: tuple[str, ...], lengths: tuple[int, ...],
    compile_layers: bool, sampling: tuple[SamplingParams, ...] | None = None,
) -> tuple[list[ThinkerSequence], dict[str, list[Any]], int]:
    """Thinker replies of `lengths` tokens (greedy, or request i drawing with `sampling[i]`), all in one batch
    (shorter ones leave early, so the cache compacts mid-run): the sequences, each one's step outputs, and how many
    graphs ran."""
    thinker = _thinker(checkpoint, device, dtype, cuda_graphs, compile_layers)
    seqs, outputs = _think_on(thinker, checkpoint, prompts, lengths, sampling)
    return seqs, outputs, len(thinker.graphs)


def _thinker(checkpoint: Path, device: str, dtype: torch.dtype, cuda_graphs: bool, compile_layers: bool) -> ThinkerRunner:
    """A warmed-up Thinker runner with 4 KV slots."""
    config = Qwen3OmniMoeConfig.from_pretrained(checkpoint)
    tc = config.thinker_config.text_config
    thinker = ThinkerRunner(load_thinker(checkpoint, config, device, dtype), config,
                            SlotKVCache(tc.num_hidden_layers, 4, 256, tc.num_key_value_heads, tc.head_dim, dtype, device),
                            cuda_graphs=cuda_graphs, compile_layers=compile_layers)
    thinker.warmup(4)  # captures every bucket up front, writing garbage into free slots that must not leak
    return thinker


def _think_on(
    thinker: ThinkerRunner, checkpoint: Path, prompts: tuple[str, ...], lengths: tuple[int, ...],
    sampling: tuple[SamplingParams, ...] | None = None,
) -> tuple[list[ThinkerSequence], dict[str, list[Any]]]:
    """`_think`'s replies on a given runner: the sequences and each one's step outputs."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    seqs = []
    for i, prompt in enumerate(prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = sampling[i] if sampling else SamplingParams(temperature=0.0)
        seqs.append(ThinkerSequence(f"r{i}", ids, params, lengths[i], frozenset(), for_talker=True))
        thinker.admit(seqs[-1])
    outputs = run_to_end(thinker, seqs)  # shorter replies free their slots as they end
    assert not thinker.graphs.uncapturable  # every step that should replay from a graph did
    return seqs, outputs


def _talker(checkpoint: Path, device: str, dtype: torch.dtype, cuda_graphs: bool, compile_layers: bool,
            assets: Any = None, rows: int = 4) -> TalkerRunner:
    """A warmed-up Talker runner with `rows` KV slots (over `assets` when given: lanes share one model)."""
    config = Qwen3OmniMoeConfig.from_pretrained(checkpoint)
    kc = config.talker_config.text_config
    talker = TalkerRunner(assets or load_talker(checkpoint, config, device, dtype), config,
                          SlotKVCache(kc.num_hidden_layers, rows, 512, kc.num_key_value_heads, kc.head_dim, dtype, device),
                          rows, cuda_graphs=cuda_graphs, compile_layers=compile_layers)
    talker.warmup(rows)
    return talker


def _speak(talker: TalkerRunner, seqs: list[ThinkerSequence], outputs: dict[str, list[Any]], lengths: dict[str, int],
           talker_sampling: SamplingParams = TALKER_GREEDY) -> dict[str, list[list[int]]]:
    """Speech of `lengths[request]` frames for each Thinker reply, all in one batch on `talker`. A seeded
    `talker_sampling` gives request i the seed seed + i."""
    return _run_to_end(talker, _admit_speeches(talker, seqs, outputs, lengths, talker_sampling))


def _admit_speeches(talker: TalkerRunner, seqs: list[ThinkerSequence], outputs: dict[str, list[Any]],
                    lengths: dict[str, int], talker_sampling: SamplingParams) -> list[TalkerSequence]:
    """A Talker sequence per Thinker reply, admitted to `talker`, its text all there."""
    speeches = []
    for i, seq in enumerate(seqs):
        sampling = talker_sampling if talker_sampling.seed is None else \
            talker_sampling.model_copy(update={"seed": talker_sampling.seed + i})
        speech = TalkerSequence(seq.request_id, sampling, 2302, max_frames=lengths[seq.request_id])
        talker.admit(speech)
        speech.hear(outputs[seq.request_id])
        speeches.append(speech)
    return speeches


def _run_to_end(talker: TalkerRunner, speeches: list[TalkerSequence]) -> dict[str, list[list[int]]]:
    """Step the batch until every request ends, releasing each as it does; each request's frames."""
    return {request: [out.codes for out in outs if out.codes is not None]
            for request, outs in run_to_end(talker, speeches).items()}


def _reply(
    checkpoint: Path, device: str, dtype: torch.dtype, cuda_graphs: bool = True, prompts: tuple[str, ...] = ("Hello there!",),
    lengths: tuple[int, ...] = (64,), compile_layers: bool = False, talker_sampling: SamplingParams = TALKER_GREEDY,
) -> tuple[list[list[int]], list[list[list[int]]], dict[str, int]]:
    """Greedy replies of `lengths` tokens and speech of `lengths` frames for each prompt, all in one batch; plus how
    many graphs ran. A seeded `talker_sampling` gives request i the seed seed + i."""
    seqs, outputs, thinker_graphs = _think(checkpoint, device, dtype, cuda_graphs, prompts, lengths, compile_layers)
    talker = _talker(checkpoint, device, dtype, cuda_graphs, compile_layers)
    frames = _speak(talker, seqs, outputs, {s.request_id: n for s, n in zip(seqs, lengths)}, talker_sampling)
    assert not talker.graphs.uncapturable
    graphs = {"thinker": thinker_graphs, "talker": len(talker.graphs)}
    return [s.output_ids for s in seqs], [frames[s.request_id] for s in seqs], graphs


@pytest.mark.parametrize("compile_layers", [False, True], ids=["graphs", "graphs+compiled-layers"])
def test_cuda_graph_decode_matches_cpu_for_64_steps(tiny_checkpoint: Path, compile_layers: bool) -> None:
    """fp32 on CUDA, replayed from graphs (with inductor-fused layers or without), against the CPU: the same 64
    tokens and 64 frames of 16 codes."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_tokens, cpu_frames, _ = _reply(tiny_checkpoint, "cpu", torch.float32)
    gpu_tokens, gpu_frames, graphs = _reply(tiny_checkpoint, "cuda", torch.float32, compile_layers=compile_layers)
    assert len(cpu_tokens[0]) == 64 and len(cpu_frames[0]) == 64
    assert graphs["thinker"] > 0 and graphs["talker"] > 0
    assert gpu_tokens == cpu_tokens
    assert gpu_frames == cpu_frames


def test_graph_replay_matches_eager_in_bfloat16_for_a_batch(tiny_checkpoint: Path) -> None:
    """bf16, four requests of different prompt and reply lengths in one batch: graph replay gives eager's tokens
    (Thinker), group-0 codes (Talker) and MTP codes (groups 1-15), for up to 64 steps, as requests leave."""
    prompts = ("Hello there!", "Tell me a story about a dog.", "Hi", "What is the weather like today in the city?")
    lengths = (64, 40, 64, 17)
    eager_tokens, eager_frames, eager_graphs = _reply(tiny_checkpoint, "cuda", torch.bfloat16, False, prompts, lengths)
    graph_tokens, graph_frames, graphs = _reply(tiny_checkpoint, "cuda", torch.bfloat16, True, prompts, lengths)
    assert eager_graphs == {"thinker": 0, "talker": 0}
    assert graphs["thinker"] >= 3 and graphs["talker"] >= 4  # prefill + decode buckets; + the frame graphs
    assert [len(t) for t in eager_tokens] == list(lengths) and [len(f) for f in eager_frames] == list(lengths)
    assert graph_tokens == eager_tokens
    assert [[f[0] for f in frames] for frames in graph_frames] == [[f[0] for f in frames] for frames in eager_frames]
    assert graph_frames == eager_frames


def test_text_embeddings_arriving_partly_on_the_host_speak_what_embeddings_on_the_gpu_speak(tiny_checkpoint: Path) -> None:
    """On one GPU the relay hands each Thinker step's message over through CUDA IPC or on the host path by its size,
    so a request's text embeddings arrive some on the GPU and some on the host, and one Talker step's rows mix both
    (the 1-GPU service once lost whole batches of 32 requests to a device mismatch there). With every other
    embedding of each request moved to the host (rows of one step on both), the Talker speaks the frames it speaks
    with all of them on the GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = ("Hello there!", "Tell me a story about a dog.", "Hi")
    lengths = (24, 16, 24)
    seqs, outputs, _ = _think(tiny_checkpoint, "cuda", torch.float32, True, prompts, lengths, False)
    frames = {s.request_id: n for s, n in zip(seqs, lengths)}
    talker = _talker(tiny_checkpoint, "cuda", torch.float32, True, False)
    on_gpu = _speak(talker, seqs, outputs, frames)
    mixed = {request: [replace(out, talker_embed=out.talker_embed.cpu())
                       if out.talker_embed is not None and (i + step) % 2 else out for step, out in enumerate(outs)]
             for i, (request, outs) in enumerate(outputs.items())}
    devices = {out.talker_embed.device.type for outs in mixed.values() for out in outs if out.talker_embed is not None}
    assert devices == {"cpu", "cuda"}
    assert _speak(talker, seqs, mixed, frames) == on_gpu
    assert [len(on_gpu[s.request_id]) for s in seqs] == list(lengths)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-ops", "compiled-layers+draw-kernel"])
def test_seeded_talker_sampling_replayed_from_graphs_draws_eagers_codes(tiny_checkpoint: Path, compiled: bool) -> None:
    """The service's Talker sampling (group 0: top-k 50 and a repetition penalty; MTP: top-k 50, top-p 0.8), seeded:
    the noise is made inside the frame graph from each request's keys, so graph replay draws eager's codes, frame by
    frame, for a batch of four; another seed draws other codes. Compiled: the same layers and the Triton draw kernel
    run eagerly and replayed. The replayed run goes first: on an H200 an eager run first, in a fresh process with the
    code predictor's and the MoE kernels, gave other codes than replay from frame 1-4 on (bf16), while the variants
    run after it in the same process matched (in fp32 the replayed compiled layers give the CPU's greedy codes,
    `test_cuda_graph_decode_matches_cpu...`)."""
    prompts = ("Hello there!", "Tell me a story about a dog.", "Hi", "What is the weather like today in the city?")
    lengths = (48, 32, 48, 17)
    served = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=7)
    _, replayed, graphs = _reply(tiny_checkpoint, "cuda", torch.bfloat16, True, prompts, lengths, compiled, served)
    _, eager, _ = _reply(tiny_checkpoint, "cuda", torch.bfloat16, False, prompts, lengths, compiled, served)
    other = served.model_copy(update={"seed": 1000})
    _, reseeded, _ = _reply(tiny_checkpoint, "cuda", torch.bfloat16, True, prompts, lengths, compiled, other)
    assert graphs["talker"] >= 4 and [len(f) for f in replayed] == list(lengths)
    assert replayed == eager
    assert reseeded != replayed


def test_seeded_thinker_sampling_replayed_from_graphs_draws_eagers_tokens(tiny_checkpoint: Path) -> None:
    """Greedy, penalized and top-k/top-p rows in one batch of three (a bucket of four): the draw replays from a graph
    per (row bucket, draw mode), updating the histories it penalizes inside it, and gives eager's tokens."""
    prompts = ("Hello there!", "Tell me a story about a dog.", "Hi")
    sampling = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=3),
                SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=4))
    eager, _, eager_graphs = _think(tiny_checkpoint, "cuda", torch.bfloat16, False, prompts, (40, 40, 24), False, sampling)
    replayed, _, graphs = _think(tiny_checkpoint, "cuda", torch.bfloat16, True, prompts, (40, 40, 24), False, sampling)
    assert eager_graphs == 0 and graphs > 0
    assert [s.output_ids for s in replayed] == [s.output_ids for s in eager]
    assert len(set(replayed[1].output_ids)) > 1


def _launch_without_syncs(runner: Any, seqs: list[Any]) -> Any:
    """`runner.launch(seqs)` with torch raising on any host sync in it."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return runner.launch(seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_decode_launches_never_wait_for_the_gpu(tiny_checkpoint: Path) -> None:
    """A decode step's launch, Thinker's and Talker's (graphs, seeded sampling with a repetition penalty), queues its
    work and returns: torch sees no host sync in it, so an engine launching ahead builds the next step while the GPU
    runs this one (a sync in every launch, from a history set to a host `True`, was once found here)."""
    prompts = ("Hello there!", "Tell me a story about a dog.")
    sampling = tuple(SamplingParams(temperature=0.8, repetition_penalty=1.1, seed=i) for i in range(2))
    seqs, outputs, _ = _think(tiny_checkpoint, "cuda", torch.bfloat16, True, prompts, (24, 24), False, sampling)
    config = Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint)
    tc = config.thinker_config.text_config
    thinker = ThinkerRunner(load_thinker(tiny_checkpoint, config, "cuda", torch.bfloat16), config,
                            SlotKVCache(tc.num_hidden_layers, 4, 256, tc.num_key_value_heads, tc.head_dim,
                                        torch.bfloat16, "cuda"), cuda_graphs=True)
    thinker.warmup(4)
    again = [ThinkerSequence(f"s{i}", seq.prompt_ids, seq.sampling, 8, frozenset(), for_talker=True)
             for i, seq in enumerate(seqs)]
    for seq in again:
        thinker.admit(seq)
    thinker.step(again)  # the prefill
    for _ in range(3):
        thinker.collect(_launch_without_syncs(thinker, again))
    talker = _talker(tiny_checkpoint, "cuda", torch.bfloat16, True, False)
    speeches = _admit_speeches(talker, seqs, outputs, {s.request_id: 24 for s in seqs},
                               SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=7))
    talker.step(speeches)  # the prefill and first frame
    for _ in range(3):
        assert all(out.codes is not None for out in talker.collect(_launch_without_syncs(talker, speeches)))
    assert not thinker.graphs.uncapturable and not talker.graphs.uncapturable


def test_grouped_moe_matches_the_loop_on_a_full_size_layer() -> None:
    """The Thinker's expert shapes (128 experts, 2048 wide, 768 inner), 1-100 tokens picking 8: grouped GEMMs, and
    for decode batches the Triton expert kernels, give the per-expert loop's output."""
    from omni_ray.layers.moe import Experts

    torch.manual_seed(0)
    with torch.device("cuda"):
        experts = Experts(128, 2048, 768).to(torch.bfloat16)
        torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
        torch.nn.init.normal_(experts.down_proj, std=0.02)
        for tokens in (1, 8, 32, 100):
            x = torch.randn(tokens, 2048, dtype=torch.bfloat16)
            chosen = torch.stack([torch.randperm(128)[:8] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, 8), -1)
            grouped, looped = experts.grouped(x, chosen, weights), experts.looped(x, chosen, weights)
            # bf16 keeps ~3 significant digits; the two paths round and sum in different orders.
            error = (grouped.float() - looped.float()).norm() / looped.float().norm()
            assert error < 1e-2, error
            if tokens <= 64:  # the Triton expert kernels (a decode batch), eagerly and from a CUDA graph
                kernels = experts.with_kernels(x, chosen, weights)
                error = (kernels.float() - looped.float()).norm() / looped.float().norm()
                assert error < 1e-2, error
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    replayed = experts.with_kernels(x, chosen, weights)
                graph.replay()
                torch.testing.assert_close(replayed, kernels)


def test_talker_lanes_on_their_own_streams_step_as_they_do_one_after_the_other(tiny_checkpoint: Path) -> None:
    """Engine lanes: two Talker runners over one model (compiled layers, the draw kernel, graphs), two requests each,
    stepping at the same time from two threads on their own CUDA streams, make exactly the codes they make one lane
    after the other on the default stream: no lane reads another's buffers, graphs or caches mid-step."""
    import threading

    prompts = ("Hello there!", "Tell me a story about a dog.", "Hi", "What is the weather like today in the city?")
    lengths = (48, 40, 48, 24)
    seqs, outputs, _ = _think(tiny_checkpoint, "cuda", torch.bfloat16, True, prompts, lengths, True)
    frames_of = {s.request_id: n for s, n in zip(seqs, lengths)}
    config = Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint)
    assets = load_talker(tiny_checkpoint, config, "cuda", torch.bfloat16)
    halves = (seqs[:2], seqs[2:])

    one_after_the_other: dict[str, list[list[int]]] = {}
    for half in halves:
        lane = _talker(tiny_checkpoint, "cuda", torch.bfloat16, True, True, assets, rows=2)
        one_after_the_other.update(_speak(lane, half, outputs, frames_of))

    lanes = [_talker(tiny_checkpoint, "cuda", torch.bfloat16, True, True, assets, rows=2) for _ in halves]
    together: dict[str, list[list[int]]] = {}
    errors: list[BaseException] = []

    def run(lane: TalkerRunner, half: list[ThinkerSequence]) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                together.update(_speak(lane, half, outputs, frames_of))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(lane, half)) for lane, half in zip(lanes, halves)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert not any(lane.graphs.uncapturable for lane in lanes)
    assert [len(one_after_the_other[s.request_id]) for s in seqs] == list(lengths)
    assert together == one_after_the_other


def test_early_talker_prefill_replayed_from_graphs_speaks_what_the_whole_prompt_prefill_speaks(tiny_checkpoint: Path) -> None:
    """fp32, graphs: prefilling all but the prompt's last position before the first reply token (from the prompt
    ids), then running that position as a decode step, gives the whole-prompt prefill's frames for a batch of two."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts, lengths = ("Hello there!", "Tell me a story about a dog."), (40, 24)
    seqs, outputs, _ = _think(tiny_checkpoint, "cuda", torch.float32, True, prompts, lengths, False)
    frames_of = {s.request_id: n for s, n in zip(seqs, lengths)}
    whole = _speak(_talker(tiny_checkpoint, "cuda", torch.float32, True, False), seqs, outputs, frames_of)

    config = Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint)
    assets = load_talker(tiny_checkpoint, config, "cuda", torch.float32, thinker_embeddings=True)
    talker = _talker(tiny_checkpoint, "cuda", torch.float32, True, False, assets)
    speeches = []
    for seq in seqs:
        speech = TalkerSequence(seq.request_id, TALKER_GREEDY, 2302, max_frames=frames_of[seq.request_id])
        talker.admit(speech)
        speech.prefix, speech.early = assets.prompt_prefix(seq.prompt_ids, config), True
        speeches.append(speech)
    assert talker.step(speeches) == [] and talker.early_prefills == 2  # prefilled before any reply token
    for speech, seq in zip(speeches, seqs):
        speech.text_embeds += [out.talker_embed for out in outputs[seq.request_id] if out.talker_embed is not None]
        speech.thinker_done = True
    early = _run_to_end(talker, speeches)
    assert [len(whole[s.request_id]) for s in seqs] == list(lengths)
    assert early == whole


def test_prefills_past_the_graph_budget_at_their_own_length_say_what_bucketed_graph_prefills_say(
    tiny_checkpoint: Path,
) -> None:
    """fp32, compiled layers: a batch of four prompts prefilled eagerly at its own rows and its longest prompt rounded
    up to 16 positions (`prefill_graph_tokens=0`; the engines' default does so above 2,048 padded tokens) gives the
    tokens and frames that prefills padded to their bucket and replayed from graphs give, on the same warmed-up
    runners (one compile), Thinker and Talker both."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = ("Hello there!", "Tell me a story about a dog.", "Hi", "What is the weather like today in the city?")
    lengths = (24, 16, 24, 9)
    thinker = _thinker(tiny_checkpoint, "cuda", torch.float32, True, True)
    talker = _talker(tiny_checkpoint, "cuda", torch.float32, True, True)
    replies = []
    for graph_tokens in (None, 0):  # None: every prefill at its bucket, from a graph
        thinker.prefill_graph_tokens = talker.prefill_graph_tokens = graph_tokens
        seqs, outputs = _think_on(thinker, tiny_checkpoint, prompts, lengths)
        frames = _speak(talker, seqs, outputs, {s.request_id: n for s, n in zip(seqs, lengths)})
        replies.append(([s.output_ids for s in seqs], [frames[s.request_id] for s in seqs]))
    assert [len(tokens) for tokens in replies[0][0]] == list(lengths)
    assert [len(frames) for frames in replies[0][1]] == list(lengths)
    assert replies[1] == replies[0]
