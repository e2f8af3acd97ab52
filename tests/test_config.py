"""Config files: every Serve layout validates with Ray's own schema and builds; pipeline YAML mistakes are rejected."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from omni_ray.config import EngineSettings, PipelineConfig
from omni_ray.serve.app import (
    GRPC_MAX_MESSAGE_BYTES, app_from_serve_config, deployment_name, model_specs, stage_deployment_options,
)

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = sorted((ROOT / "deployments").glob("*.yaml"))


def test_the_three_layouts_ship() -> None:
    assert {p.name for p in LAYOUTS} >= {"tiny_cpu.yaml", "qwen3_omni_30b_2gpu.yaml", "qwen3_omni_30b_1gpu.yaml"}


@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.name)
def test_layout_is_a_valid_serve_config_that_builds(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)  # what `serve run` / `serve deploy` check
    app = schema.applications[0]
    assert app.import_path == "omni_ray.serve.app:build_app"
    specs = model_specs(app.args)  # one model, or several side by side (`args.models`)
    pipelines = [PipelineConfig.model_validate(spec.get("pipeline") or {}) for spec in specs]
    names = [[deployment_name(spec.get("model_name") or "", stage, len(specs) > 1) for stage in pipeline.stage_names]
             for spec, pipeline in zip(specs, pipelines)]
    assert {d.name for d in app.deployments} == {name for model in names for name in model} | {"ingress"}
    built, spec = app_from_serve_config(path)
    assert built is not None and spec["name"] == app.name
    models = built._bound_deployment.init_args[0]
    assert [set(model["deployments"].values()) for model in models] == [set(model) for model in names]
    for pipeline in pipelines:
        for stage in pipeline.stage_names:
            resources = getattr(pipeline.stages, stage).resources
            assert resources.device == "cpu" or resources.num_gpus > 0


def test_a_serve_configs_controller_options_reach_serve_start(tmp_path: Path) -> None:
    """`omni-ray serve` and the benchmarks start Serve with a config's `controller_options`, as `serve run` does
    (the shipped layouts set none)."""
    shipped = ROOT / "deployments/tiny_cpu.yaml"
    raw = yaml.safe_load(shipped.read_text())
    assert "controller_options" not in raw and app_from_serve_config(shipped)[1]["controller_options"] is None
    options = {"runtime_env": {"env_vars": {"RAY_SERVE_PROXY_USE_GRPC": "1"}}}
    configured = tmp_path / "configured.yaml"
    configured.write_text(yaml.safe_dump({**raw, "controller_options": options}))
    ServeDeploySchema.model_validate(yaml.safe_load(configured.read_text()))
    assert app_from_serve_config(configured)[1]["controller_options"] == options


def test_gpu_layouts_place_stages_as_documented() -> None:
    for layout in ("deployments/qwen3_omni_30b_2gpu.yaml", "benchmarks/serve_30b_random_2gpu.yaml"):
        two = PipelineConfig.from_yaml(ROOT / layout).stages
        # Only packing that fits: the talker alone on one GPU, thinker + encoder + vocoder on the other.
        assert two.talker.resources.num_gpus == 1.0
        assert sum(getattr(two, s).resources.num_gpus for s in ("thinker", "encoder", "vocoder")) == 1.0
        assert two.talker.relay == "host"  # codec frames to the vocoder's GPU: no NCCL kernel waiting on the Thinker's
        # the Talker's GPU is its own: the persistent code-predictor pass uncapped, keeping 10% of its weights in L2
        assert two.talker.engine.persistent_code_predictor
        assert two.talker.engine.persistent_code_predictor_max_rows == 32
        assert two.talker.engine.persistent_code_predictor_l2_keep_percent == 10
    for layout in ("deployments/qwen3_omni_30b_1gpu.yaml", "benchmarks/serve_30b_random_1gpu.yaml"):
        one = PipelineConfig.from_yaml(ROOT / layout).stages
        assert sum(getattr(one, s).resources.num_gpus for s in ("encoder", "thinker", "talker", "vocoder")) <= 1.0
        # on a GPU shared with the Thinker the persistent code-predictor pass takes one-stream passes only (its 128
        # blocks hold every SM), and every engine stage fails Serve's health check on a step stuck past its stall timeout
        assert one.talker.engine.persistent_code_predictor
        assert one.talker.engine.persistent_code_predictor_max_rows == 1
        assert one.talker.engine.stall_timeout_s == one.thinker.engine.stall_timeout_s == 180
        # under MPS the vocoder's decode calls hold half the SMs, leaving the Talker's steps beside them alone
        assert one.vocoder.resources.mps_active_thread_percentage == 50
        assert one.vocoder.resources.actor_options()["runtime_env"]["env_vars"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_tiny_cpu_layout_is_the_default_and_the_packaged_copy() -> None:
    assert PipelineConfig.from_yaml(ROOT / "deployments/tiny_cpu.yaml") == PipelineConfig()
    packaged = ROOT / "omni_ray/assets/serve_tiny_cpu.yaml"
    assert packaged.read_text() == (ROOT / "deployments/tiny_cpu.yaml").read_text()


@pytest.mark.parametrize(
    "data",
    [
        {"stages": {"thinker": {"engine": {"max_batch": 0}}}},
        {"stages": {"talker": {"resources": {"device": "cuda:0", "num_gpus": 0}}}},
        {"stages": {"vocoder": {"streaming": {"steady_chunk": 0}}}},
        {"stages": {"encoder": {"resources": {"dtype": "int8"}}}},
        {"stagez": {}},
        {"model": {"family": "unknown"}},
        {"stages": {"talker": {"engine": {"lanes": 0}}}},
        {"stages": {"talker": {"engine": {"persistent_code_predictor_max_rows": 33}}}},  # the kernel holds 32 rows
        {"stages": {"thinker": {"engine": {"lanes": 2}}}},  # lanes are the Talker's
        # inductor's autotuning crashed the Talker's grouped MoE GEMM on an H200: the option is gone
        {"stages": {"thinker": {"engine": {"compile_mode": "max-autotune-no-cudagraphs"}}}},
        {"stages": {"thinker": {"resources": {"device": "cuda", "num_gpus": 0.7, "mps_active_thread_percentage": 0}}}},
        {"stages": {"thinker": {"resources": {"mps_active_thread_percentage": 50}}}},  # a CPU stage has no SMs
        {"stages": {"thinker": {"resources": {"mps_client_priority": "below_normal"}}}},  # nor an MPS client
        {"stages": {"thinker": {"resources": {"device": "cuda", "num_gpus": 0.7, "mps_client_priority": "high"}}}},
    ],
)
def test_invalid_layouts_are_rejected(data: dict) -> None:
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate(data)


def test_steps_launch_ahead_on_cuda_devices_unless_set() -> None:
    unset = EngineSettings()
    assert unset.launches_ahead("cuda") and unset.launches_ahead("cuda:1") and not unset.launches_ahead("cpu")
    assert not EngineSettings(launch_ahead=False).launches_ahead("cuda")
    assert EngineSettings(launch_ahead=True).launches_ahead("cpu")  # as the CPU parity test runs it


def test_the_admission_window_is_off_unless_set_and_reaches_the_loop_in_seconds() -> None:
    assert EngineSettings().admission_window().quiet_s == 0  # admitted at once
    window = EngineSettings(admission_quiet_ms=4, admission_max_wait_ms=25).admission_window()
    assert (window.quiet_s, window.max_wait_s) == pytest.approx((0.004, 0.025))
    with pytest.raises(ValueError):
        EngineSettings(admission_quiet_ms=-1)


def test_a_stages_mps_share_reaches_its_replica_processes_environment() -> None:
    """`mps_active_thread_percentage` becomes CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in the runtime environment of the
    stage's Serve replicas, beside the gRPC message cap that every replica gets; other stages' replicas get the cap
    alone."""
    config = PipelineConfig.model_validate({"stages": {
        "thinker": {"resources": {"device": "cuda", "num_gpus": 0.7, "mps_active_thread_percentage": 60}},
        "talker": {"resources": {"device": "cuda", "num_gpus": 0.15}}}})
    cap = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MAX_MESSAGE_BYTES)}
    thinker = stage_deployment_options("thinker", config.stages.thinker)["ray_actor_options"]
    assert thinker == {"num_cpus": config.stages.thinker.resources.num_cpus, "num_gpus": 0.7,
                       "runtime_env": {"env_vars": {**cap, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}}}
    talker = stage_deployment_options("talker", config.stages.talker)["ray_actor_options"]
    assert talker["runtime_env"] == {"env_vars": cap}


def test_a_stages_mps_priority_reaches_its_replica_processes_environment() -> None:
    """`mps_client_priority` becomes CUDA_MPS_CLIENT_PRIORITY (normal 0, below normal 1) in the stage's replicas'
    environment, beside an MPS share when both are set."""
    config = PipelineConfig.model_validate({"stages": {
        "thinker": {"resources": {"device": "cuda", "num_gpus": 0.7, "mps_client_priority": "below_normal",
                                  "mps_active_thread_percentage": 80}},
        "talker": {"resources": {"device": "cuda", "num_gpus": 0.15, "mps_client_priority": "normal"}}}})
    thinker = stage_deployment_options("thinker", config.stages.thinker)["ray_actor_options"]["runtime_env"]
    talker = stage_deployment_options("talker", config.stages.talker)["ray_actor_options"]["runtime_env"]
    assert thinker["env_vars"]["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert thinker["env_vars"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "80"
    assert talker["env_vars"]["CUDA_MPS_CLIENT_PRIORITY"] == "0"


def test_a_family_takes_only_its_own_stages() -> None:
    with pytest.raises(ValidationError, match="thinker"):
        PipelineConfig.model_validate({"model": {"family": "qwen3_tts"}, "stages": {"thinker": {}}})
    with pytest.raises(ValidationError, match="reference"):
        PipelineConfig.model_validate({"stages": {"reference": {}}})
    with pytest.raises(ValidationError, match="variant"):
        PipelineConfig.model_validate({"model": {"variant": "base"}})  # a Qwen3-Omni source has no variant
    tts = PipelineConfig.model_validate({"model": {"family": "qwen3_tts", "variant": "base"}, "stages": {"reference": {}}})
    assert tts.stage_names == ("reference", "talker", "vocoder")
