"""deploy/k8s: the manifests validate offline against Kubernetes' schemas (kubernetes-validate,
strict), HAProxy accepts the configuration they carry, and it checks health as the shipped one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from service.haproxy_config import example_config, render

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
KUBERNETES = "1.31"


def _documents() -> list[dict[str, object]]:
    docs: list[dict[str, object]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def test_manifests_validate_strictly() -> None:
    docs = _documents()
    assert {str(d["kind"]) for d in docs} == {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises on any problem


def _haproxy_cfg() -> str:
    (config_map,) = (d for d in _documents() if d["kind"] == "ConfigMap")
    data = config_map["data"]
    assert isinstance(data, dict)
    return str(data["haproxy.cfg"])


def test_the_balancer_checks_health_as_the_shipped_config_does() -> None:
    shipped = [line.strip() for line in render(example_config()).splitlines() if "tcp-check" in line]
    assert shipped and all(line in _haproxy_cfg() for line in shipped)
    assert "balance hdr(x-dyngen-affinity)" in _haproxy_cfg()


def test_termination_grace_outlasts_the_drain() -> None:
    (dyngen,) = (d for d in _documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "dyngen")  # type: ignore[index]
    pod = dyngen["spec"]["template"]["spec"]  # type: ignore[index]
    args = dict(a.removeprefix("--").split("=", 1) for a in pod["containers"][0]["args"] if "=" in a)
    drain = float(args["drain-delay-seconds"]) + float(args["shutdown-grace-seconds"])
    assert pod["terminationGracePeriodSeconds"] > drain


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (.ci/run installs it)")
def test_haproxy_accepts_the_config_map(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(_haproxy_cfg())
    result = subprocess.run(
        ["haproxy", "-c", "-q", "-f", str(cfg)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_the_gateway_deployment_is_a_valid_smg_command() -> None:
    """The smg container's arguments parse and validate with the pinned gateway's own parser, and it
    discovers the dyngen pods on their gRPC port."""
    from smg.launch_router import parse_router_args  # type: ignore[import-untyped]

    deployments = [d for d in _documents() if d["kind"] == "Deployment"]
    (gateway,) = (d for d in deployments if d["metadata"]["name"] == "dyngen-smg")  # type: ignore[index]
    container = gateway["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert container["command"] == ["smg"]
    launch, *args = container["args"]
    assert launch == "launch"
    router = parse_router_args(args)
    router._validate_router_args()
    assert router.policy == "cache_aware"
    assert router.service_discovery_port == 50051
