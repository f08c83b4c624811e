"""The shipped router configs never serve a non-loopback host open: each names token files that
a Secret mounted into the router container holds, and without them the config is refused with
a message naming security.allow_insecure_bind (cluster/config.py). The VM launcher installs the same
files where the gpu-8x config names them."""

from pathlib import PurePosixPath

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.config_checks import ConfigError
from router.auth import is_loopback
from tests.deploy.conftest import REPO

TOKEN_FIELDS = ("auth_token_file", "admin_token_file")


def test_a_public_host_comes_with_tokens_from_a_mounted_secret(cluster):
    config = cluster.config["security"]
    assert not is_loopback(cluster.config["ports"]["host"])
    mounts = {m["name"]: m["mountPath"] for m in cluster.router["volumeMounts"]}
    volumes = {v["name"]: v for v in cluster.head["volumes"]}
    secrets = {s["metadata"]["name"]: s for s in cluster.all("Secret")}
    for field in TOKEN_FIELDS:
        path = PurePosixPath(config[field])
        (name,) = [n for n, m in mounts.items() if path.parent == PurePosixPath(m)]
        secret = volumes[name]["secret"]
        assert secret.get("optional") is not True  # no Secret: the pod waits, never runs open
        assert secret["secretName"] in secrets
        assert secret["defaultMode"] & 0o007 == 0  # not world-readable
        # the operator fills the values: the manifest ships none (apply -k keeps theirs)
        assert "data" not in secrets[secret["secretName"]]
        assert "stringData" not in secrets[secret["secretName"]]


def test_without_the_tokens_the_config_is_refused(cluster):
    security = {k: v for k, v in cluster.config["security"].items() if k not in TOKEN_FIELDS}
    config = {**cluster.config, "model": "tiny", "security": security}
    config["prefill"] = config["decode"] = {}
    with pytest.raises(ConfigError, match="security.allow_insecure_bind"):
        ClusterConfig.from_dict(config)
    ClusterConfig.from_dict({**config, "security": {**security, "allow_insecure_bind": True}})


def test_the_vm_head_installs_the_tokens_where_the_config_names_them():
    launcher = yaml.safe_load((REPO / "deploy" / "ray-cluster.yaml").read_text())
    gpu = yaml.safe_load((REPO / "deploy/kubernetes/overlays/gpu-8x/config.yaml").read_text())
    setup = "\n".join(launcher["head_setup_commands"])
    assert launcher["file_mounts"]["~/epcluster-secrets"] == "~/.epcluster/secrets"
    for field in TOKEN_FIELDS:
        path = PurePosixPath(gpu["security"][field])
        assert f"~/epcluster-secrets/{path.name}" in setup
        assert str(path.parent) in setup
