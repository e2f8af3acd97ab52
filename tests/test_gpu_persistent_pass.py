"""GPU: the code predictor's pass as one persistent kernel (`layers/persistent_pass.py`) against the eager layers and
`small_batch`'s Triton kernels on the full-size shapes, eagerly and replayed from a CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _code_predictor import KV_LEN, frame_passes, random_code_predictor
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers.decoder import DecoderSpec, DecoderStack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 8, 16, 32])
def test_the_persistent_pass_equals_the_eager_layers_and_the_kernels(rows: int) -> None:
    """Qwen3-Omni-30B's code predictor (5 layers, 1,024 wide, 16 query and 8 KV heads of 128), random bf16 weights,
    a frame's first five passes (two tokens, then one; each with its own code head of 2,048 rows): the logits and
    the keys and values written agree with the eager layers' and the Triton kernels' to bf16 rounding. The first pass
    at 32 rows (64 rows x tokens) is past the kernel and runs the Triton kernels. A second launch gives the same
    bits, and so does a graph replay."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    eager = random_code_predictor()
    kernels, persistent = copy.deepcopy(eager), copy.deepcopy(eager)
    eager.fuse_projections()
    assert kernels.use_small_batch_kernels() and persistent.use_small_batch_kernels()
    assert persistent.use_persistent_pass(2048)
    caches = [SlotKVCache(5, 32, KV_LEN, 8, 128, torch.bfloat16, "cuda") for _ in range(3)]
    for start, batch, x, cos, sin in frame_passes(eager, rows, 5):
        head = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16) * 0.03
        assert persistent.persistent is not None
        assert persistent.persistent.applies(x, batch) == (rows * x.shape[1] <= 32)
        expected = eager.last_logits(x, caches[0].layers, batch, (cos, sin), head)
        triton = kernels.last_logits(x, caches[1].layers, batch, (cos, sin), head)
        got = persistent.last_logits(x, caches[2].layers, batch, (cos, sin), head)
        assert got.shape == (rows, 2048) and torch.isfinite(got).all()
        assert _relative(got, expected) < 2e-2, _relative(got, expected)
        assert _relative(got, triton) < 2e-2, _relative(got, triton)
        written = slice(0, start + x.shape[1])
        for (k0, v0), (k2, v2) in zip(caches[0].layers, caches[2].layers):
            assert _relative(k2[:rows, written], k0[:rows, written]) < 2e-2
            assert _relative(v2[:rows, written], v0[:rows, written]) < 2e-2

    again = persistent.last_logits(x, caches[2].layers, batch, (cos, sin), head)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the capture stream's barrier counters, allocated outside the capture
        persistent.last_logits(x, caches[2].layers, batch, (cos, sin), head)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        replayed = persistent.last_logits(x, caches[2].layers, batch, (cos, sin), head)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, got, rtol=0, atol=0)


def test_a_stack_the_kernel_does_not_take_keeps_its_own_pass() -> None:
    """A stack with head_dim 64 is refused (the kernel holds 128 dims a head): `use_persistent_pass` says so and
    nothing changes."""
    spec = DecoderSpec(num_layers=2, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-6,
                       rope_theta=1e6, mrope_section=None, intermediate_size=3072)
    stack = DecoderStack(spec).cuda().to(torch.bfloat16)
    assert not stack.use_persistent_pass(2048)
    assert stack.persistent is None


def test_passes_past_max_rows_keep_the_triton_kernels() -> None:
    """With `max_rows=1` (a Talker sharing its GPU), a one-row pass runs the persistent kernel and an 8-row pass the
    Triton kernels: the same bits as a stack without the persistent kernel."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    capped = random_code_predictor()
    kernels = copy.deepcopy(capped)
    assert kernels.use_small_batch_kernels() and capped.use_small_batch_kernels()
    assert capped.use_persistent_pass(2048, max_rows=1)
    assert capped.persistent is not None and capped.persistent.max_rows == 1
    head = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16) * 0.03
    for rows in (1, 8):
        caches = [SlotKVCache(5, 32, KV_LEN, 8, 128, torch.bfloat16, "cuda") for _ in range(2)]
        for _, batch, x, cos, sin in frame_passes(kernels, rows, 2):
            assert capped.persistent.applies(x, batch) == (rows == 1)
            triton = kernels.last_logits(x, caches[0].layers, batch, (cos, sin), head)
            got = capped.last_logits(x, caches[1].layers, batch, (cos, sin), head)
            if rows == 1:
                assert _relative(got, triton) < 2e-2, _relative(got, triton)
            else:
                torch.testing.assert_close(got, triton, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 32])
def test_l2_hints_change_no_bits(rows: int) -> None:
    """The cache hints only: the persistent pass keeping 10% of its weights in L2 (the served default) gives the
    plain build's logits, keys and values bit for bit, and so do the Triton kernels with the weights' loads marked
    evict_first (`small_batch.weights_evict_first`) against their plain loads."""
    pytest.importorskip("triton")
    from omni_ray.layers import small_batch

    torch.manual_seed(0)
    plain = random_code_predictor()
    kept, kernels = copy.deepcopy(plain), copy.deepcopy(plain)
    assert plain.use_small_batch_kernels() and kept.use_small_batch_kernels() and kernels.use_small_batch_kernels()
    assert plain.use_persistent_pass(2048) and kept.use_persistent_pass(2048, l2_keep_percent=10)
    head = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16) * 0.03
    caches = [SlotKVCache(5, 32, KV_LEN, 8, 128, torch.bfloat16, "cuda") for _ in range(4)]
    for _, batch, x, cos, sin in frame_passes(plain, rows, 3):
        exact = [plain.last_logits(x, caches[0].layers, batch, (cos, sin), head),
                 kept.last_logits(x, caches[1].layers, batch, (cos, sin), head)]
        try:
            small_batch.set_weights_evict_first(True)
            hinted = kernels.last_logits(x, caches[2].layers, batch, (cos, sin), head)
        finally:
            small_batch.set_weights_evict_first(False)
        unhinted = kernels.last_logits(x, caches[3].layers, batch, (cos, sin), head)
        torch.testing.assert_close(exact[1], exact[0], rtol=0, atol=0)
        torch.testing.assert_close(hinted, unhinted, rtol=0, atol=0)
    for (k0, v0), (k1, v1) in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    for (k2, v2), (k3, v3) in zip(caches[2].layers, caches[3].layers):
        assert torch.equal(k2, k3) and torch.equal(v2, v3)


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_draw_in_the_pass_equals_the_draw_kernel(rows: int) -> None:
    """`last_draw` (the pass's launch drawing each row's code) against the pass's logits drawn by the Triton kernel
    (`top_k_draw_and_embed`): the same codes, embeddings and feedback sums bit for bit, over a frame's passes with
    top-k caps of 16, 64 and 256, the served top-k 50 / top-p 0.8 at temperature 0.9, greedy rows, top-p off, and
    bf16 logits that tie at the top-k threshold; a graph replay draws the same."""
    pytest.importorskip("triton")
    from omni_ray.engine.sampler import CounterNoise, SamplingBatch
    from omni_ray.engine.top_k_draw import top_k_draw_and_embed
    from omni_ray.layers.persistent_pass import CodeDraw

    torch.manual_seed(0)
    drawing = random_code_predictor()
    plain = copy.deepcopy(drawing)
    assert drawing.use_small_batch_kernels() and plain.use_small_batch_kernels()
    assert drawing.use_persistent_pass(2048, draws=True) and plain.use_persistent_pass(2048)
    caches = [SlotKVCache(5, 32, KV_LEN, 8, 128, torch.bfloat16, "cuda") for _ in range(2)]
    table = (torch.randn(2048, 1024, device="cuda") * 0.05).to(torch.bfloat16)
    temperature = torch.full((rows,), 0.9, device="cuda")
    temperature[1::4] = 0.0  # greedy rows
    top_k = torch.full((rows,), 50, dtype=torch.long, device="cuda")
    top_k[2::4] = 7
    top_p = torch.full((rows,), 0.8, device="cuda")
    top_p[3::4] = 1.0
    params = SamplingBatch(temperature, top_k, top_p, torch.ones(rows, device="cuda"))
    keys = torch.randint(0, 2**32, (rows, 2), dtype=torch.long, device="cuda")
    feedback = (torch.randn(rows, 1024, device="cuda") * 0.1).to(torch.bfloat16)
    drawn_any = 0
    for k, (_, batch, x, cos, sin) in enumerate(frame_passes(drawing, rows, 6)):
        cap = (64, 16, 256)[k % 3]
        head = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16) * (0.03 if k % 2 else 0.003)  # ties
        draw = CodeDraw(temperature, top_k, top_p, keys, 2048 * k, cap, table, feedback)
        got = drawing.last_draw(x, caches[0].layers, batch, (cos, sin), head, draw)
        if rows * x.shape[1] > 32:  # past the kernel: the caller draws
            assert got is None
            continue
        assert got is not None
        logits = plain.last_logits(x, caches[1].layers, batch, (cos, sin), head)
        expected = top_k_draw_and_embed(logits, params, CounterNoise(keys, 2048 * k), cap, table, feedback)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        drawn_any += 1
        feedback = got[2]
    assert drawn_any >= 5

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        drawing.last_draw(x, caches[0].layers, batch, (cos, sin), head, draw)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        replayed = drawing.last_draw(x, caches[0].layers, batch, (cos, sin), head, draw)
    graph.replay()
    torch.cuda.synchronize()
    assert replayed is not None
    for r, g in zip(replayed, got):
        torch.testing.assert_close(r, g, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_passes_in_one_launch_equal_launches_one_after_the_other(rows: int) -> None:
    """The probe's build that runs three passes in a launch (`PASSES_IN_LAUNCH`), drawing, against three launches of
    the served build, each fed the code embeddings the one before drew: the same codes, embeddings and feedback sums
    of the last pass, and the same keys and values, bit for bit (the weights' fills counted across passes, the next
    pass's q/k/v asked for during the draw)."""
    pytest.importorskip("triton")
    from omni_ray.layers.persistent_pass import CodeDraw, PersistentPass

    torch.manual_seed(0)
    stack = random_code_predictor()
    assert stack.use_small_batch_kernels()
    single, several = PersistentPass(stack, draws=True), PersistentPass(stack, draws=True)
    single.build(2048)
    several.build(2048, {"PASSES_IN_LAUNCH": 3})
    head = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16) * 0.03
    table = (torch.randn(2048, 1024, device="cuda") * 0.05).to(torch.bfloat16)
    feedback = (torch.randn(rows, 1024, device="cuda") * 0.1).to(torch.bfloat16)
    temperature = torch.full((rows,), 0.9, device="cuda")
    temperature[1::4] = 0.0  # greedy rows
    keys = torch.randint(0, 2**32, (rows, 2), dtype=torch.long, device="cuda")
    draw = CodeDraw(temperature, torch.full((rows,), 50, dtype=torch.long, device="cuda"),
                    torch.full((rows,), 0.8, device="cuda"), keys, 4096, 64, table, feedback)
    chained, launched = (SlotKVCache(5, 32, KV_LEN, 8, 128, torch.bfloat16, "cuda") for _ in range(2))
    passes = frame_passes(stack, rows, 2)
    _, batch, x, cos, sin = next(passes)  # a frame's first pass (two tokens) fills positions 0-1 of both caches
    stack.last_logits(x, chained.layers, batch, (cos, sin), head)
    for (k0, v0), (k1, v1) in zip(chained.layers, launched.layers):
        k1.copy_(k0)
        v1.copy_(v0)
    _, batch, x, cos, sin = next(passes)  # then one token a pass, each written at position 2
    inputs = x
    for _ in range(3):
        expected = single.draw(inputs, chained.layers, batch, cos, sin, head, draw)
        inputs = expected[1][:, None]
    got = several.draw(x, launched.layers, batch, cos, sin, head, draw)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for (k0, v0), (k1, v1) in zip(chained.layers, launched.layers):  # position 2 holds the last pass's: a launch
        assert torch.equal(k0, k1) and torch.equal(v0, v1)              # rereading x would leave the first pass's


STALLED_LAUNCH = """
import sys
import torch
from _code_predictor import KV_LEN, frame_passes, random_code_predictor
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers.persistent_pass import GUARD_WORDS, PersistentPass, barrier_counters

case = sys.argv[1]
stack = random_code_predictor()
stack.fuse_projections()
kernel = PersistentPass(stack, max_rows=1)
kernel.build(2048, {"STALL_TEST": 1} if case == "held_block" else None)
cache = SlotKVCache(5, 1, KV_LEN, 8, 128, torch.bfloat16, "cuda")
start, batch, x, cos, sin = next(frame_passes(stack, 1, 1))
head = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16) * 0.03
counters = barrier_counters(torch.device("cuda", torch.cuda.current_device()))
if case == "exits_left":  # as if another launch on these counters were leaving
    counters[GUARD_WORDS + 1] = 5
if case == "guard_written":  # an 8-byte 4 written over the first guard words
    counters[:2] = torch.tensor([4, 0], dtype=torch.int32)
try:
    kernel.logits(x, cache.layers, batch, cos, sin, head)
    torch.cuda.synchronize()
    print("FINISHED")
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
print("REPORT", kernel.stall())
"""


@pytest.mark.parametrize("case, reported", [
    ("held_block", "saw 127 of 128 arrivals (barrier 1) for 2 s (counters then: arrivals 127, exits 0, blocks in "
                   "flight 127; canaries intact)"),  # block 0 is held before it enters
    ("exits_left", "found its barrier counters not at rest at launch"),
    ("guard_written", "found its barrier counters not at rest at launch"),
])
def test_a_stalled_or_misplaced_launch_traps_and_says_why(tmp_path: Path, case: str, reported: str) -> None:
    """A launch that cannot go on traps instead of spinning for ever: the host gets a CUDA error, and the pass's
    report (host memory, readable with the context lost) says why. `held_block`: a build whose block 0 never reaches
    the first grid barrier (`STALL_TEST`), so the other 127 wait there for 2 s. `exits_left`, `guard_written`: the
    barrier counters not at rest at launch (another launch's exits; a foreign write over the guard words before
    them), which every block checks as it starts. In a subprocess: a trapped launch loses its process's context."""
    paths = [str(Path(__file__).parent), os.getcwd(), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path),
           "TMPDIR": str(tmp_path)}  # its own claim on the GPU (this process may hold one)
    done = subprocess.run([sys.executable, "-c", STALLED_LAUNCH, case], capture_output=True, text=True, timeout=240,
                          env=env)
    assert "FINISHED" not in done.stdout, done.stdout
    assert "ERROR" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "REPORT the persistent pass " in done.stdout and reported in done.stdout, done.stdout
    if case == "exits_left":
        assert "0 arrivals and 5 exits" in done.stdout and "canaries intact" in done.stdout, done.stdout
    if case == "guard_written":
        assert "written over: 0x4, 0x0" in done.stdout, done.stdout
