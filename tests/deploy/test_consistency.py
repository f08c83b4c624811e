"""What the objects of each rendered kustomization must agree on: the router config against the
pods, probes, Service, monitors and NetworkPolicies; pool sizes against worker groups."""

import logging
import re
from pathlib import Path

import yaml

from cluster.config import ClusterConfig
from moe.presets import preset_names
from router.api.v1_grpc import SERVICE_NAME
from router.server import LIVENESS_SERVICE
from tests.deploy.conftest import REPO, ports

RAY_PORTS = {6379, 8265, 10001, 8080, 52365}
MAX_RANKS_PER_NODE = 16
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def test_config_loads(cluster, tmp_path, caplog):
    """The shipped config loads as it is, in the tree (no warning about old flat keys)."""
    config = dict(cluster.config)
    security = dict(config.get("security", {}))
    for key in security:
        if key.endswith("_file"):
            # a Secret's file in the pod (test_security.py checks the mount): a stand-in here
            (tmp_path / key).write_text("stand-in")
            security[key] = str(tmp_path / key)
    config["security"] = security
    if config["model"] not in preset_names():  # a checkpoint on the nodes' volume, not here
        assert Path(config["model"]).is_absolute(), config["model"]
        config["model"] = "tiny"
    with caplog.at_level(logging.WARNING):
        ClusterConfig.from_dict(config)  # raises on an unknown field or a bad value
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_router_ports_and_probes_follow_the_config(cluster):
    config, router = cluster.config["ports"], cluster.router
    assert config["host"] == "0.0.0.0"  # probes and the Service reach the pod IP
    assert ports(router) == {
        "grpc": config["port"],
        "http": config["http_port"],
        "router-metrics": config["metrics_port"],
    }
    for probe in ("startupProbe", "livenessProbe"):
        # the router process, never its pools: a pool that re-forms must not restart it
        assert router[probe]["grpc"] == {"port": config["port"], "service": LIVENESS_SERVICE}
    assert router["readinessProbe"]["grpc"] == {
        "port": config["port"],
        "service": "epcluster.v1.Inference",
    }
    startup = router["startupProbe"]
    start_timeout_s = cluster.config["ray"]["start_timeout_s"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > start_timeout_s


def test_liveness_watches_the_process_and_readiness_the_pools(cluster):
    """Liveness names the health service the router keeps SERVING while its process runs;
    readiness names one that follows whether the pools can take work (router/server.py)."""
    probes = {p: cluster.router[p]["grpc"].get("service", "") for p in PROBES}
    assert probes["livenessProbe"] == LIVENESS_SERVICE
    assert probes["readinessProbe"] != LIVENESS_SERVICE
    assert probes["readinessProbe"] in ("", SERVICE_NAME)  # mirrored from backend.ready()


def test_router_is_a_ray_driver_beside_the_head(cluster):
    head, router = cluster.head, cluster.router
    ray_head = head["containers"][0]  # KubeRay's Ray container is the first
    assert ray_head["name"] == "ray-head"
    params = cluster.ray["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["num-cpus"] == params["num-gpus"] == "0"  # no rank lands on the head
    assert head["shareProcessNamespace"] is True  # the driver finds the raylet's process
    tmp = {m["name"] for m in router["volumeMounts"] if m["mountPath"] == "/tmp/ray"}
    assert tmp and tmp == {
        m["name"] for m in ray_head["volumeMounts"] if m["mountPath"] == "/tmp/ray"
    }
    script = router["args"][0]
    assert (
        "exec epcluster serve --address 127.0.0.1:6379 --config /etc/epcluster/config.yaml"
        in script
    )
    (mount,) = [m for m in router["volumeMounts"] if m["mountPath"] == "/etc/epcluster"]
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == cluster.config_map["metadata"]["name"]
    assert head["terminationGracePeriodSeconds"] > cluster.config["drain_timeout_s"]
    assert "epcluster serve" in " ".join(ray_head["lifecycle"]["preStop"]["exec"]["command"])


def test_ray_token_auth_reaches_the_router(cluster):
    assert cluster.ray["spec"]["authOptions"] == {"mode": "token"}
    env = {e["name"]: e for e in cluster.router["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    # KubeRay's generated Secret is named after the RayCluster, with key auth_token.
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": cluster.ray["metadata"]["name"],
        "key": "auth_token",
    }


def test_pools_match_worker_groups(cluster):
    config = cluster.config
    assert set(cluster.workers) == {"prefill", "decode"}
    for pool, group in cluster.workers.items():
        resource = f"epcluster_{pool}"
        assert config[pool]["resources"] == {resource: 1}
        per_pod = int(group["resources"][resource])
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        assert config[pool]["num_ranks"] == group["replicas"] * per_pod
        worker = group["template"]["spec"]["containers"][0]
        assert worker["name"] == "ray-worker"
        rank_ports = {n: p for n, p in ports(worker).items() if n.startswith("rank-metrics-")}
        assert rank_ports == {
            f"rank-metrics-{i}": config["ports"]["rank_metrics_port"] + i for i in range(per_pod)
        }
        assert per_pod <= MAX_RANKS_PER_NODE
        gpus = per_pod * config["ray"]["gpus_per_rank"]
        limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
        assert (
            int(limits.get("nvidia.com/gpu", 0)) == int(requests.get("nvidia.com/gpu", 0)) == gpus
        )
        # Ray sizes the node from the limits: room for every rank's CPU share
        assert float(limits["cpu"]) >= per_pod * config["ray"]["cpus_per_rank"]
    for c in cluster.head["containers"]:
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_every_pod_reads_the_checkpoint_at_the_same_path(cluster):
    for spec in cluster.pod_specs():
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
            assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
        model = cluster.config["model"]
        if model.startswith("/"):
            assert model.startswith("/models/")
            claim = volumes["models"]["persistentVolumeClaim"]
            assert claim["readOnly"] is True
            pvc = cluster.one("PersistentVolumeClaim", claim["claimName"])
            assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_one_image_for_every_container(cluster):
    images = {
        c["image"] for spec in cluster.pod_specs() for c in spec["containers"]
    }  # Ray needs the same Python and Ray on every node
    assert len(images) == 1
    (image,) = images
    dockerfile = "Dockerfile" if image.endswith("-cuda") else "Dockerfile.cpu"
    ray_version = re.search(
        r"^ARG RAY_VERSION=(\S+)$", (REPO / "deploy" / dockerfile).read_text(), re.M
    )
    assert cluster.ray["spec"]["rayVersion"] == ray_version.group(1)
    if cluster.config["ray"]["gpus_per_rank"]:
        assert dockerfile == "Dockerfile"


def _labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(cluster, group: str) -> dict:
    """The labels KubeRay puts on the pods, with the template's."""
    name = cluster.ray["metadata"]["name"]
    if group == "head":
        template = cluster.ray["spec"]["headGroupSpec"]["template"]
        kuberay = {"ray.io/node-type": "head", "ray.io/group": "headgroup"}
    else:
        template = cluster.workers[group]["template"]
        kuberay = {"ray.io/node-type": "worker", "ray.io/group": group}
    return {**template["metadata"].get("labels", {}), "ray.io/cluster": name, **kuberay}


def test_service_and_monitors_select_what_they_mean(cluster):
    service = cluster.one("Service", "epcluster-router")
    assert _labels_match(service["spec"]["selector"], _pod_labels(cluster, "head"))
    for group in cluster.workers:
        assert not _labels_match(service["spec"]["selector"], _pod_labels(cluster, group))
    svc_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert svc_ports["grpc"]["targetPort"] == "grpc"
    assert svc_ports["grpc"]["port"] == cluster.config["ports"]["port"]
    assert svc_ports["metrics"]["targetPort"] == "router-metrics"
    assert (svc_ports["http"]["targetPort"], svc_ports["http"]["port"]) == (
        "http",
        cluster.config["ports"]["http_port"],
    )

    monitor = cluster.one("ServiceMonitor")
    assert _labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics"}

    pod_monitor = cluster.one("PodMonitor")
    selector = pod_monitor["spec"]["selector"]["matchLabels"]
    assert _labels_match(selector, _pod_labels(cluster, "prefill"))
    assert _labels_match(selector, _pod_labels(cluster, "decode"))
    assert not _labels_match(selector, _pod_labels(cluster, "head"))
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    keep = endpoint["relabelings"][0]
    assert keep["action"] == "keep"
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    for group in cluster.workers.values():
        for name in ports(group["template"]["spec"]["containers"][0]):
            # Prometheus anchors relabel regexes: the whole name must match
            assert bool(re.fullmatch(keep["regex"], name)) == name.startswith("rank-metrics-")

    for obj in (monitor, pod_monitor, cluster.one("PrometheusRule")):
        assert obj["metadata"]["labels"]["release"] == "prometheus"


def _policies(cluster) -> list[dict]:
    return [p["spec"] for p in cluster.all("NetworkPolicy")]


def _ingress_ports(rule: dict) -> set[int]:
    out = set()
    for p in rule.get("ports", []):
        out |= set(range(p["port"], p.get("endPort", p["port"]) + 1))
    return out


def test_network_policies(cluster):
    name = cluster.ray["metadata"]["name"]
    config = cluster.config["ports"]
    internal_peer = {"podSelector": {"matchLabels": {"ray.io/cluster": name}}}
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    by_target = {}
    for spec in _policies(cluster):
        by_target.setdefault(tuple(sorted(spec["podSelector"]["matchLabels"].items())), []).append(
            spec
        )
    (internal,) = by_target[(("ray.io/cluster", name),)]
    assert internal["policyTypes"] == ["Ingress", "Egress"]  # everything else is denied
    # every port between the cluster's own pods, both ways
    assert {"from": [internal_peer]} in internal["ingress"]
    assert {"to": [internal_peer]} in internal["egress"]
    (dns,) = [r for r in internal["egress"] if "ports" in r]
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}

    open_ports = {}  # port -> the peers allowed (None: anyone)
    for spec in _policies(cluster):
        for rule in spec.get("ingress", []):
            if rule.get("from") == [internal_peer]:
                continue
            assert "ports" in rule, "only the cluster's own pods may reach every port"
            for port in _ingress_ports(rule):
                open_ports[port] = rule.get("from")
    assert not RAY_PORTS & set(open_ports)
    assert open_ports[config["port"]] is None  # clients
    assert open_ports[config["http_port"]] is None
    assert open_ports[config["metrics_port"]] == [monitoring]
    rank_ports = set(
        range(config["rank_metrics_port"], config["rank_metrics_port"] + MAX_RANKS_PER_NODE)
    )
    assert all(open_ports[p] == [monitoring] for p in rank_ports)
    assert set(open_ports) == {config["port"], config["http_port"], config["metrics_port"]} | (
        rank_ports
    )


def test_dashboards_generator_lists_every_dashboard():
    folder = REPO / "deploy" / "monitoring"
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    (gen,) = [g for g in k["configMapGenerator"] if g["name"] == "epcluster-dashboards"]
    listed = sorted(Path(f.rpartition("=")[2]) for f in gen["files"])
    on_disk = sorted(p.relative_to(folder) for p in (folder / "dashboards").glob("*.json"))
    assert listed == on_disk, "list every dashboards/*.json in deploy/monitoring/kustomization.yaml"
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"
    assert (folder / "dashboards" / "README.md").is_file()
