"""One pydantic schema for every pipeline layout: model source, per-stage resources and engine settings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # the engine imports torch; configs are read without it
    from omni_ray.engine.loop import AdmissionWindow


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MPS_CLIENT_PRIORITIES = {"normal": "0", "below_normal": "1"}  # CUDA_MPS_CLIENT_PRIORITY's values


class StageResources(_Strict):
    """Where a stage replica runs."""

    num_cpus: float = Field(default=0.2, ge=0)
    num_gpus: float = Field(default=0, ge=0)
    custom_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each replica needs, e.g. {thinker_node: 1} to place the stage on the "
        "worker group (or nodes) that offers them",
    )
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    mps_active_thread_percentage: int | None = Field(
        default=None, ge=1, le=100,
        description="under the CUDA MPS daemon (stages sharing a GPU): the share of the GPU's SMs this stage's "
        "kernels may occupy at once (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its replica processes), so that one "
        "stage's wide kernels leave SMs free for another's; unset: all of them",
    )
    mps_client_priority: Literal["normal", "below_normal"] | None = Field(
        default=None,
        description="under the CUDA MPS daemon: this stage's scheduling priority among the GPU's clients "
        "(CUDA_MPS_CLIENT_PRIORITY in its replica processes): the GPU starts the pending work of `normal` clients "
        "before that of `below_normal` ones (it does not stop work already running); unset: the driver's default, "
        "normal. The Thinker set below normal in the 1-GPU layout on an H200 made no measurable difference",
    )
    gc_freeze_after_startup: bool = Field(
        default=False,
        description="once the replica has loaded and warmed up: collect garbage once, then move every object left "
        "(modules, compiled graphs: what startup made and keeps) out of the cyclic garbage collector's way "
        "(`gc.freeze`), so that a full collection while serving walks only what serving made. Every replica reports "
        "its collector's pauses (`omni_stage_gc_pause_s`, `omni_stage_gc_full_collections`) either way",
    )

    @model_validator(mode="after")
    def _device_matches_gpus(self) -> "StageResources":
        if self.device.startswith("cuda") and self.num_gpus == 0:
            raise ValueError("a cuda device needs num_gpus > 0")
        for name in ("mps_active_thread_percentage", "mps_client_priority"):
            if getattr(self, name) is not None and not self.device.startswith("cuda"):
                raise ValueError(f"{name} needs a cuda device")
        return self

    def actor_options(self) -> dict[str, Any]:
        """Ray actor options for a replica of the stage: CPUs, GPUs, custom resources, and its MPS share and
        priority."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.custom_resources:
            options["resources"] = self.custom_resources
        env: dict[str, str] = {}  # read when the process creates its CUDA context
        if self.mps_active_thread_percentage is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.mps_active_thread_percentage)
        if self.mps_client_priority is not None:
            env["CUDA_MPS_CLIENT_PRIORITY"] = MPS_CLIENT_PRIORITIES[self.mps_client_priority]
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options


GIL_SWITCH_DESCRIPTION = (
    "the replica process's GIL switch interval (ms), lowered from Python's 5 ms: its engine (or decode) thread waits "
    "up to this to get the GIL back from the event loop after each call that lets it go (a graph launch, a wait for "
    "the device); the shortest asked for in a process wins"
)


DEFAULT_PREFILL_GRAPH_TOKENS = 2048
DEFAULT_PERSISTENT_L2_KEEP_PERCENT = 10  # the share of the code predictor's weights its persistent passes keep in L2


class EngineSettings(_Strict):
    """Continuous-batching limits of an autoregressive stage."""

    max_batch: int = Field(default=16, ge=1)
    max_seq_len: int = Field(default=4096, ge=16)
    cuda_graphs: bool = Field(default=True, description="replay fixed-shape steps from CUDA graphs (CUDA devices only)")
    max_prefill_tokens: int = Field(default=8192, ge=16, description="padded tokens per batched prefill")
    prefill_graph_tokens: int | None = Field(
        default=DEFAULT_PREFILL_GRAPH_TOKENS, ge=0,
        description="with CUDA graphs: a prefill batch whose bucket (rows and length each a power of two) holds more "
        "padded tokens than this runs without a graph, at its own rows and its longest prompt rounded up to 16 "
        "positions (compute-bound there, where the buckets' padding costs work: 100-token prompts run as 128), and "
        "no larger prefill graph is captured at startup; null: every prefill at its bucket, from a graph. On an "
        "H200 at 32 streams the two were equally fast end to end",
    )
    split_large_prefills: bool = Field(
        default=False,
        description="with CUDA graphs: a prefill batch past `prefill_graph_tokens` runs as parts of as many prompts "
        "as fit that many padded tokens, each replayed from its graph at the batch's bucket length, instead of one "
        "eager pass at its own shape (each part reads the weights again). Split, a burst's large waves launch "
        "sooner, but the Thinker's next round then waits about as long on the device: off by default, as it was "
        "not faster end to end (TTFA, RTF) at 32 streams on H100s",
    )
    compile_layers: bool = Field(
        default=False, description="fuse each decoder layer's small ops with torch.compile (CUDA only; adds startup time)"
    )
    moe_kernels: bool = Field(
        default=True,
        description="on CUDA: a decode batch's MoE expert GEMMs as Triton kernels over the picked experts "
        "(`layers/moe_kernels.py`) instead of grouped GEMMs (on an H200 they shorten the decode steps of both the "
        "Thinker and the Talker)",
    )
    moe_layer_kernels: bool = Field(
        default=True,
        description="on CUDA, with `moe_kernels`: each MoE layer of a decode step of up to 64 rows as eight Triton "
        "kernels (`layers/small_batch_moe.py`: norm-fused GEMMs, one attention kernel with the KV write, one routing "
        "kernel, the expert kernels finding their tokens among the picks, one combine) instead of the layer's own "
        "code (about 29-33 kernels a layer compiled by inductor)",
    )
    moe_layer_folds: bool = Field(
        default=False,
        description="with `moe_layer_kernels`: six kernels a MoE layer instead of eight, the routing inside the router "
        "GEMM's kernel (its last program to finish routes) and the combine inside the down GEMM's (each column "
        "block's last program to finish combines it); the same outputs. Off by default: it was not faster on an H200",
    )
    weights_evict_first: bool = Field(
        default=False,
        description="on CUDA: the Triton GEMMs that read each weight once a step (rows in one tile: the code "
        "predictor's, the attention projections', the routers') mark the weights' lines first to go from L2, so that "
        "they stop crowding out what the step reads again (activations, partial sums, keys); the same outputs. "
        "The stage's whole process takes it (`small_batch.set_weights_evict_first`). Off by default: it did not "
        "shorten the Talker's engine step on an H100 (at 1, 8 or 32 rows)",
    )
    launch_ahead: bool | None = Field(
        default=None,
        description="queue each step on the device before reading the previous one back, so that the host's "
        "per-step work can overlap the GPU's (an end decided by a sampled token is then learnt a step late, and the "
        "extra row is dropped). Unset: on for CUDA devices (it lowers RTF: the 1-GPU layout at 32 streams on an "
        "H200), off on a CPU, where a step runs inside its launch and launching ahead only delays outputs",
    )
    early_first_tokens: bool = Field(
        default=True,
        description="Thinker: a step that prefills new requests while others decode reads the new ones' first tokens "
        "back (and relays them to the Talker) as soon as the prefill is done, instead of after the decode queued "
        "behind it in the same step (launched ahead only, as on CUDA; the Talker ignores it). On by default: in the "
        "1-GPU layout on an H200 the first token comes about 10 ms sooner at 32 streams, and TTFA is lower",
    )

    admission_quiet_ms: float = Field(
        default=0.0, ge=0, le=100,
        description="admit newly arrived requests once none has arrived for this long (or once the first of them has "
        "waited `admission_max_wait_ms`), so that a burst prefills in fewer batches, each of which reads the weights "
        "again; 0: admit at once. Costs a request that arrives alone up to this much. 0 by default: at 3 ms (1-GPU "
        "layout, 32 streams, H200) a burst still came in about 6 batches, and TTFA was no lower",
    )
    admission_max_wait_ms: float = Field(
        default=20.0, ge=0, le=1000, description="the longest a request waits for admission under `admission_quiet_ms`"
    )
    gil_switch_interval_ms: float = Field(default=0.2, gt=0, le=5, description=GIL_SWITCH_DESCRIPTION)
    max_queue_wait_s: float = Field(
        default=30.0, ge=0,
        description="a new request is refused (503 with Retry-After) before any stage opens its stream when the "
        "stage expects it to wait longer than this for admission: the token (Thinker) or frame (Talker) budgets "
        "of the requests already waiting, over the rate the engine steps rows at with a full batch (measured). "
        "0: no bound (only Serve's request counts)",
    )
    stall_timeout_s: float = Field(
        default=180.0, ge=0,
        description="the replica fails Serve's health check once one engine step has waited on the device this long "
        "(a step takes milliseconds, a shape's first CUDA graph capture or compile seconds), and Serve replaces it: "
        "its requests end with an error instead of hanging on a stuck GPU. 0: never",
    )

    def launches_ahead(self, device: str) -> bool:
        """`launch_ahead` as set, or on for a CUDA device when unset."""
        return self.launch_ahead if self.launch_ahead is not None else device.startswith("cuda")

    def admission_window(self) -> AdmissionWindow:
        """The engine loop's `AdmissionWindow` (seconds) from the two settings."""
        from omni_ray.engine.loop import AdmissionWindow

        return AdmissionWindow(self.admission_quiet_ms / 1000, self.admission_max_wait_ms / 1000)


class VocoderSettings(_Strict):
    """Streaming decode schedule: first chunks ramp, then a steady chunk size, each decoded with left context."""

    chunk_ramp: tuple[int, ...] = (1, 2, 4)
    steady_chunk: int = Field(default=8, ge=1)
    left_context: int = Field(default=25, ge=0)
    aligned_chunks: bool = Field(
        default=True,
        description="after the ramp, end each stream's chunks where the Talker's step count ends a period of "
        "`steady_chunk` steps, so the streams one Talker replica feeds decode together, in one batched call per "
        "period, instead of each on its own phase: a decode call's cost is mostly fixed (on an H200, 2.3 ms for one "
        "stream's 8 frames, 7.9 ms for 32 streams')",
    )
    max_batch: int = Field(default=64, ge=1, description="windows of equal length decoded in one call")
    batch_gather_ms: float = Field(
        default=1.0, ge=0, le=20,
        description="the decode thread, once it has a stream's chunk to decode, keeps taking others' while they come "
        "less than this apart (at most 4x this in all), so the chunks one Talker step completes decode in one call: "
        "the streams' coroutines submit them one after another. 0: decode whatever has arrived at once",
    )
    cuda_graphs: bool = Field(default=True, description="replay each (batch, window length) from a CUDA graph")
    stateful: bool = Field(
        default=True,
        description="carry each stream's attention and convolution state between chunks and decode only new frames "
        "(exact against a one-shot decode, and well under half the GPU time per Talker step at 32 streams on an "
        "H200); false re-decodes `left_context` frames with each chunk",
    )
    max_streams: int = Field(default=256, ge=1, description="stateful: streams one replica holds state for at once")
    reference_cache_mb: float = Field(
        default=64.0, ge=0,
        description="stateful, cloned voices: device memory for the decoder state after a reference's codes (a "
        "cloned voice's left context), kept by the codes' content, so a stream in a voice decoded before copies that "
        "state instead of decoding the reference ahead of its first chunk; least recently used voices leave first. "
        "0: off",
    )
    cudnn_autotune: bool = Field(
        default=False,
        description="let cuDNN time its convolution algorithms for each decode shape at warm-up (CUDA only; for the "
        "whole replica process). Opt-in until measured: in a profile inside the service, its default choice for "
        "Code2Wav included a non-tensor-core convolution and many layout conversions",
    )
    gil_switch_interval_ms: float = Field(default=0.2, gt=0, le=5, description=GIL_SWITCH_DESCRIPTION)


class TalkerSettings(EngineSettings):
    """Talker limits: a hard frame cap and a cap proportional to the reply's text length."""

    max_frames: int = Field(default=4096, ge=1)
    prefix_cache_mb: float = Field(
        default=0.0, ge=0,
        description="device memory for the keys and values of prompts' shared prefixes (a Qwen3-TTS voice's: its "
        "speaker, language and, when cloned in context, its reference transcript), so a request in a voice seen "
        "before prefills only the rest of its prompt; least recently used prefixes leave first. Off (0) by default: "
        "the rest of a prompt prefills eagerly, one request at a time, where a whole prompt's prefill replays a "
        "captured graph with the step's other prompts, and with compiled layers that is slower on a GPU",
    )
    frames_per_text_token: float = Field(default=6.0, ge=0)
    frame_budget_base: int = Field(default=25, ge=0)
    early_prefill: bool = Field(
        default=False,
        description="prefill a text-only request's prompt, all but its last position, as soon as it arrives (the "
        "Talker keeps the Thinker's token embeddings in host memory for it), so the Talker's prefill overlaps the "
        "Thinker's; the first Thinker token then costs one decode step (on in the 2-GPU layouts, where it was measured "
        "faster; off by default, as it holds the Thinker's embedding table in host memory)",
    )
    lanes: int = Field(
        default=1, ge=1, le=8,
        description="engine loops in the replica, each with max_batch/lanes of the requests, its own KV slots, CUDA "
        "graphs and CUDA stream, sharing the weights: their latency-bound steps overlap on the GPU (2 lanes at 32 "
        "streams on an H200: lower TTFA, higher RTF)",
    )
    sampling_kernel: bool = Field(
        default=True,
        description="with compiled layers on CUDA: each of a frame's 16 top-k draws as one Triton kernel "
        "(`engine/top_k_draw.py`; on an H200 a frame's draws take about a third of the time); false: inductor's "
        "fused `sample`",
    )
    code_predictor_kernels: bool = Field(
        default=True,
        description="with compiled layers on CUDA: each code-predictor layer of a frame's 15 passes as five Triton "
        "kernels (`layers/small_batch.py`: norm-fused GEMMs, one attention kernel with the KV write) instead of an "
        "inductor-compiled layer of about 25 kernels (steps of more than 64 rows x tokens keep the compiled layer); "
        "false: compiled like the Talker's own layers",
    )
    persistent_code_predictor: bool = Field(
        default=False,
        description="with the code-predictor kernels on CUDA: each of a frame's 15 passes (5 layers, the final norm "
        "and the code head) as one persistent CUDA kernel built with NVRTC at startup (`layers/persistent_pass.py`: "
        "128 blocks keep their share of each GEMM's weights in shared memory, the next share streaming in while "
        "they wait at grid barriers), at up to 32 rows x tokens; other passes keep the Triton kernels. It needs "
        "every block resident at once (128 multiprocessors, not held back by an MPS thread percentage or a "
        "below-normal MPS priority; one lane). Opt-in: each pass is faster than the Triton kernels', but its blocks "
        "hold every multiprocessor while it runs, which slows a stage sharing the GPU (the Thinker's steps in the "
        "1-GPU layout); meant for a Talker on a GPU of its own, or with `persistent_code_predictor_max_rows` on a "
        "shared one (the 1-GPU layouts: one-stream passes)",
    )
    persistent_code_predictor_max_rows: int = Field(
        default=32,
        ge=1,
        le=32,
        description="with `persistent_code_predictor`: the most rows (streams in a Talker step) a pass may have to run "
        "as the persistent kernel; larger passes keep the Triton kernels, whose short launches leave multiprocessors "
        "to a stage sharing the GPU between them",
    )
    persistent_code_predictor_l2_keep_percent: int = Field(
        default=DEFAULT_PERSISTENT_L2_KEEP_PERCENT,
        ge=0,
        le=100,
        description="with `persistent_code_predictor`: the share of the code predictor's weights (by cache line) "
        "its passes ask L2 to keep (evict_last; the rest evict_first, so that they stop crowding out what a pass "
        "reads again), so a frame's later passes find that share in L2 instead of memory (157 MB a pass, more than "
        "L2 holds); no L2 is set aside for them (on an H100 that made a pass slower). 0: plain reads. The outputs "
        "are the same either way; the default 10% shortened the Talker's engine step on an H100 at 1 and 8 rows "
        "(the same at 32)",
    )
    persistent_code_predictor_draws: bool = Field(
        default=False,
        description="with `persistent_code_predictor` and the sampling kernel: each pass's launch also draws every "
        "row's code from its logits (a block a row after one more grid barrier: top-k by radix select, top-p, the "
        "counter noise, the code's embedding and the frame's feedback sum) instead of the Triton draw kernel after "
        "it; the same codes (GPU test, bit for bit) unless a top-p sum, added in another order, lands within an ulp "
        "of its threshold. Opt-in: on an H100 it was not faster than the Triton kernel after the pass, per pass or "
        "per Talker engine step (1 to 32 rows)",
    )

    @model_validator(mode="after")
    def _one_persistent_pass_at_a_time(self) -> "TalkerSettings":
        if self.persistent_code_predictor and self.lanes > 1:
            raise ValueError("persistent_code_predictor with lanes > 1: each lane's pass needs every multiprocessor "
                             "at once, so two lanes' passes could each hold part of the GPU and wait for the other "
                             "forever; use one lane, or the Triton kernels")
        return self


RelayMode = Literal["auto", "ipc", "host", "collective"]


class StageConfig(_Strict):
    resources: StageResources = StageResources()
    relay: RelayMode = Field(
        default="auto",
        description="how this stage sends to the next one: auto (pairwise NCCL between different GPUs; between "
        "processes on one GPU, CUDA IPC for a step's message of 2 MiB or more and the host path below; else the host "
        "path), ipc (as auto, with every message between processes on one GPU through CUDA IPC), host (TCP), "
        "collective (pairwise NCCL / gloo)",
    )
    relay_listen_host: str = Field(
        default="",
        description="the address this stage's replicas listen on for host-path relay connections: empty for the "
        "node's own address (as Ray sees it); 0.0.0.0 for every interface (peers are still told the node's address)",
    )


class ThinkerStageConfig(StageConfig):
    engine: EngineSettings = EngineSettings()


class TalkerStageConfig(StageConfig):
    engine: TalkerSettings = TalkerSettings()

    @model_validator(mode="after")
    def _persistent_pass_gets_every_multiprocessor(self) -> "TalkerStageConfig":
        percentage = self.resources.mps_active_thread_percentage
        if self.engine.persistent_code_predictor and percentage is not None and percentage < 100:
            raise ValueError(f"persistent_code_predictor with mps_active_thread_percentage {percentage}: the pass "
                             "needs its 128 blocks resident at once, which a share of the multiprocessors may not hold")
        if self.engine.persistent_code_predictor and self.resources.mps_client_priority == "below_normal":
            raise ValueError("persistent_code_predictor with mps_client_priority below_normal: the pass's blocks "
                             "wait at grid barriers for blocks the GPU may hold back for normal clients' work; on an "
                             "H200 the 1-GPU service so set answered no request")
        return self


class VocoderStageConfig(StageConfig):
    streaming: VocoderSettings = VocoderSettings()


class StagesConfig(_Strict):
    """Every stage a family may have; a family runs its own (`FAMILY_STAGES`) and the others may not be set."""

    encoder: StageConfig = StageConfig()
    thinker: ThinkerStageConfig = ThinkerStageConfig()
    reference: StageConfig = StageConfig()
    talker: TalkerStageConfig = TalkerStageConfig()
    vocoder: VocoderStageConfig = VocoderStageConfig()


Family = Literal["qwen3_omni", "qwen3_tts", "s2_pro"]
# Each family's stages, in the order a request passes them.
FAMILY_STAGES: dict[str, tuple[str, ...]] = {
    "qwen3_omni": ("encoder", "thinker", "talker", "vocoder"),
    "qwen3_tts": ("reference", "talker", "vocoder"),
    "s2_pro": ("reference", "talker", "vocoder"),
}
TTSVariant = Literal["base", "custom_voice", "voice_design"]


class ModelSource(_Strict):
    """A local checkpoint directory, the embedded tiny model (generated into the cache on first use), or
    full-size random weights for speed work (shapes from `config`, tokenizer from the tiny model)."""

    family: Family = Field(default="qwen3_omni", description="the model family: qwen3_omni, qwen3_tts or s2_pro "
                          "(Fish Audio S2 Pro)")
    path: Path | None = None
    tiny_seed: int = 0
    variant: TTSVariant | None = Field(
        default=None,
        description="Qwen3-TTS only: which tiny checkpoint to make (base: voice cloning, custom_voice: named "
        "speakers, voice_design: voices from instructions; default custom_voice). A checkpoint's own config names its "
        "variant, and a random-weights config file its own",
    )
    random_weights: bool = False
    config: Path | None = Field(
        default=None,
        description="model config.json for random weights; default: Qwen3-Omni-30B-A3B's, or Qwen3-TTS 1.7B "
        "CustomVoice's",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if self.random_weights and self.path is not None:
            raise ValueError("random_weights and path are exclusive: random weights load no checkpoint")
        if self.config is not None and not self.random_weights:
            raise ValueError("config is only read with random_weights (a checkpoint brings its own)")
        if self.variant is not None and (self.family != "qwen3_tts" or self.path is not None or self.random_weights):
            raise ValueError("variant picks a tiny Qwen3-TTS checkpoint: a checkpoint or a config names its own")
        return self


class PipelineConfig(_Strict):
    model: ModelSource = ModelSource()
    stages: StagesConfig = StagesConfig()
    default_speaker: str | None = Field(
        default=None, description="the voice when a request names none; unset: the family's default (ethan for "
        "Qwen3-Omni, vivian for Qwen3-TTS CustomVoice)",
    )
    max_audio_seconds: float = Field(default=600.0, gt=0)
    voices_dir: Path | None = Field(
        default=None,
        description="Qwen3-TTS Base and S2 Pro: the directory of uploaded voices (one safetensors file each), shared "
        "by every replica that serves the model; unset: `$OMNI_RAY_CACHE/voices/<model id>` (the cache defaults to "
        "`~/.cache/omni-ray`; the id is the checkpoint directory's name and a hash of its config.json), so one "
        "model's voices are never used with another",
    )
    max_voices: int = Field(default=1000, ge=1, description="Qwen3-TTS Base and S2 Pro: the most uploaded voices "
                            "stored")

    @model_validator(mode="after")
    def _voices_are_cloned_voices(self) -> "PipelineConfig":
        if self.voices_dir is not None and self.model.family not in ("qwen3_tts", "s2_pro"):
            raise ValueError("voices_dir holds uploaded cloned voices: it needs model.family qwen3_tts or s2_pro")
        return self

    @model_validator(mode="after")
    def _only_the_familys_stages(self) -> "PipelineConfig":
        own = FAMILY_STAGES[self.model.family]
        foreign = sorted(name for name in self.stages.model_fields_set if name not in own)
        if foreign:
            raise ValueError(f"stages {', '.join(foreign)} are not {self.model.family}'s: its stages are "
                             f"{', '.join(own)}")
        return self

    @property
    def stage_names(self) -> tuple[str, ...]:
        return FAMILY_STAGES[self.model.family]

    @classmethod
    def from_yaml(cls, path: str | Path) -> "PipelineConfig":
        """A pipeline YAML, or a Serve config whose first application's `args.pipeline` holds one (with several
        models, `args.models`: the first's)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if "applications" in data:
            args = data["applications"][0].get("args") or {}
            data = args.get("pipeline") or ((args.get("models") or [{}])[0].get("pipeline")) or {}
        return cls.model_validate(data)
