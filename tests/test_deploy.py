"""The deployment files agree with each other and with the server they deploy: the image's command,
the Deployment's arguments and the health check parse with the server's and the client's own flags;
ports, user, shutdown grace and label selectors match across Dockerfile and manifests. (The schema
and lint checks need tools from the index: deploy/validate.sh.)"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from server import client as server_client
from server import config as server_config
from server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    last_from = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines[last_from:]]


def final_stage(instruction: str) -> str:
    values = [args for name, args in dockerfile_instructions() if name == instruction]
    assert values, f"the Dockerfile's final stage has no {instruction}"
    return values[-1]


def manifests() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name in ("kustomization.yaml", "prometheus-adapter-rules.yaml", "hpa-queue-depth.yaml"):
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def server_container() -> dict:
    (container,) = manifests()[("Deployment", "gret-serve")]["spec"]["template"]["spec"]["containers"]
    return container


def test_requirements_are_pyprojects_pinned_dependencies():
    out = subprocess.run([sys.executable, str(ROOT / "deploy" / "requirements.py")], check=True,
                         capture_output=True, text=True).stdout.split()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert out == [d.strip() for d in declared]
    assert all("==" in r for r in out)


def test_image_command_and_deployment_args_parse_with_the_servers_flags():
    command = json.loads(final_stage("CMD"))
    assert json.loads(final_stage("ENTRYPOINT")) == ["python", "-m", "server"]
    image_config, prepare_only = server_config.load(command)
    assert not prepare_only
    deployed, _ = server_config.load(server_container()["args"])
    ports = [(c.port, c.http_port, c.metrics_port) for c in (image_config, deployed)]
    assert ports == [(50051, 8080, 9090)] * 2


def test_healthcheck_command_parses_with_the_clients_flags():
    # The command, pointed at a port nothing listens on: a parse error would exit 2 through
    # SystemExit; a well-formed call fails to connect and returns 2 instead.
    healthcheck = final_stage("HEALTHCHECK")
    argv = json.loads(healthcheck.split("CMD", 1)[1])
    assert argv[:3] == ["python", "-m", "server.client"] and argv[-1] == "health"
    argv = [a if a != "localhost:50051" else "127.0.0.1:9" for a in argv[3:]]
    argv[argv.index("--timeout") + 1] = "0.5"
    assert server_client.main(argv) == 2


def test_ports_user_and_probes_match_the_image():
    container = server_container()
    exposed = {int(p) for p in final_stage("EXPOSE").split()}
    assert {p["containerPort"] for p in container["ports"]} == exposed
    assert container["startupProbe"]["grpc"]["port"] == 50051
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named["http"] == 8080
    for probe, path in (("readinessProbe", "/health/ready"), ("livenessProbe", "/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    uid, gid = (int(x) for x in final_stage("USER").split(":"))
    pod_security = manifests()[("Deployment", "gret-serve")]["spec"]["template"]["spec"]["securityContext"]
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == (uid, gid)
    assert pod_security["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]


def test_termination_grace_covers_prestop_and_the_servers_drain():
    pod = manifests()[("Deployment", "gret-serve")]["spec"]["template"]["spec"]
    config, _ = server_config.load(server_container()["args"])
    pre_stop = server_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + config.grace_seconds + 5


@pytest.mark.parametrize("service", ["gret-serve", "gret-serve-metrics"])
def test_services_select_the_deployments_pods(service):
    docs = manifests()
    labels = docs[("Deployment", "gret-serve")]["spec"]["template"]["metadata"]["labels"]
    spec = docs[("Service", service)]["spec"]
    assert spec["selector"].items() <= labels.items()
    ports = {p["name"] for p in server_container()["ports"]}
    assert {p["targetPort"] for p in spec["ports"]} <= ports
    if service == "gret-serve":
        assert spec["clusterIP"] == "None"  # headless: clients balance per call, see deploy/README.md


def test_autoscalers_target_the_deployment():
    for path in (K8S / "hpa.yaml", K8S / "hpa-queue-depth.yaml"):
        hpa = yaml.safe_load(path.read_text())
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gret-serve"}
    queue = yaml.safe_load((K8S / "hpa-queue-depth.yaml").read_text())
    names = [m["pods"]["metric"]["name"] for m in queue["spec"]["metrics"] if m["type"] == "Pods"]
    assert names == ["gret_serve_queue_depth"]
    exported = {metric.name for metric in Metrics().registry.collect()}
    assert set(names) <= exported
