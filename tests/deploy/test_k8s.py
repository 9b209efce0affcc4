"""deploy/: every kustomize overlay renders and validates offline against the Kubernetes schemas of a
pinned version; custom resources carry their CRDs' required fields; the manifests, the Dockerfiles
and the Grafana dashboard agree with the server (ports, names, grace periods, metric names, flags);
and the CPU image's entry point and health check run as processes (no Docker daemon needed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asyncspec.config import EngineConfig
from asyncspec.server.app import ServerConfig
from asyncspec.server.service import SERVICE_NAME

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("gpu", "cpu", "keda", "auth", "gpu-tp2")
K8S_VERSION = "1.35"
"""The Kubernetes version whose schemas the built-in objects are validated against."""


def render(overlay: str, k8s: Path = DEPLOY / "k8s") -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(k8s / "overlays" / overlay)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def serve_args(objects: list[dict]) -> list[str]:
    (config_map,) = by_kind(objects, "ConfigMap")
    return config_map["data"]["serve.args"].split()


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")  # not "gpu": a marker name
def test_overlay_renders_and_built_in_kinds_validate(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "PodMonitor", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert ("ScaledObject" in kinds) == (overlay == "keda") and ("HorizontalPodAutoscaler" in kinds) != (
        overlay == "keda"
    )
    for obj in objects:
        if obj["kind"] in ("PodMonitor", "ScaledObject"):
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")  # not "gpu": a marker name
def test_custom_resources_have_their_required_fields(overlay):
    objects = render(overlay)
    (monitor,) = by_kind(objects, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"] and monitor["spec"]["podMetricsEndpoints"]
    for scaled in by_kind(objects, "ScaledObject"):
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        assert scaled["spec"]["scaleTargetRef"]["name"] == "asyncspec"
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["type"] == "prometheus" and {"serverAddress", "query", "threshold"} <= set(
                trigger["metadata"]
            )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")  # not "gpu": a marker name
def test_pod_monitor_selects_only_this_deployments_pods(overlay):
    """kustomize's labels do not reach a custom resource's selector: a lone `component: server` would scrape any
    such pod of the namespace."""
    objects = render(overlay)
    (monitor,) = by_kind(objects, "PodMonitor")
    (deployment,) = by_kind(objects, "Deployment")
    selector = monitor["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items() and selector.get("app.kubernetes.io/name") == "asyncspec"
    assert selector == deployment["spec"]["selector"]["matchLabels"] | selector


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")  # not "gpu": a marker name
def test_autoscaling_keeps_busy_replicas(overlay):
    """On the queue alone, a fleet that just keeps up reads 0 waiting and scales down to its minimum: the running
    requests per replica, at a target under --max-num-seqs, hold the replicas the load needs."""
    objects = render(overlay)
    args = serve_args(objects)
    max_num_seqs = int(flag(args, "--max-num-seqs")) if "--max-num-seqs" in args else EngineConfig().max_num_seqs
    targets: dict[str, float] = {}
    for hpa in by_kind(objects, "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            targets[metric["pods"]["metric"]["name"]] = float(metric["pods"]["target"]["averageValue"])
    for scaled in by_kind(objects, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            (name,) = _metric_names_in(trigger["metadata"]["query"])
            targets[name] = float(trigger["metadata"]["threshold"])
    assert set(targets) == {"asyncspec:num_requests_waiting", "asyncspec:num_requests_running"}
    assert 0 < targets["asyncspec:num_requests_running"] <= max_num_seqs


def test_keda_queries_read_the_namespace_the_overlay_deploys_in(tmp_path):
    """The ScaledObject's PromQL names a namespace inside a string, which kustomize's namespace does not rewrite:
    the overlay copies its namespace into the queries, so that changing it in one place moves both."""
    for namespace in (None, "llm-prod"):
        k8s = DEPLOY / "k8s"
        if namespace is not None:
            k8s = tmp_path / "k8s"
            shutil.copytree(DEPLOY / "k8s", k8s)
            kustomization = k8s / "overlays" / "keda" / "kustomization.yaml"
            text = kustomization.read_text()
            assert "\nnamespace: default\n" in text
            kustomization.write_text(text.replace("\nnamespace: default\n", f"\nnamespace: {namespace}\n"))
        objects = render("keda", k8s)
        (scaled,) = by_kind(objects, "ScaledObject")
        deployed_in = {o["metadata"].get("namespace") for o in objects}
        assert deployed_in == {namespace or "default"}
        queries = [trigger["metadata"]["query"] for trigger in scaled["spec"]["triggers"]]
        assert len(queries) == 2
        for query in queries:
            assert re.findall(r'namespace="([^"]*)"', query) == [namespace or "default"], query


def test_dashboard_fractions_are_not_summed_over_pods_and_legends_tell_series_apart():
    dashboard = json.loads((DEPLOY / "grafana" / "asyncspec.json").read_text())
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        if panel["fieldConfig"]["defaults"].get("unit") == "percentunit":
            # A per-pod fraction summed over eight pods reads up to 800 %; a ratio of sums is fine.
            assert all(not e.startswith("sum(") or " / " in e for e in exprs), (panel["title"], exprs)
        legends = [t.get("legendFormat", "") for t in panel["targets"]]
        assert len(set(legends)) == len(legends), (panel["title"], legends)
        if len(legends) > 1:
            assert panel["title"] not in legends, (panel["title"], legends)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")  # not "gpu": a marker name
def test_ports_probes_and_grace_agree_with_the_server(overlay):
    objects = render(overlay)
    defaults = ServerConfig()
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": defaults.port, "metrics": defaults.metrics_port}
    args = serve_args(objects)
    assert int(flag(args, "--port")) == defaults.port and int(flag(args, "--metrics-port")) == defaults.metrics_port
    for probe, service in (("startupProbe", SERVICE_NAME), ("readinessProbe", SERVICE_NAME), ("livenessProbe", "")):
        assert container[probe]["grpc"] == {"port": defaults.port, "service": service}
    # The pod's grace covers the preStop sleep plus the server's drain.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(flag(args, "--drain-grace-s"))
    # A startup budget long enough for big models and graph capture (the GPU overlays).
    startup = container["startupProbe"]
    if overlay != "cpu":
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"] and pod["securityContext"]["runAsNonRoot"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])  # /dev/shm
    assert ("nvidia.com/gpu" in container["resources"].get("limits", {})) == (overlay != "cpu")
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    assert services["asyncspec-headless"]["spec"]["clusterIP"] == "None"
    for service in services.values():
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
            assert port["name"].startswith(("grpc", "http"))  # so Istio / Linkerd pick the protocol
    (policy,) = by_kind(objects, "NetworkPolicy")
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == set(ports.values())
    (monitor,) = by_kind(objects, "PodMonitor")
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"metrics"}
    if overlay == "auth":
        env = {e["name"]: e for e in container["env"]}
        secret = env["ASYNCSPEC_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
        assert any(s["metadata"]["name"] == secret for s in by_kind(objects, "Secret"))


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"{o}-overlay")  # not "gpu": a marker name
def test_every_configmap_flag_is_accepted_by_serve(overlay):
    from asyncspec.cli import main

    args = serve_args(render(overlay))
    assert args[0] == "serve"
    with pytest.raises(SystemExit) as e:  # parses every flag, then --help exits 0; a bad flag exits 2
        main([*args, "--help"])
    assert e.value.code == 0


@pytest.mark.parametrize("overlay", ["gpu", "gpu-tp2"], ids=lambda o: f"{o}-overlay")
def test_gpu_limit_matches_tensor_parallel_size(overlay):
    """Each tensor-parallel rank needs a GPU of its own on the pod's node."""
    objects = render(overlay)
    args = serve_args(objects)
    size = int(flag(args, "--tensor-parallel-size")) if "--tensor-parallel-size" in args else 1
    (deployment,) = by_kind(objects, "Deployment")
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == size
    # Without a usable GPU the pod must fail, not go Ready on the CPU (the engine's default device falls back).
    assert flag(args, "--device") == "cuda"
    if size > 1:
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"  # NCCL's shared-memory transport


def _metric_names_in(text: str) -> set[str]:
    return set(re.findall(r"asyncspec:[a-z0-9_]+", text))


def test_metric_names_used_by_autoscaling_monitoring_and_dashboard_exist():
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server.server_helpers import ServerThread
    from tests.server.test_server import _request

    used = set()
    for overlay in ("gpu", "keda"):
        scalers = [o for o in render(overlay) if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
        used |= _metric_names_in(yaml.safe_dump_all(scalers))
    dashboard = json.loads((DEPLOY / "grafana" / "asyncspec.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used |= {n for e in exprs for n in _metric_names_in(e)}
    assert "asyncspec:num_requests_waiting" in used and len(used) >= 10
    server = ServerThread()
    try:
        list(server.stub().Generate(_request([5, 6, 7, 8], 3)))
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    finally:
        server.stop()
    exposed = set()
    for family in text_string_to_metric_families(text):
        exposed |= {s.name for s in family.samples} | {family.name}
    missing = sorted(used - exposed)
    assert not missing, f"used but not exposed: {missing}"


def _dockerfile_commands(path: Path) -> tuple[list[str], list[str], list[str]]:
    text = path.read_text().replace("\\\n", " ")
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    health = json.loads(re.search(r"HEALTHCHECK .*?CMD (\[.*\])", text).group(1))
    return entry, cmd, health


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_commands_exist_in_the_package(name):
    from asyncspec.cli import main

    text = (DEPLOY / name).read_text()
    assert re.search(r"^USER 10001$", text, re.M) and "COPY models /app/models" in text
    entry, cmd, health = _dockerfile_commands(DEPLOY / name)
    assert entry == ["asyncspec"] and health[0] == "asyncspec"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^asyncspec = "asyncspec\.cli:main"$', pyproject, re.M)
    for argv in (cmd, health[1:]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, argv
    assert flag(health, "--service") == SERVICE_NAME
    requirements = (DEPLOY / ("requirements-cpu.txt" if name.endswith("cpu") else "requirements-gpu.txt")).read_text()
    pins = dict(line.split("==") for line in requirements.splitlines() if line and not line.startswith("#"))
    for package in ("torch", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "prometheus-client"):
        assert package in pins, package


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_image_entry_point_serves_passes_its_health_check_and_drains():
    """The CPU image's ENTRYPOINT + CMD as a process (its /app paths mapped onto this checkout, fixed
    ports swapped for free ones), its HEALTHCHECK command against it, then SIGTERM: exit 0 within the
    drain grace."""
    exe = Path(sys.executable).parent / "asyncspec"
    if not exe.exists():
        pytest.skip("the asyncspec console script is not installed in this environment")
    entry, cmd, health = _dockerfile_commands(DEPLOY / "Dockerfile.cpu")
    port, metrics_port = _free_port(), _free_port()
    argv = [str(exe), *entry[1:], *(a.replace("/app/", f"{REPO}/") for a in cmd)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
    argv += ["--max-model-len", "256", "--num-kv-blocks", "32", "--drain-grace-s", "3"]
    probe = [str(exe), *(a.replace("127.0.0.1:50051", f"127.0.0.1:{port}") for a in health[1:])]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        assert "serving" in proc.stdout.readline()
        deadline = time.monotonic() + 60
        while subprocess.run(probe, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0 and time.monotonic() - start < 3 + 10
        assert subprocess.run(probe, capture_output=True).returncode != 0  # nothing serves any more
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_what_the_dockerfile_copies_builds_the_package_with_its_data(name, tmp_path):
    """The image installs the package from what its COPY lines put in /app: those alone must build the wheel
    (pyproject.toml's package-dir maps folders outside asyncspec/), with the kernels and the benchmark prompts."""
    import zipfile

    app = tmp_path / "app"
    app.mkdir()
    for line in (DEPLOY / name).read_text().splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] != "COPY" or not parts[-1].startswith("/app"):
            continue
        destination = Path(parts[-1])
        for source in parts[1:-1]:
            if source == "models":
                continue  # the weights, not part of the wheel
            target = app / destination.relative_to("/app")
            if len(parts) > 3 or parts[-1].endswith("/"):
                target = target / Path(source).name
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / source, target)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=app,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("asyncspec-*.whl"))).namelist()
    assert "asyncspec/kernels/paged_attention.py" in names
    assert "asyncspec/bench_data/prompts-code.jsonl" in names
