"""Builds the Serve application: one deployment per stage plus the FastAPI ingress, from one config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ray import serve

from omni_ray.config import PipelineConfig, StageConfig
from omni_ray.models.qwen3_omni.stages import EncoderStage, TalkerStage, ThinkerStage, VocoderStage
from omni_ray.relay.auth import with_relay_env
from omni_ray.serve.ingress import OmniIngress
from omni_ray.serve.openai_protocol import ServiceLimits

STAGE_CLASSES = {"encoder": EncoderStage, "thinker": ThinkerStage, "talker": TalkerStage, "vocoder": VocoderStage}
LOAD_POLICY = "omni_ray.serve.autoscaling:stage_load_policy"
DEFAULT_MODEL_NAME = "qwen3-omni"


# Serve's gRPC transport between replicas (the stage streams, `stages/client.py`) refuses messages over 4 MiB by
# default, in the process that receives them: a lagging ingress's batch of audio chunks may be larger.
GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


# The ingress, which starts every stage stream and reads it, runs its code and its handles' router on its replica's
# main event loop, as Serve's `RAY_SERVE_THROUGHPUT_OPTIMIZED` mode does: no hop between event loops per request and
# per streamed item. Stage replicas keep the default (their constructors load weights and compile for minutes, and
# Serve runs a constructor on the user code's loop).
INGRESS_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def with_serve_env(actor_options: dict[str, Any], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """`actor_options` with the environment every replica of the application needs (the gRPC message cap), and
    `extra_env`."""
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MAX_MESSAGE_BYTES),
                               **(extra_env or {}), **(runtime_env.get("env_vars") or {})}
    return {**actor_options, "runtime_env": runtime_env}


def stage_deployment_options(name: str, stage: StageConfig) -> dict[str, Any]:
    """Defaults for a stage deployment, derived from the pipeline config; the Serve YAML's `deployments:`
    entries override any of them (replicas, autoscaling, queue limits)."""
    engine = getattr(stage, "engine", None)
    concurrent = engine.max_batch if engine is not None else 16
    return {
        "name": name,
        "ray_actor_options": with_serve_env(stage.resources.actor_options()),
        "max_ongoing_requests": 2 * concurrent,  # each request holds one stream; the engine queues the rest
        "max_queued_requests": 4 * concurrent,
        "num_replicas": 1,  # a YAML `autoscaling_config` (e.g. with LOAD_POLICY) replaces this
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
        override = (args.get("stage_options") or {}).get(name, {})
        options = stage_deployment_options(name, stage)
        if "autoscaling_config" in override:
            options.pop("num_replicas")
        options.update(override)
        # every replica of the application shares one relay secret: the environment's, else a random one per build
        options["ray_actor_options"] = with_relay_env(options.get("ray_actor_options") or {}, stage.relay_listen_host)
        deployment = serve.deployment(cls).options(**options)
        bound[name] = deployment.bind(config.model, stage)
    ingress_options = {"name": "ingress", "ray_actor_options": with_serve_env({"num_cpus": 0.2}, INGRESS_ENV),
                       "max_ongoing_requests": 256, "max_queued_requests": 512,
                       **(args.get("stage_options") or {}).get("ingress", {})}
    ingress_options["ray_actor_options"] = with_relay_env(ingress_options.get("ray_actor_options") or {})
    ingress = serve.deployment(OmniIngress).options(**ingress_options)
    return ingress.bind(
        bound["encoder"], bound["thinker"], bound["talker"], bound["vocoder"],
        config.model_dump(mode="json"), limits.model_dump(mode="json"), model_name,
    )


def app_from_serve_config(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The first application of a Serve config file built imperatively (for `omni-ray serve` and tests):
    its `deployments:` entries become `stage_options`. Returns the app and the config (http_options,
    controller_options, name, ...). `serve run FILE` gives the same application through Serve's own config path."""
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(Path(path).read_text())
    config = ServeDeploySchema.model_validate(raw)
    application = config.applications[0]
    args = {**(application.args or {}), **(overrides or {})}
    stage_options = {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in raw["applications"][0].get("deployments", [])}
    for name, options in (args.get("stage_options") or {}).items():
        stage_options.setdefault(name, {}).update(options)
    args["stage_options"] = stage_options
    return build_app(args), {
        "name": application.name, "route_prefix": application.route_prefix or "/",
        "http_options": raw.get("http_options") or {},
        "controller_options": raw.get("controller_options"),
    }


def start_serve(spec: dict[str, Any], http_options: dict[str, Any]) -> None:
    """`serve.start` with a Serve config's controller options (from `app_from_serve_config`; none in the shipped
    layouts) and these HTTP options. They apply when Serve's controller is first created, as with `serve run`."""
    serve.start(http_options=http_options, controller_options=spec["controller_options"])
