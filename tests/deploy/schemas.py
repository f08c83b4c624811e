"""Offline validation of Kubernetes objects, strict: an unknown (misspelled) field fails.

Built-in kinds: kubernetes-validate's strict schemas for each Kubernetes version in
K8S_VERSIONS. Custom resources (RayCluster, PodMonitor, ServiceMonitor, PrometheusRule): the
openAPIV3Schema of their CRDs in ../shared/schemas, made strict the way the API server prunes:
`additionalProperties: false` on every object schema that lists `properties` and neither sets
`additionalProperties` nor `x-kubernetes-preserve-unknown-fields` (where the API server would
drop an unknown field silently, this fails it). A custom resource's metadata and the pod
templates a RayCluster embeds are also checked against the built-in schemas of each version.
Not checked: CEL rules (x-kubernetes-validations), formats, defaults.
"""

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import latest_version

SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 60k lines
REPO = Path(__file__).resolve().parents[2]
# gRPC probes are GA from 1.27: the oldest Kubernetes the manifests claim; and the newest
# version this kubernetes-validate ships, to catch APIs that were removed since.
K8S_VERSIONS = ("1.27", ".".join(latest_version().split(".")[:2]))

Obj = dict[str, Any]


def find_shared_schemas(start: Path = REPO) -> Path | None:
    """shared/schemas beside the checkout: ../shared/schemas of the repository root, or of a
    folder above it (a worktree, CI's fresh clone with shared/ beside it)."""
    for folder in (start, *start.parents):
        candidate = folder / "shared" / "schemas"
        if (candidate / "kuberay").is_dir():
            return candidate
    return None


SUBSCHEMA = ("items", "additionalProperties", "not")  # keywords whose value is a schema
SUBSCHEMAS = ("allOf", "anyOf", "oneOf")  # ... a list of schemas
SCHEMA_MAPS = ("properties", "patternProperties")  # ... a mapping name -> schema


def strict(schema: Obj) -> Obj:
    """A copy of an OpenAPI v3 schema where unknown fields fail (see the module docstring)."""
    out = dict(schema)
    for key in SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            out[key] = strict(schema[key])
    for key in SUBSCHEMAS:
        if key in schema:
            out[key] = [strict(s) for s in schema[key]]
    for key in SCHEMA_MAPS:
        if key in schema:
            out[key] = {name: strict(s) for name, s in schema[key].items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def _published(folder: Path) -> dict[tuple[str, str], Obj]:
    out = {}
    for path in sorted(folder.glob("*/*.yaml")):
        crd = yaml.load(path.read_text(), Loader=SafeLoader)
        if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
            continue
        spec = crd["spec"]
        for version in spec["versions"]:
            key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
            out[key] = version["schema"]["openAPIV3Schema"]
    return out


@cache
def crd_schemas(folder: Path, make_strict: bool = True) -> dict[tuple[str, str], Obj]:
    """(apiVersion, kind) -> the openAPIV3Schema of every CRD version under folder."""
    published = _published(folder)
    return {key: strict(s) if make_strict else s for key, s in published.items()}


def validate_custom(obj: Obj, schemas: dict[tuple[str, str], Obj]) -> None:
    """Raises jsonschema.ValidationError (or KeyError for a kind without a CRD)."""
    schema = schemas[(obj["apiVersion"], obj["kind"])]
    jsonschema.Draft7Validator(schema).validate(obj)


def validate_builtin(obj: Obj, version: str) -> None:
    """Raises kubernetes_validate.ValidationError, or SchemaNotFoundError for an unknown kind."""
    kubernetes_validate.validate(obj, version, strict=True)


def pod_templates(obj: Obj) -> list[tuple[str, Obj]]:
    """The pod templates a RayCluster embeds, by group."""
    if obj["kind"] != "RayCluster":
        return []
    spec = obj["spec"]
    out = [("head", spec["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    return out


def validate(obj: Obj, schema_folder: Path, version: str) -> None:
    """One object of any kind, everything this module checks."""
    schemas = crd_schemas(schema_folder)
    if (obj["apiVersion"], obj["kind"]) not in schemas:
        validate_builtin(obj, version)
        return
    validate_custom(obj, schemas)
    # The CRDs leave metadata open, and KubeRay's embedded PodSpec is generated from a newer
    # Kubernetes than the oldest one we claim: check both against the built-in schemas.
    validate_builtin(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, version
    )
    for group, template in pod_templates(obj):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}}
        validate_builtin({**wrapped, "template": template}, version)
