"""Every object of the base and of every rendered overlay validates offline, strictly, and a
misspelled field fails (custom resources and built-in kinds alike)."""

from copy import deepcopy

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy import schemas
from tests.deploy.conftest import TARGETS

CUSTOM_KINDS = {"RayCluster", "PodMonitor", "ServiceMonitor", "PrometheusRule"}


@pytest.mark.parametrize("version", schemas.K8S_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates(rendered, schema_folder, target, version):
    objs = rendered[target]
    for obj in objs:
        schemas.validate(obj, schema_folder, version)
    kinds = {o["kind"] for o in objs}
    assert CUSTOM_KINDS <= kinds, "the custom resources were not all rendered"
    assert {"ConfigMap", "Service", "NetworkPolicy"} <= kinds


def test_the_custom_kinds_have_crds(schema_folder):
    known = {kind for _, kind in schemas.crd_schemas(schema_folder)}
    assert CUSTOM_KINDS <= known


def _by_kind(rendered, kind):
    return deepcopy(next(o for o in rendered["base"] if o["kind"] == kind))


# A misspelling at several depths of each custom kind: the strict schema rejects each, and the
# CRD's schema as published (what `kubectl apply` would prune silently) does not.
CRD_TYPOS = [
    ("RayCluster", lambda o: o["spec"].update(workerGroupSpec=[])),
    ("RayCluster", lambda o: o["spec"]["headGroupSpec"].update(rayStartParam={})),
    ("RayCluster", lambda o: o["spec"]["workerGroupSpecs"][0].update(replica=2)),
    (
        "RayCluster",
        lambda o: o["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]["readinessProbe"][
            "grpc"
        ].update(servce="epcluster.v1.Inference"),
    ),
    ("RayCluster", lambda o: o["spec"]["authOptions"].update(mod="token")),
    ("PodMonitor", lambda o: o["spec"].update(podMetricsEndpoint=[])),
    (
        "PodMonitor",
        lambda o: o["spec"]["podMetricsEndpoints"][0]["relabelings"][0].update(sourcelabels=["x"]),
    ),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(prot="metrics")),
    ("PrometheusRule", lambda o: o.update(sepc={})),
]


@pytest.mark.parametrize("kind,misspell", CRD_TYPOS)
def test_misspelled_field_fails_custom_resource(rendered, schema_folder, kind, misspell):
    obj = _by_kind(rendered, kind)
    schemas.validate(obj, schema_folder, schemas.K8S_VERSIONS[0])  # valid before
    misspell(obj)
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        schemas.validate_custom(obj, schemas.crd_schemas(schema_folder))
    lenient = schemas.crd_schemas(schema_folder, make_strict=False)
    schemas.validate_custom(obj, lenient)  # the published schema alone lets it through


def test_wrong_type_fails_custom_resource(rendered, schema_folder):
    obj = _by_kind(rendered, "RayCluster")
    obj["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'integer'"):
        schemas.validate(obj, schema_folder, schemas.K8S_VERSIONS[0])


BUILTIN_TYPOS = [
    ("Service", lambda o: o["spec"].update(selectr={})),
    ("NetworkPolicy", lambda o: o["spec"].update(policyType=["Ingress"])),
    ("ConfigMap", lambda o: o["metadata"].update(lables={})),
]


@pytest.mark.parametrize("version", schemas.K8S_VERSIONS)
@pytest.mark.parametrize("kind,misspell", BUILTIN_TYPOS)
def test_misspelled_field_fails_builtin(rendered, schema_folder, kind, misspell, version):
    obj = _by_kind(rendered, kind)
    schemas.validate(obj, schema_folder, version)
    misspell(obj)
    with pytest.raises(kubernetes_validate.ValidationError):
        schemas.validate(obj, schema_folder, version)


@pytest.mark.parametrize("version", schemas.K8S_VERSIONS)
def test_misspelled_field_in_a_ray_pod_template_fails_builtin(rendered, schema_folder, version):
    """The pod templates inside the RayCluster also meet each Kubernetes version's schema."""
    obj = _by_kind(rendered, "RayCluster")
    obj["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["imagePullPolcy"] = (
        "Always"
    )
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        schemas.validate(obj, schema_folder, version)
    # The CRD leaves metadata open: the built-in ObjectMeta schema catches a typo there.
    obj = _by_kind(rendered, "RayCluster")
    obj["metadata"]["labelz"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        schemas.validate(obj, schema_folder, version)


def test_unknown_kind_is_an_error_not_a_pass(schema_folder):
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        schemas.validate(obj, schema_folder, schemas.K8S_VERSIONS[0])


def test_kubernetes_validate_ships_the_versions_we_claim():
    shipped = {".".join(v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()}
    assert set(schemas.K8S_VERSIONS) <= shipped, "pin kubernetes-validate to a release with them"
