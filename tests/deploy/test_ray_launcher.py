"""deploy/ray-cluster.yaml (Ray's cluster launcher, `ray up`): valid for the installed Ray's own
launcher checks (its JSON schema, strict at the top level, and the provider's defaults merged
in), and consistent with the router config it starts."""

import re
from copy import deepcopy

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.deploy.conftest import REPO

LAUNCHER = REPO / "deploy" / "ray-cluster.yaml"


@pytest.fixture(scope="module")
def launcher() -> dict:
    return yaml.safe_load(LAUNCHER.read_text())


@pytest.fixture(scope="module")
def config(launcher) -> dict:
    """The router config the launcher's header tells operators to start."""
    path = "deploy/kubernetes/overlays/gpu-8x/config.yaml"
    assert f"--config ~/epcluster/{path}" in LAUNCHER.read_text()
    assert launcher["file_mounts"]["~/epcluster"] == "."
    return yaml.safe_load((REPO / path).read_text())


def test_ray_accepts_it(launcher):
    validate_config(prepare_config(deepcopy(launcher)))


def test_a_misspelled_key_fails(launcher):
    bad = deepcopy(launcher)
    bad["worker_start_ray_command"] = bad.pop("worker_start_ray_commands")
    with pytest.raises(jsonschema.ValidationError, match="worker_start_ray_command"):
        validate_config(prepare_config(bad))
    bad = deepcopy(launcher)
    bad["available_node_types"]["prefill"]["min_worker"] = 2
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        validate_config(prepare_config(bad))


def test_head_takes_no_rank_and_keeps_the_job_api_local(launcher):
    start = " ".join(launcher["head_start_ray_commands"])
    for flag in ("--head", "--num-cpus=0", "--num-gpus=0", "--dashboard-host=127.0.0.1"):
        assert flag in start
    head = launcher["available_node_types"][launcher["head_node_type"]]
    assert head["resources"] == {"CPU": 0, "GPU": 0}


def test_pools_are_node_types_with_their_resource(launcher, config):
    types = launcher["available_node_types"]
    for pool in ("prefill", "decode"):
        node = types[pool]
        resource = f"epcluster_{pool}"
        assert config[pool]["resources"] == {resource: 1}
        assert node["min_workers"] == node["max_workers"]  # a pool's EP size is fixed
        per_node = node["resources"][resource]
        assert per_node == node["resources"]["GPU"] / config["ray"]["gpus_per_rank"]
        assert config[pool]["num_ranks"] == node["min_workers"] * per_node
        assert node["resources"]["CPU"] >= per_node * config["ray"]["cpus_per_rank"]
        others = [t for name, t in types.items() if name != pool]
        assert all(resource not in t["resources"] for t in others)


def test_nodes_install_the_project_and_share_the_ray_token(launcher):
    setup = "\n".join(launcher["setup_commands"])
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()  # the same versions as the images
    torch, ray = (
        re.search(rf"^ARG {v}=(\S+)$", dockerfile, re.M)[1]
        for v in ("TORCH_VERSION", "RAY_VERSION")
    )
    assert f'pip install -q torch=={torch} "ray[default]=={ray}"' in setup
    assert "pip install -q --no-build-isolation ~/epcluster" in setup
    assert "RAY_AUTH_MODE=token" in setup
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
