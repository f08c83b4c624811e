"""The Python kustomize build (tests/deploy/kustomize.py): the same objects as `kubectl kustomize`
where kubectl is installed, and loud on what it does not support."""

import shutil
import subprocess

import jsonpatch
import pytest
import yaml

from tests.deploy import kustomize
from tests.deploy.conftest import KUBERNETES, TARGETS


@pytest.mark.parametrize("target", TARGETS)
def test_same_objects_as_kubectl_kustomize(rendered, target):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the Python build is not cross-checked here")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES / target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    expected = kustomize.index([d for d in yaml.safe_load_all(out) if d])
    assert kustomize.index(rendered[target]) == expected


def _write(folder, files: dict[str, object]) -> None:
    for name, content in files.items():
        (folder / name).write_text(yaml.safe_dump(content))


CONFIG_MAP = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "c"},
    "data": {"a": "1"},
}


def test_unsupported_fields_raise(tmp_path):
    _write(
        tmp_path,
        {
            "cm.yaml": CONFIG_MAP,
            "kustomization.yaml": {"resources": ["cm.yaml"], "commonLabels": {"a": "b"}},
        },
    )
    with pytest.raises(kustomize.KustomizeError, match="commonLabels"):
        kustomize.build(tmp_path)


def test_a_failed_test_operation_stops_the_build(tmp_path):
    """The overlays guard list positions with JSON6902 "test": a moved item fails the build."""
    patch = [
        {"op": "test", "path": "/data/a", "value": "2"},
        {"op": "replace", "path": "/data/a", "value": "3"},
    ]
    target = {"version": "v1", "kind": "ConfigMap", "name": "c"}
    _write(
        tmp_path,
        {
            "cm.yaml": CONFIG_MAP,
            "patch.yaml": patch,
            "kustomization.yaml": {
                "resources": ["cm.yaml"],
                "patches": [{"path": "patch.yaml", "target": target}],
            },
        },
    )
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        kustomize.build(tmp_path)


def test_a_patch_that_matches_nothing_raises(tmp_path):
    target = {"kind": "ConfigMap", "name": "renamed"}
    _write(
        tmp_path,
        {
            "cm.yaml": CONFIG_MAP,
            "kustomization.yaml": {
                "resources": ["cm.yaml"],
                "patches": [{"path": "p.yaml", "target": target}],
            },
        },
    )
    (tmp_path / "p.yaml").write_text(yaml.safe_dump([{"op": "remove", "path": "/data"}]))
    with pytest.raises(kustomize.KustomizeError, match="no object matches"):
        kustomize.build(tmp_path)


@pytest.mark.parametrize(
    "ref,image,expected",
    [
        (
            "epcluster:0.1.0-cpu",
            {"name": "epcluster", "newTag": "0.1.0-cuda"},
            "epcluster:0.1.0-cuda",
        ),
        (
            "epcluster:0.1.0-cpu",
            {"name": "epcluster", "newName": "r.io/x/epcluster"},
            "r.io/x/epcluster:0.1.0-cpu",
        ),
        ("epcluster:0.1.0-cpu", {"name": "other", "newTag": "9"}, "epcluster:0.1.0-cpu"),
        (
            "localhost:5000/epcluster",
            {"name": "localhost:5000/epcluster", "newTag": "1"},
            "localhost:5000/epcluster:1",
        ),
        ("epcluster:1", {"name": "epcluster", "digest": "sha256:ab"}, "epcluster@sha256:ab"),
    ],
)
def test_images(ref, image, expected):
    assert kustomize._new_image(ref, image) == expected
