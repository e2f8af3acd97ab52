"""A dense decoder stack's few-row decode pass, final norm and head as one persistent CUDA kernel (`persistent_pass.cu`).

The code predictor's pass as `small_batch`'s Triton kernels is a chain of 27 kernels of 4-7 us each: about 150-180
us a pass where its weights take 37 us to stream.
Here one kernel runs the whole pass on 128 blocks, one per multiprocessor. Each block keeps its share of a GEMM's
weights in shared memory and asks for the next GEMM's share (bulk copies) before it computes, so that the weights
stream in while the blocks wait for each other between phases (grid barriers on a counter; every block must be
resident at once, which 128 blocks of one per multiprocessor are on a GPU with at least 128). On an H200 a pass and
its head take 10-23% less time than as the Triton kernels, at 1 to 32 rows.

Built at run time with NVRTC (the library PyTorch's CUDA build loads) through the CUDA driver API, both over ctypes:
no compiler at install time and no extra package. Graph-capturable: a launch is a kernel on the current stream.
"""

from __future__ import annotations

import ctypes
import fcntl
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from omni_ray.device_memory import StreamCounterSets
from omni_ray.layers.attention import AttentionBatch

SOURCE = Path(__file__).with_name("persistent_pass.cu")
BLOCKS = 128  # one per multiprocessor; every column share is whole 8-column tiles at the code predictor's widths
WARPS = 8
MAX_ROWS = 32  # rows x tokens
MAX_TOKENS = 2
MAX_KEYS = 32
MAX_LAYERS = 8
PAD = 32  # bf16 elements after each weight row in shared memory (the kernel's PAD)
LAYER_FIELDS = 10  # pointers per layer in the kernel's parameters
DRAW_MAX_CAP = 256  # the draw phase's most candidates (`top_k_draw.MAX_CAP`)


class KernelBuildError(RuntimeError):
    """NVRTC or the driver refused the kernel (the message holds the compiler's log or the driver's error)."""


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(message))
        raise KernelBuildError(f"{what}: CUDA error {result} ({(message.value or b'?').decode()})")


def set_aside_l2(device: torch.device, wanted: int) -> int:
    """Set aside up to `wanted` bytes of L2 (at most the device's maximum) for lines asked to persist (evict_last):
    the context's persisting-L2 limit, which is zero unless set. Other reads use the set-aside lines while no kept
    line holds them. Returns the bytes set aside."""
    lib = _driver()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device).synchronize()  # the context is current on this thread
        most = ctypes.c_int()
        max_persisting_l2 = 108  # CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE
        _check(lib, lib.cuDeviceGetAttribute(ctypes.byref(most), max_persisting_l2, ctypes.c_int(device.index or 0)),
               "cuDeviceGetAttribute")
        size = min(wanted, most.value)
        persisting_l2_limit = 6  # CU_LIMIT_PERSISTING_L2_CACHE_SIZE
        _check(lib, lib.cuCtxSetLimit(ctypes.c_int(persisting_l2_limit), ctypes.c_size_t(size)), "cuCtxSetLimit")
    return size


def _nvrtc() -> ctypes.CDLL:
    major = int((torch.version.cuda or "13").split(".")[0])
    for name in (f"libnvrtc.so.{major}", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise KernelBuildError("no NVRTC library (libnvrtc.so) in this process or on the library path")


def compile_cubin(source: str, defines: dict[str, int | str], arch: str) -> bytes:
    """`source` compiled by NVRTC for `arch` (e.g. "sm_90") with `defines` as -D macros and this folder as the
    include path (the `persistent_pass_*.cuh` it includes): the cubin's bytes."""
    lib = _nvrtc()
    program = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), str(SOURCE).encode(), 0, None, None)
    if status != 0:
        raise KernelBuildError(f"nvrtcCreateProgram failed ({status})")
    options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"--include-path={SOURCE.parent}".encode(),
               b"--generate-line-info"]  # source lines for profilers; the code is the same
    options += [f"-D{name}={value}".encode() for name, value in defines.items()]
    array = (ctypes.c_char_p * len(options))(*options)
    try:
        status = lib.nvrtcCompileProgram(program, len(options), array)
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise KernelBuildError(f"NVRTC could not compile the pass ({status}):\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def shared_bytes(hidden: int, attn_width: int, inter: int, qkv_width: int) -> int:
    """The kernel's dynamic shared memory: two weight buffers (q/k/v, gate/up and the head in one; o and down in the
    other), the warps' partial sums and their partial sums of squares. Mirrors the kernel's own layout."""
    qkv_cols, gate_up_cols, narrow_cols = qkv_width // BLOCKS, 2 * (inter // BLOCKS), hidden // BLOCKS
    buffer0 = max(gate_up_cols, qkv_cols) * (hidden + PAD) * 2
    buffer1 = max(narrow_cols * (inter + PAD), narrow_cols * (attn_width + PAD)) * 2
    partial = WARPS * 2 * max(gate_up_cols // 8, qkv_cols // 8) * 128 * 4
    return buffer0 + buffer1 + partial + WARPS * MAX_ROWS * 4


def parameter_block(
    layers: list[list[int]], pointers: list[int], integers: list[int], floats: list[float]
) -> ctypes.Array[ctypes.c_uint64]:
    """The kernel's `Params` as 64-bit words, in its field order: MAX_LAYERS x LAYER_FIELDS layer pointers (unused
    layers null), then the pass's pointers, its integers, and its floats as doubles."""
    assert len(layers) <= MAX_LAYERS and all(len(layer) == LAYER_FIELDS for layer in layers)
    words = [word for layer in layers for word in layer] + [0] * (LAYER_FIELDS * (MAX_LAYERS - len(layers)))
    words += pointers + integers
    words += [ctypes.c_uint64.from_buffer_copy(ctypes.c_double(f)).value for f in floats]
    return (ctypes.c_uint64 * len(words))(*words)


class LaunchAttribute(ctypes.Structure):
    """The driver's CUlaunchAttribute: an id, padding, and a 64-byte value (here a cluster's x, y, z)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):
    """The driver's CUlaunchConfig, for cuLaunchKernelEx and cuOccupancyMaxActiveClusters."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


def launch_config(blocks: int, threads: int, shared: int, stream: int | None, cluster: int) -> tuple[LaunchConfig, Any]:
    """A launch of `blocks` x `threads` with `shared` dynamic bytes on `stream`, in clusters of `cluster` blocks
    (1: no cluster attribute); also the attribute array, which must outlive the config."""
    attributes = (LaunchAttribute * 1)()
    attributes[0].id = CLUSTER_DIMENSION
    attributes[0].value[0], attributes[0].value[1], attributes[0].value[2] = cluster, 1, 1
    config = LaunchConfig((blocks, 1, 1), (threads, 1, 1), shared, stream, attributes, 1 if cluster > 1 else 0)
    return config, attributes


_claims: dict[str, IO[str]] = {}  # GPU identity -> the locked file this process's claim holds open


def claim_gpu(identity: str, directory: str | None = None) -> bool:
    """This process's claim on running persistent passes on the GPU `identity` (its UUID): True when it holds it (taken
    now or before), False when another live process does. Two processes' passes at once on one GPU (two Talker
    replicas placed on it, under MPS) could each hold part of the multiprocessors and wait for the other's blocks
    forever. The claim is an exclusive lock on a file named after the GPU in `directory` (the temp directory, so
    it sees the processes that share it: one host or one container), held until this process ends (the OS drops
    it then, however it ends)."""
    if identity in _claims:
        return True
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", identity)
    handle = open(Path(directory or tempfile.gettempdir()) / f"omni-ray-persistent-pass-{name}.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return False
    _claims[identity] = handle
    return True


STALL_SECONDS = 2.0  # a wait past this traps (the source's STALL_NS): a pass takes about 150 us
CANARY = 0xC0DE5EED  # the source's CANARY: in the guard words before the barrier counters and in their last word
GUARD_WORDS = 4
REPORT_WORDS = 16

COUNTER_SETS = 256  # streams a process's launches may run on (torch draws streams from pools of 32), a set each
_CANARY_INT32 = CANARY - (1 << 32)
# in device memory of their own (`device_memory`): no tensor ever shares it, and no graph's memset rewrites it
_barrier_sets = StreamCounterSets(GUARD_WORDS + 4, COUNTER_SETS,
                                  [_CANARY_INT32] * GUARD_WORDS + [0, 0, 0, _CANARY_INT32])


def barrier_counters(device: torch.device) -> torch.Tensor:
    """The counters a launch's grid barriers count on, one set per device and stream (every launch leaves them at
    rest; launches on one stream run one after the other): int32 [GUARD_WORDS + 4], guard words holding CANARY, then
    arrivals and exits (zero), blocks in flight (zero) and CANARY. A launch that finds them otherwise reports it."""
    counters = _barrier_sets.for_current_stream(device)
    if counters is None:
        raise RuntimeError(f"no barrier counters for this stream of {device}: more than {COUNTER_SETS} streams, or "
                           "asked for inside a graph capture before the kernel was built")
    return counters


def describe_stall(report: list[int]) -> str | None:
    """A launch's report (`report_stall` in the source, REPORT_WORDS words as unsigned ints) in words, or None."""
    if not report[0]:
        return None
    where, block, count, seen, target = report[1:6]
    arrivals, exits, in_flight, canary = report[6:10]
    written_over = [f"{word:#x}" for word in report[10:10 + GUARD_WORDS] + [canary] if word != CANARY]
    counters = (f"counters then: arrivals {arrivals}, exits {exits}, blocks in flight {in_flight}; "
                + (f"written over: {', '.join(written_over)}" if written_over else "canaries intact"))
    if where == 1:
        return (f"the persistent pass stalled at a grid barrier: block {block} saw {seen} of {target} arrivals "
                f"(barrier {count}) for {STALL_SECONDS:.0f} s ({counters})")
    if where == 3:
        return (f"the persistent pass found its barrier counters not at rest at launch: block {block} saw {count} "
                f"blocks in flight before it, {seen} arrivals and {target} exits ({counters})")
    return (f"the persistent pass stalled waiting for a weight copy: block {block}, fill {count}, phase parity "
            f"{seen}, for {STALL_SECONDS:.0f} s ({counters})")


@dataclass
class CodeDraw:
    """What the kernel's draw phase reads (`persistent_pass_draw.cuh`, `top_k_draw.top_k_draw_and_embed`'s draw): per
    row the sampling's temperature [B] float32, top_k [B] int64 and top_p [B] float32, the noise keys [B, 2] int64
    shifted by `noise_offset`, the top-k `cap` (a power of two); the code embedding `table` [V, h] and the `feedback`
    [B, h] its rows are added to, both bf16."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    noise_keys: torch.Tensor
    noise_offset: int
    cap: int
    table: torch.Tensor
    feedback: torch.Tensor


class PersistentPass:
    """One dense `DecoderStack`'s pass (fused projections, head_dim 128, bf16) on one GPU as `persistent_pass.cu`:
    `logits` runs the layers over a few rows' new tokens, writes their keys and values, and returns the last
    token's logits by a head, all in one launch. `max_rows`: the most rows (streams) a pass it takes may have, at
    most MAX_ROWS (a GPU shared with another stage may keep larger passes on the Triton kernels). `draws`: `draw` may
    also draw each row's code in the same launch (else the caller draws from `logits`). `cooperative`: launch as a
    cooperative grid, which the GPU starts only once every block can be resident, as the grid barriers need (false:
    a plain launch, which assumes it; for measurements)."""

    def __init__(self, stack: Any, max_rows: int = MAX_ROWS, l2_keep_percent: int = 0, draws: bool = False,
                 cooperative: bool = True) -> None:
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows {max_rows}: the kernel takes 1 to {MAX_ROWS} rows")
        if not 0 <= l2_keep_percent <= 100:
            raise ValueError(f"l2_keep_percent {l2_keep_percent}: a share of the weights, 0 to 100")
        self.max_rows = max_rows
        self.draws = draws
        self.cooperative = cooperative
        self.l2_keep_percent = l2_keep_percent  # the weights' lines L2 is asked to keep from pass to pass (0: none)
        spec = stack.spec
        layer0 = stack.layers[0]
        self.device = layer0.input_layernorm.weight.device
        reason = unsupported(stack)
        if reason:
            raise ValueError(f"the persistent pass does not take this stack: {reason}")
        self.stack = stack
        self.hidden, self.inter = spec.hidden_size, spec.intermediate_size
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.vocab: int | None = None  # the head's rows, fixed by the first head (the kernel is built for it)
        self.passes_in_launch = 1  # passes a launch runs, each after the last (`PASSES_IN_LAUNCH`, a measurement build)
        self.smem = shared_bytes(self.hidden, self.heads * self.head_dim, self.inter, self.qkv_width)
        self._function: ctypes.c_void_p | None = None
        self._module = ctypes.c_void_p()
        self._lib: ctypes.CDLL | None = None  # the driver, once built
        # where a launch that stalled says what it waited for before it traps (`report_stall`): host memory the GPU
        # writes, read back after the error (the context is lost then; host memory still reads). Made by `build`.
        self._stall_report: torch.Tensor | None = None
        self._weights = [
            (layer.self_attn.qkv, layer.self_attn.o_proj.weight, layer.mlp.gate_up, layer.mlp.down_proj.weight,
             layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.self_attn.q_norm.weight,
             layer.self_attn.k_norm.weight)
            for layer in stack.layers
        ]
        self.eps = float(layer0.input_layernorm.variance_epsilon)
        self.qk_eps = float(layer0.self_attn.q_norm.variance_epsilon)

    def build(self, vocab: int, extra_defines: dict[str, int] | None = None) -> None:
        """Compile and load the kernel for a head of `vocab` rows (once; before any graph capture). `extra_defines`:
        the source's switches for tests and timing: SKIP_* (timing by difference only), STALL_TEST, or
        PASSES_IN_LAUNCH (a launch runs that many passes, each after the last; drawing, a later pass reads the codes
        the pass before drew)."""
        if self._function is not None:
            if vocab != self.vocab:
                raise ValueError(f"built for a head of {self.vocab} rows, not {vocab}")
            return
        if vocab % (BLOCKS * 8):
            raise ValueError(f"a head of {vocab} rows does not split into {BLOCKS} blocks of whole 8-row tiles")
        identity = str(torch.cuda.get_device_properties(self.device).uuid)
        if not claim_gpu(identity):
            raise KernelBuildError(f"another process runs persistent passes on this GPU ({identity}): two at once "
                                   "could wait on each other forever")
        major, minor = torch.cuda.get_device_capability(self.device)
        defines = {"HIDDEN": self.hidden, "HEADS": self.heads, "KV_HEADS": self.kv_heads, "HEAD_DIM": self.head_dim,
                   "INTER": self.inter, "VOCAB": vocab, "BLOCKS": BLOCKS, "WARPS": WARPS,
                   "L2_KEEP_PERCENT": self.l2_keep_percent, "STALL_NS": f"{int(STALL_SECONDS * 1e9)}ull",
                   **(extra_defines or {})}
        cubin = compile_cubin(SOURCE.read_text(), defines, f"sm_{major}{minor}")
        self.passes_in_launch = int(defines.get("PASSES_IN_LAUNCH", 1))  # a measurement build may run several
        lib = _driver()
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device).synchronize()  # the context is current on this thread
            _check(lib, lib.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData")
            function = ctypes.c_void_p()
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(function), self._module, b"decoder_pass"),
                   "cuModuleGetFunction")
            max_dynamic_shared = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(lib, lib.cuFuncSetAttribute(function, max_dynamic_shared, self.smem), "cuFuncSetAttribute")
            per_sm = ctypes.c_int()
            _check(lib, lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(per_sm), function, WARPS * 32, ctypes.c_size_t(self.smem)), "occupancy")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if per_sm.value * sms < BLOCKS:
            raise KernelBuildError(f"{BLOCKS} blocks must be resident at once: {sms} SMs x {per_sm.value} a SM")
        cooperative_launch, supported = 95, ctypes.c_int()  # CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
        _check(lib, lib.cuDeviceGetAttribute(ctypes.byref(supported), cooperative_launch,
                                             ctypes.c_int(self.device.index or 0)), "cuDeviceGetAttribute")
        if self.cooperative and not supported.value:
            raise KernelBuildError("the device does not launch cooperative grids")
        self.vocab, self._function, self._lib = vocab, function, lib
        _barrier_sets.make_slab(self.device)  # before any capture: an allocation
        self._stall_report = torch.zeros(REPORT_WORDS, dtype=torch.int32).pin_memory()

    def stall(self) -> str | None:
        """What a launch that stalled reported before it trapped (`report_stall` in the source), or None."""
        report = self._stall_report
        if report is None:
            return None
        return describe_stall([word & 0xFFFFFFFF for word in report.tolist()])

    def max_active_clusters(self, cluster: int) -> int:
        """How many clusters of `cluster` blocks of this kernel the GPU holds at once (the driver's count)."""
        assert self._lib is not None and self._function is not None
        config, _attributes = launch_config(BLOCKS, WARPS * 32, self.smem, None, cluster)
        count = ctypes.c_int()
        with torch.cuda.device(self.device):
            _check(self._lib, self._lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), self._function,
                                                                     ctypes.byref(config)), "max active clusters")
        return count.value

    def applies(self, embeds: torch.Tensor, batch: AttentionBatch) -> bool:
        """Whether `logits` takes this step: bf16 on the stack's GPU, at most `max_rows` rows, 32 rows x tokens and
        2 tokens a row, a decode over at most 32 cached positions (not a from-zero prefill)."""
        rows, tokens, _ = embeds.shape
        return (
            embeds.device == self.device and embeds.dtype == torch.bfloat16 and rows <= self.max_rows
            and rows * tokens <= MAX_ROWS
            and tokens <= MAX_TOKENS and batch.kv_len <= MAX_KEYS and not batch.from_zero
        )

    def draw_applies(self, draw: CodeDraw) -> bool:
        """Whether `draw` takes this draw: on (`draws`), a cap the phase holds, a bf16 table [V, h] of the head's
        rows and bf16 feedback rows."""
        table, feedback = draw.table, draw.feedback
        return (
            self.draws and draw.cap & (draw.cap - 1) == 0 and 0 < draw.cap <= min(DRAW_MAX_CAP, self.vocab or 0)
            and table.dtype == feedback.dtype == torch.bfloat16 and tuple(table.shape) == (self.vocab, self.hidden)
            and table.is_contiguous() and feedback.shape[-1] == self.hidden
        )

    def logits(
        self, embeds: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
        cos: torch.Tensor, sin: torch.Tensor, head: torch.Tensor,
    ) -> torch.Tensor:
        """embeds [B, T, h] through every layer (their keys and values into `kv_caches` at `batch`'s positions),
        then the final norm and `head` [V, h] over each row's last token: logits [B, V] in bf16."""
        return self._launch(embeds, kv_caches, batch, cos, sin, head, None)[0]

    def draw(
        self, embeds: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
        cos: torch.Tensor, sin: torch.Tensor, head: torch.Tensor, draw: CodeDraw,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`logits`, then in the same launch each row's code drawn from them as `top_k_draw_and_embed` draws it
        (where `draw_applies`): codes [B] int64, their embeddings [B, h] and the feedback plus those [B, h]."""
        _, codes, embedded, summed = self._launch(embeds, kv_caches, batch, cos, sin, head, draw)
        assert codes is not None and embedded is not None and summed is not None
        return codes, embedded, summed

    def _launch(
        self, embeds: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
        cos: torch.Tensor, sin: torch.Tensor, head: torch.Tensor, draw: CodeDraw | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        self.build(head.shape[0])
        lib, function, report = self._lib, self._function, self._stall_report
        assert lib is not None and function is not None and report is not None and self.vocab is not None
        rows, tokens, width = embeds.shape
        assert width == self.hidden and head.shape[1] == width and head.is_contiguous()
        embeds, cos, sin = embeds.contiguous(), cos.reshape(rows * tokens, -1).contiguous(), sin.reshape(
            rows * tokens, -1).contiguous()
        index = batch.write_index.reshape(-1).contiguous()
        logits = torch.empty(rows, self.vocab, dtype=embeds.dtype, device=self.device)
        scratch = [torch.empty(MAX_ROWS, n, dtype=embeds.dtype, device=self.device)
                   for n in (self.hidden, self.hidden, self.qkv_width, self.heads * self.head_dim, self.inter,
                             self.hidden, self.hidden)]
        scratch.append(torch.empty(BLOCKS, MAX_ROWS, dtype=torch.float32, device=self.device))  # sums of squares
        counters = barrier_counters(self.device)
        k_cache = kv_caches[0][0]
        assert all(k.stride() == k_cache.stride() == v.stride() for k, v in kv_caches)
        layers = [[t.data_ptr() for t in weights] + [k.data_ptr(), v.data_ptr()]
                  for weights, (k, v) in zip(self._weights, kv_caches)]
        pointers = [embeds.data_ptr(), cos.data_ptr(), sin.data_ptr(), index.data_ptr(),
                    0 if batch.rows_are_slots else batch.slots.data_ptr(), self.stack.norm.weight.data_ptr(),
                    head.data_ptr(), logits.data_ptr(), *(t.data_ptr() for t in scratch),
                    counters[GUARD_WORDS:].data_ptr(),
                    report.data_ptr()]
        codes: torch.Tensor | None = None
        embedded: torch.Tensor | None = None
        summed: torch.Tensor | None = None
        if draw is not None:
            assert self.draw_applies(draw), "a draw the kernel's phase does not take"
            assert self.passes_in_launch == 1 or tokens == 1, "a later pass reads one drawn embedding a row"
            codes = torch.empty(rows, dtype=torch.long, device=self.device)
            embedded = torch.empty(rows, self.hidden, dtype=embeds.dtype, device=self.device)
            summed = torch.empty_like(embedded)
            inputs = [t.contiguous() for t in (draw.temperature.float(), draw.top_k.long(), draw.top_p.float(),
                                                draw.noise_keys.long(), draw.table, draw.feedback.reshape(rows, -1))]
            pointers += [t.data_ptr() for t in (*inputs, codes, embedded, summed)]
        else:
            pointers += [0] * 9
        integers = [len(self._weights), rows, tokens, batch.kv_len, k_cache.stride(0), k_cache.stride(1),
                    draw.cap if draw is not None else 0, draw.noise_offset if draw is not None else 0]
        floats = [self.eps, float(self.stack.norm.variance_epsilon), self.qk_eps, self.head_dim**-0.5]
        params = parameter_block(layers, pointers, integers, floats)
        arguments = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        if self.cooperative:  # the same arguments but the last (no `extra`)
            _check(lib, lib.cuLaunchCooperativeKernel(function, BLOCKS, 1, 1, WARPS * 32, 1, 1, self.smem, stream,
                                                      arguments), "cuLaunchCooperativeKernel")
        else:
            _check(lib, lib.cuLaunchKernel(function, BLOCKS, 1, 1, WARPS * 32, 1, 1, self.smem, stream, arguments,
                                           None), "cuLaunchKernel")
        return logits, codes, embedded, summed


def unsupported(stack: Any) -> str | None:
    """Why `PersistentPass` cannot run `stack`, or None: dense layers with fused projections, head_dim 128, bf16
    weights, widths that split into the kernel's blocks, at most 8 layers."""
    spec = stack.spec
    if not spec.qk_norm:
        return "no q/k norms (the kernel norms queries and keys)"
    if spec.num_layers > MAX_LAYERS:
        return f"{spec.num_layers} layers (at most {MAX_LAYERS})"
    if spec.head_dim != 128:
        return f"head_dim {spec.head_dim} (the kernel holds 128)"
    qkv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    if spec.hidden_size != BLOCKS * 8:
        return (f"hidden width {spec.hidden_size} (the kernel's residual phases hold one 8-column tile a block: "
                f"{BLOCKS * 8})")
    for name, width in (("q/k/v", qkv_width), ("hidden", spec.hidden_size), ("intermediate", spec.intermediate_size)):
        if width % (BLOCKS * 8):
            return f"the {name} width {width} does not split into {BLOCKS} blocks of whole 8-column tiles"
    for name, depth in (("hidden", spec.hidden_size), ("attention", spec.num_heads * spec.head_dim),
                        ("intermediate", spec.intermediate_size)):
        if depth % (WARPS * 16):
            return f"the {name} depth {depth} does not split into {WARPS} warps of whole 16-deep steps"
    for layer in stack.layers:
        if getattr(layer.mlp, "gate_up", None) is None or layer.self_attn.qkv is None:
            return "a layer without fused q/k/v and gate/up projections (dense layers, fuse_projections first)"
        weights = (layer.self_attn.qkv, layer.self_attn.o_proj.weight, layer.mlp.gate_up, layer.mlp.down_proj.weight)
        if any(w.dtype != torch.bfloat16 or not w.is_cuda for w in weights):
            return "weights not bf16 on a GPU"
        if not all(w.is_contiguous() for w in weights):
            return "weights not contiguous (the kernel reads rows of [out, in] weights)"
    if shared_bytes(spec.hidden_size, spec.num_heads * spec.head_dim, spec.intermediate_size, qkv_width) > 227 * 1024:
        return "the weight shares need more than 227 KB of shared memory a block"
    return None
