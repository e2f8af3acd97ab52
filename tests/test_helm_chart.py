"""The helm chart: lint, render every example, validate what it renders (Ray Serve's schema, Kubernetes schemas),
and check that each example's serveConfigV2 is exactly the deployments/*.yaml layout it mirrors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "omni-ray"
sys.path.insert(0, str(ROOT / "helm"))
from fetch_helm import fetch_helm  # noqa: E402

# values file (None = the chart's defaults) → the deployments file its Serve application mirrors
MIRRORS = {
    None: "tiny_cpu.yaml",
    "examples/tiny-cpu.yaml": "tiny_cpu.yaml",
    "examples/qwen3-omni-2gpu.yaml": "qwen3_omni_30b_2gpu.yaml",
    "examples/multinode-autoscaling.yaml": "qwen3_omni_30b_multinode.yaml",
    "examples/qwen3-tts-1gpu.yaml": "qwen3_tts_1.7b_1gpu.yaml",
}
KUBERNETES_VERSION = "1.30.0"
CUSTOM_KINDS = {"RayService", "ServiceMonitor"}  # CRDs: checked below by hand and by Serve's own schema


@pytest.fixture(scope="module")
def helm() -> Path:
    return fetch_helm()


def _run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def _render(helm: Path, values: str | None, *extra: str) -> list[dict[str, Any]]:
    args = ["template", "omni", str(CHART), *(["-f", str(CHART / values)] if values else []), *extra]
    result = _run(helm, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _rayservice(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    return service


@pytest.mark.parametrize("values", list(MIRRORS))
def test_chart_lints_strictly(helm: Path, values: str | None) -> None:
    result = _run(helm, "lint", "--strict", str(CHART), *(["-f", str(CHART / values)] if values else []))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", list(MIRRORS))
def test_serve_config_is_the_deployments_file_it_mirrors(helm: Path, values: str | None) -> None:
    """One source of truth: the chart renders the same applications and deployments as deployments/*.yaml."""
    rendered = yaml.safe_load(_rayservice(_render(helm, values))["spec"]["serveConfigV2"])
    expected = yaml.safe_load((ROOT / "deployments" / MIRRORS[values]).read_text())
    assert rendered == expected


@pytest.mark.parametrize("values", list(MIRRORS))
def test_rendered_serve_config_validates_with_ray_serve_and_omni_ray(helm: Path, values: str | None) -> None:
    from ray.serve.schema import ServeDeploySchema

    from omni_ray.config import PipelineConfig
    from omni_ray.serve.openai_protocol import ServiceLimits

    config = yaml.safe_load(_rayservice(_render(helm, values))["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    args = config["applications"][0]["args"]
    PipelineConfig.model_validate(args["pipeline"])
    ServiceLimits.model_validate(args.get("limits") or {})


@pytest.mark.parametrize("values", list(MIRRORS))
def test_core_objects_validate_against_kubernetes_schemas(helm: Path, values: str | None) -> None:
    import kubernetes_validate

    docs = _render(helm, values)
    core = [d for d in docs if d["kind"] not in CUSTOM_KINDS]
    assert {d["kind"] for d in core} >= {"Service"}
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # the pod templates inside the RayService are core PodSpecs too
    cluster = _rayservice(docs)["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check", **template["metadata"]}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_ray_cluster_autoscales_with_a_gpu_free_head_and_gpu_worker_groups(helm: Path) -> None:
    docs = _render(helm, "examples/multinode-autoscaling.yaml")
    cluster = _rayservice(docs)["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["rayVersion"] == "2.60.0"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"thinker-gpu", "talker-gpu", "cpu"}
    for name, custom in (("thinker-gpu", "thinker_node"), ("talker-gpu", "talker_node")):
        group = groups[name]
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert (group["minReplicas"], group["maxReplicas"]) == (1, 4)
        assert custom in group["rayStartParams"]["resources"]  # the resource its stages ask for
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert "nvidia.com/gpu" not in groups["cpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    kinds = {d["kind"] for d in docs}
    assert {"Ingress", "ServiceMonitor", "PersistentVolumeClaim", "Service"} <= kinds
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["selector"]["omni-ray.io/role"] == "head"  # where Serve's HTTP proxy listens


def test_compile_cache_is_a_host_path_on_every_worker_and_torch_compile_is_pointed_at_it(helm: Path) -> None:
    def pods(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        cluster = _rayservice(docs)["spec"]["rayClusterConfig"]
        return cluster["headGroupSpec"]["template"]["spec"], [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]

    head, workers = pods(_render(helm, None))
    assert all("compile-cache" not in str(spec) for spec in [head, *workers])  # off by default
    head, workers = pods(_render(helm, "examples/multinode-autoscaling.yaml", "--set", "compileCache.hostPath=/var/cache/omni"))
    assert len(workers) == 3 and "compile-cache" not in str(head)  # the head runs no model
    for spec in workers:
        assert {"name": "compile-cache", "hostPath": {"path": "/var/cache/omni", "type": "DirectoryOrCreate"}} in spec["volumes"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "qwen3-omni-30b", "readOnly": True}} in spec["volumes"]
        (container,) = spec["containers"]
        assert {"name": "compile-cache", "mountPath": "/var/cache/omni-ray"} in container["volumeMounts"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env == {"TORCHINDUCTOR_CACHE_DIR": "/var/cache/omni-ray/inductor", "TRITON_CACHE_DIR": "/var/cache/omni-ray/triton"}


def _env_of_every_pod(docs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    cluster = _rayservice(docs)["spec"]["rayClusterConfig"]
    specs = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    return [spec["containers"][0].get("env", []) for spec in specs]


def test_relay_secret_comes_from_a_kubernetes_secret_into_every_ray_pod(helm: Path) -> None:
    assert all("OMNI_RAY_RELAY_SECRET" not in str(env) for env in _env_of_every_pod(_render(helm, None)))  # off by default
    envs = _env_of_every_pod(_render(helm, "examples/multinode-autoscaling.yaml", "--set", "relaySecret.name=omni-relay"))
    assert len(envs) == 4
    for env in envs:
        assert {"name": "OMNI_RAY_RELAY_SECRET",
                "valueFrom": {"secretKeyRef": {"name": "omni-relay", "key": "relay-secret"}}} in env


def test_serves_haproxy_front_is_switched_on_in_every_ray_pod(helm: Path) -> None:
    assert all("RAY_SERVE_ENABLE_HA_PROXY" not in str(env) for env in _env_of_every_pod(_render(helm, None)))
    envs = _env_of_every_pod(_render(helm, "examples/multinode-autoscaling.yaml", "--set", "serve.haproxy=true",
                                     "--set", "relaySecret.name=omni-relay"))
    assert len(envs) == 4
    for env in envs:
        assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"} in env and "OMNI_RAY_RELAY_SECRET" in str(env)


def test_compile_cache_can_be_one_claim_that_every_worker_shares(helm: Path) -> None:
    """A ReadWriteMany claim instead of a hostPath: a worker on a node the autoscaler has just added mounts the same
    caches as the others, and torch.compile is pointed at them the same way."""
    cluster = _rayservice(_render(helm, "examples/multinode-autoscaling.yaml", "--set", "compileCache.hostPath=",
                                  "--set", "compileCache.persistentVolumeClaim=omni-compile-cache"))["spec"]["rayClusterConfig"]
    assert "compile-cache" not in str(cluster["headGroupSpec"])
    for group in cluster["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        caches = [v for v in spec["volumes"] if v["name"] == "compile-cache"]
        assert caches == [{"name": "compile-cache", "persistentVolumeClaim": {"claimName": "omni-compile-cache"}}]
        (container,) = spec["containers"]
        assert {"name": "compile-cache", "mountPath": "/var/cache/omni-ray"} in container["volumeMounts"]
        assert {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/var/cache/omni-ray/inductor"} in container["env"]


def test_checkpoint_model_path_points_into_the_mounted_volume(helm: Path) -> None:
    docs = _render(helm, None, "--set", "model.source=checkpoint", "--set", "model.subPath=ckpt",
                   "--set", "model.volume.hostPath.path=/data/models")
    service = _rayservice(docs)
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert config["applications"][0]["args"]["pipeline"]["model"]["path"] == "/models/ckpt"
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert head["volumes"] == [{"name": "model", "hostPath": {"path": "/data/models"}}]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["model.source=bogus"], "model/source"),
        (["model.source=checkpoint"], "needs model.volume"),
        (["serve.port=0"], "serve/port"),
        (["ray.workerGroups[0].name=Bad_Name"], "workerGroups/0/name"),
        (["image.tag="], "image/tag"),
        (["compileCache.hostPath=relative/dir"], "compileCache/hostPath"),
        (["compileCache.persistentVolumeClaim=Not_A_Name"], "compileCache/persistentVolumeClaim"),
        (["compileCache.hostPath=/var/cache/omni", "compileCache.persistentVolumeClaim=cache"], "not both"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(helm: Path, settings: list[str], message: str) -> None:
    args = ["template", "omni", str(CHART)]
    for setting in settings:
        args += ["--set", setting]
    result = _run(helm, *args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_dockerfile_and_chart_use_the_pinned_ray() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM rayproject/ray:2.60.0-py312-gpu" in dockerfile
    assert '"ray[serve]==2.60.0"' in (ROOT / "pyproject.toml").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["ray"]["version"] == "2.60.0"
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == values["image"]["tag"]
