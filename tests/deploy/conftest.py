"""The rendered kustomizations under deploy/kubernetes, and the CRD schemas beside the checkout."""

from pathlib import Path

import pytest
import yaml

from tests.deploy import kustomize
from tests.deploy.schemas import REPO, find_shared_schemas

KUBERNETES = REPO / "deploy" / "kubernetes"
TARGETS = ("base", "overlays/cpu-demo", "overlays/gpu-8x")  # every kustomization applied


@pytest.fixture(scope="session")
def schema_folder() -> Path:
    folder = find_shared_schemas()
    if folder is None:
        pytest.skip("no shared/schemas beside the checkout (../shared/schemas): CRDs unchecked")
    return folder


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {target: kustomize.build(KUBERNETES / target) for target in TARGETS}


class Cluster:
    """The objects of one rendered kustomization, and the router config inside them."""

    def __init__(self, objs: list[dict]) -> None:
        self.objs = objs
        self.ray = self.one("RayCluster")
        self.config_map = self.one("ConfigMap", "epcluster-config")
        self.config = yaml.safe_load(self.config_map["data"]["config.yaml"])
        head = self.ray["spec"]["headGroupSpec"]["template"]["spec"]
        self.head = head
        self.router = container(head, "router")
        self.workers = {g["groupName"]: g for g in self.ray["spec"]["workerGroupSpecs"]}

    def all(self, kind: str) -> list[dict]:
        return [o for o in self.objs if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.all(kind) if name in (None, o["metadata"]["name"])]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def pod_specs(self) -> list[dict]:
        return [self.head] + [g["template"]["spec"] for g in self.workers.values()]


def container(pod_spec: dict, name: str) -> dict:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return found


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


@pytest.fixture(scope="session", params=TARGETS)
def cluster(request: pytest.FixtureRequest, rendered: dict[str, list[dict]]) -> Cluster:
    return Cluster(rendered[request.param])
