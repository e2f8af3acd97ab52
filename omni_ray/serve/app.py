"""Builds the Serve application: one deployment per stage plus the FastAPI ingress, from one config."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig

from omni_ray.config import PipelineConfig, StageConfig
from omni_ray.models.qwen3_omni.stages import EncoderStage, TalkerStage, ThinkerStage, VocoderStage
from omni_ray.serve.ingress import OmniIngress
from omni_ray.serve.openai_protocol import ServiceLimits

STAGE_CLASSES = {"encoder": EncoderStage, "thinker": ThinkerStage, "talker": TalkerStage, "vocoder": VocoderStage}
LOAD_POLICY = "omni_ray.serve.autoscaling:stage_load_policy"
DEFAULT_MODEL_NAME = "qwen3-omni"


def stage_deployment_options(name: str, stage: StageConfig) -> dict[str, Any]:
    """Defaults for a stage deployment, derived from the pipeline config; the Serve YAML's `deployments:`
    entries override any of them (replicas, autoscaling, queue limits)."""
    res = stage.resources
    engine = getattr(stage, "engine", None)
    concurrent = engine.max_batch if engine is not None else 16
    return {
        "name": name,
        "ray_actor_options": {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus},
        "max_ongoing_requests": 2 * concurrent,  # each request holds one stream; the engine queues the rest
        "max_queued_requests": 4 * concurrent,
        "autoscaling_config": AutoscalingConfig(
            min_replicas=1, max_replicas=1, target_ongoing_requests=concurrent,
            policy={"policy_function": LOAD_POLICY},
        ),
        "health_check_period_s": 10,
        "graceful_shutdown_timeout_s": 60,  # a replica that scales down finishes its streams first
    }


def build_app(args: dict[str, Any] | None = None) -> Any:
    """Serve application builder (`import_path: omni_ray.serve.app:build_app`). `args`:
    `pipeline` (PipelineConfig), `limits` (ServiceLimits), `model_name` (the id served at /v1/models) and
    `stage_options` ({stage: Serve deployment options}) for programmatic overrides. In YAML, prefer Serve's own
    `deployments:` list, which Serve applies on top of these."""
    args = dict(args or {})
    config = PipelineConfig.model_validate(args.get("pipeline") or {})
    limits = ServiceLimits.model_validate(args.get("limits") or {})
    model_name = str(args.get("model_name") or DEFAULT_MODEL_NAME)
    bound = {}
    for name, cls in STAGE_CLASSES.items():
        stage = getattr(config.stages, name)
        options = {**stage_deployment_options(name, stage), **(args.get("stage_options") or {}).get(name, {})}
        deployment = serve.deployment(cls).options(**options)
        bound[name] = deployment.bind(config.model, stage)
    ingress = serve.deployment(OmniIngress).options(
        name="ingress", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=256, max_queued_requests=512,
    )
    return ingress.bind(
        bound["encoder"], bound["thinker"], bound["talker"], bound["vocoder"],
        config.model_dump(mode="json"), limits.model_dump(mode="json"), model_name,
    )
