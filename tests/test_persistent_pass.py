"""The persistent code-predictor pass without a GPU (`layers/persistent_pass.py`): its CUDA source builds for the
H200 with nvcc where the machine has it (no spilled registers, no stack), its shared memory fits a block, and stacks
it cannot run are refused with the reason. On a GPU: `test_gpu_persistent_pass.py`."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import FULL_CONFIG
from omni_ray.layers import persistent_pass
from omni_ray.layers.decoder import DecoderSpec, DecoderStack

CODE_PREDICTOR = {"HIDDEN": 1024, "HEADS": 16, "KV_HEADS": 8, "HEAD_DIM": 128, "INTER": 3072, "VOCAB": 2048}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to build without a GPU")
@pytest.mark.parametrize("probe", [{}, {"L2_KEEP_PERCENT": 20}, {"L2_EVICT_FIRST": 1}, {"PASSES_IN_LAUNCH": 15},
                                   {"STALL_TEST": 1}],
                         ids=["served", "l2_keep", "l2_evict_first", "passes_in_launch", "stall_test"])
def test_the_kernel_builds_for_the_h200_without_spills(tmp_path: Path, probe: dict[str, int]) -> None:
    """nvcc for sm_90 with the code predictor's shapes (as NVRTC gets them at run time): it compiles, and ptxas
    reports no spilled registers and no stack frame (registers arrays indexed at run time would go to local memory),
    under the one-block-a-multiprocessor register limit. Also the probe's builds whose copies hint L2 to keep a share
    of the weights, and that run a frame's passes in one launch."""
    defines = {**CODE_PREDICTOR, "BLOCKS": persistent_pass.BLOCKS, "WARPS": persistent_pass.WARPS, **probe}
    command = ["nvcc", "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o", str(tmp_path / "pass.cubin"),
               *(f"-D{k}={v}" for k, v in defines.items()), str(persistent_pass.SOURCE)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = done.stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report), report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))  # type: ignore[union-attr]
    assert registers <= 255


def _struct_fields(name: str) -> list[tuple[str, str]]:
    """(type, field) of each field of a struct in the kernel's common header, a declarator list split up."""
    source = (persistent_pass.SOURCE.parent / "persistent_pass_common.cuh").read_text()
    body = re.search(r"struct %s \{(.*?)\n\};" % name, source, re.S).group(1)  # type: ignore[union-attr]
    fields = []
    for line in body.splitlines():
        declaration = line.split("//")[0].strip().rstrip(";")
        if declaration:
            kind, first = declaration.rsplit(" ", 1) if "," not in declaration else declaration.split(",")[0].rsplit(" ", 1)
            names = [first] + [n.strip() for n in declaration.split(",")[1:]]
            fields += [(kind.strip(), n.lstrip("*")) for n in names]
    return fields


def test_the_parameter_block_matches_the_kernels_params_struct() -> None:
    """The host packs the kernel's `Params` as 64-bit words in the order `PersistentPass.logits` lists them (the
    field names below): as many words as the struct's fields (its layers' pointers times MAX_LAYERS), every field
    8 bytes wide (pointers, long long, double), layers past the stack's null, and the floats as doubles last."""
    layer_fields = _struct_fields("LayerPointers")
    params = _struct_fields("Params")
    assert [name for _, name in layer_fields] == ["qkv", "o", "gate_up", "down", "input_norm", "post_norm", "q_norm",
                                                  "k_norm", "k_cache", "v_cache"]
    assert [name for _, name in params] == [
        "layers[MAX_LAYERS]", "embeds", "cos", "sin", "write_index", "slots", "final_norm", "head", "logits", "x_a",
        "x_b", "qkv_out", "attn_out", "hidden", "x_a_scaled", "x_b_scaled", "row_squares", "counters",
        "stall_report", "temperature", "top_k", "top_p", "noise_keys", "table", "feedback", "codes", "embedded", "summed",
        "num_layers", "rows", "tokens", "kv_len", "slot_stride", "position_stride", "draw_cap", "noise_offset",
        "eps", "final_eps", "qk_eps", "scale"]
    assert len(layer_fields) == persistent_pass.LAYER_FIELDS
    kinds = {kind for kind, _ in layer_fields + params[1:]}
    assert all("*" in kind or kind in {"long long", "double"} for kind in kinds), kinds
    doubles = [name for kind, name in params if kind == "double"]
    integers = [name for kind, name in params if kind == "long long"]
    pointers = [name for kind, name in params[1:] if "*" in kind]
    block = persistent_pass.parameter_block(
        [[7] * persistent_pass.LAYER_FIELDS] * 5, list(range(1, len(pointers) + 1)), [5] * len(integers),
        [1e-6] * (len(doubles) - 1) + [128**-0.5])
    assert len(block) == persistent_pass.MAX_LAYERS * persistent_pass.LAYER_FIELDS + len(params) - 1
    assert list(block[: 5 * persistent_pass.LAYER_FIELDS]) == [7] * 5 * persistent_pass.LAYER_FIELDS
    assert set(block[5 * persistent_pass.LAYER_FIELDS : persistent_pass.MAX_LAYERS * persistent_pass.LAYER_FIELDS]) == {0}
    assert struct.unpack("<d", struct.pack("<Q", block[len(block) - 1]))[0] == 128**-0.5


def _code_predictor(**changes: int) -> DecoderStack:
    cfg = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG).talker_config.code_predictor_config
    spec = DecoderSpec.from_hf(cfg)
    with torch.device("meta"):
        return DecoderStack(spec.__class__(**{**spec.__dict__, **changes}))


def test_the_code_predictors_shares_fit_a_blocks_shared_memory() -> None:
    """Two weight buffers (gate/up's 48 rows of 1,024 and down's 8 rows of 3,072, each row padded by 64 bytes), the
    warps' partial sums and their sums of squares: under the 227 KB a block may have on an H200."""
    stack = _code_predictor()
    spec = stack.spec
    size = persistent_pass.shared_bytes(spec.hidden_size, spec.num_heads * spec.head_dim, spec.intermediate_size,
                                        (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim)
    expected = 48 * 1056 * 2 + 8 * 3104 * 2 + 8 * 2 * 6 * 128 * 4 + 8 * 32 * 4
    assert size == expected and size <= 227 * 1024


def test_stacks_the_kernel_cannot_run_are_refused_with_the_reason() -> None:
    """The code predictor on the meta device lacks only fused bf16 GPU weights; other shapes are refused for what
    the kernel does not hold: a head_dim of 64, more layers than its parameters carry, a width that does not split
    into its 128 blocks, a hidden width other than one 8-column tile a block."""
    assert "fused" in (persistent_pass.unsupported(_code_predictor()) or "")
    assert "head_dim 64" in (persistent_pass.unsupported(_code_predictor(head_dim=64)) or "")
    assert "layers" in (persistent_pass.unsupported(_code_predictor(num_layers=9)) or "")
    assert "intermediate width" in (persistent_pass.unsupported(_code_predictor(intermediate_size=3000)) or "")
    assert "hidden width 2048" in (persistent_pass.unsupported(_code_predictor(hidden_size=2048)) or "")
    stack = _code_predictor()
    with pytest.raises(ValueError, match="does not take this stack"):
        persistent_pass.PersistentPass(stack)
    for max_rows in (0, 33):  # a row cap past what the kernel holds is refused before anything else
        with pytest.raises(ValueError, match=f"max_rows {max_rows}"):
            persistent_pass.PersistentPass(stack, max_rows)


def test_one_process_a_gpu_runs_persistent_passes(tmp_path: Path) -> None:
    """Two processes' passes at once on one GPU could each hold part of it and wait for each other forever: the
    first process to claim the GPU keeps it until it ends, and a second one is refused (its Talker then keeps the
    Triton kernels); the holder's own claims succeed again, and once it is gone the GPU can be claimed."""
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from omni_ray.layers.persistent_pass import claim_gpu; "
         f"assert claim_gpu('GPU-1234', {str(tmp_path)!r}) and claim_gpu('GPU-1234', {str(tmp_path)!r}); "
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert not persistent_pass.claim_gpu("GPU-1234", str(tmp_path))
        assert persistent_pass.claim_gpu("GPU-5678", str(tmp_path))  # another GPU is free
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
    assert persistent_pass.claim_gpu("GPU-1234", str(tmp_path))
    for identity in ("GPU-1234", "GPU-5678"):  # this test's claims, not held for the rest of the test session
        persistent_pass._claims.pop(identity).close()


def test_settings_that_could_hang_the_gpu_are_refused() -> None:
    """The pass needs every block resident at once: two engine lanes (two passes at once), an MPS share of the
    multiprocessors or a Talker below normal MPS priority with it are refused when the layout is read, with the
    reason."""
    from pydantic import ValidationError

    from omni_ray.config import TalkerSettings, TalkerStageConfig

    with pytest.raises(ValidationError, match="lanes > 1"):
        TalkerSettings(persistent_code_predictor=True, lanes=2)
    TalkerSettings(lanes=2)  # the Triton kernels take lanes
    with pytest.raises(ValidationError, match="mps_active_thread_percentage 50"):
        TalkerStageConfig.model_validate({"resources": {"device": "cuda", "num_gpus": 0.5,
                                                        "mps_active_thread_percentage": 50},
                                          "engine": {"persistent_code_predictor": True}})
    TalkerStageConfig.model_validate({"resources": {"device": "cuda", "num_gpus": 0.5, "mps_active_thread_percentage": 50}})
    with pytest.raises(ValidationError, match="mps_client_priority below_normal"):
        TalkerStageConfig.model_validate({"resources": {"device": "cuda", "num_gpus": 0.5,
                                                        "mps_client_priority": "below_normal"},
                                          "engine": {"persistent_code_predictor": True}})
    TalkerStageConfig.model_validate({"resources": {"device": "cuda", "num_gpus": 0.5,
                                                    "mps_client_priority": "below_normal"}})


def test_a_stall_report_says_what_the_launch_waited_for_and_what_was_written_over() -> None:
    """The report a trapped launch leaves (`report_stall`'s words) in words: a barrier's wait with the counters it saw,
    and a launch that found its counters not at rest, naming each guard word or canary something wrote over."""
    canary = persistent_pass.CANARY
    assert persistent_pass.describe_stall([0] * persistent_pass.REPORT_WORDS) is None
    barrier = [1, 1, 2, 25, 4, 3200, 4, 0, 128, canary, canary, canary, canary, canary, 0, 0]
    assert persistent_pass.describe_stall(barrier) == (
        "the persistent pass stalled at a grid barrier: block 2 saw 4 of 3200 arrivals (barrier 25) for 2 s "
        "(counters then: arrivals 4, exits 0, blocks in flight 128; canaries intact)")
    written = [1, 3, 7, 0, 4, 0, 4, 0, 1, canary, 4, 0, canary, canary, 0, 0]
    assert persistent_pass.describe_stall(written) == (
        "the persistent pass found its barrier counters not at rest at launch: block 7 saw 0 blocks in flight before "
        "it, 4 arrivals and 0 exits (counters then: arrivals 4, exits 0, blocks in flight 1; written over: 0x4, 0x0)")
    copy = [1, 2, 5, 3, 1, 0, 0, 0, 128, canary, canary, canary, canary, canary, 0, 0]
    assert persistent_pass.describe_stall(copy).startswith(
        "the persistent pass stalled waiting for a weight copy: block 5, fill 3, phase parity 1, for 2 s")
