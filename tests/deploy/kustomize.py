"""A small kustomize build: the part of kustomize that deploy/ uses, in Python.

kustomize and kubectl cannot be installed from the registries CI reaches, so the tests render
the kustomizations themselves. Supported: `resources` (files and kustomization folders),
`namespace`, `configMapGenerator` (files, behavior create/replace/merge, options
disableNameSuffixHash/labels/annotations), `images` (newName/newTag/digest on any containers or
initContainers list) and `patches` as JSON6902 files with a `target`. Anything else raises, so a
kustomization never relies on a feature this build ignores; test_kustomize.py compares the
result with `kubectl kustomize` wherever kubectl is installed.
"""

from copy import deepcopy
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

Obj = dict[str, Any]
KEYS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "images", "patches"}
GENERATOR_KEYS = {"name", "behavior", "files", "options"}
OPTION_KEYS = {"disableNameSuffixHash", "labels", "annotations"}
TARGET_KEYS = {"group", "version", "kind", "name", "namespace"}


class KustomizeError(ValueError):
    pass


def load_yaml_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def build(folder: Path) -> list[Obj]:
    """The objects `kustomize build folder` would print (order aside)."""
    folder = Path(folder)
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - KEYS
    if unknown:
        raise KustomizeError(f"{folder}: unsupported kustomization fields {sorted(unknown)}")
    objs: list[Obj] = []
    for entry in k.get("resources", []):
        path = folder / entry
        objs += build(path) if path.is_dir() else load_yaml_docs(path)
    for gen in k.get("configMapGenerator", []):
        _generate_configmap(folder, gen, objs)
    for patch in k.get("patches", []):
        _apply_patch(folder, patch, objs)
    for image in k.get("images", []):
        for obj in objs:
            _set_images(obj, image)
    if "namespace" in k:
        for obj in objs:
            obj["metadata"]["namespace"] = k["namespace"]
    return objs


def _generate_configmap(folder: Path, gen: Obj, objs: list[Obj]) -> None:
    if set(gen) - GENERATOR_KEYS:
        raise KustomizeError(f"unsupported generator fields {sorted(set(gen) - GENERATOR_KEYS)}")
    options = gen.get("options", {})
    if set(options) - OPTION_KEYS or not options.get("disableNameSuffixHash"):
        raise KustomizeError(f"{gen['name']}: only disableNameSuffixHash: true is supported")
    data = {}
    for entry in gen.get("files", []):
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = (folder / path).read_text()
    metadata = {"name": gen["name"]}
    for field in ("labels", "annotations"):
        if field in options:
            metadata[field] = dict(options[field])
    behavior = gen.get("behavior", "create")
    same = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == gen["name"]]
    if behavior == "create":
        if same:
            raise KustomizeError(f"ConfigMap {gen['name']} exists: use behavior replace or merge")
        cm: Obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}
        if data:
            cm["data"] = data
        objs.append(cm)
        return
    if behavior not in ("replace", "merge") or len(same) != 1:
        raise KustomizeError(f"{gen['name']}: behavior {behavior!r} needs one ConfigMap to act on")
    old = same[0]
    for field in ("labels", "annotations"):
        if field in metadata:
            old["metadata"].setdefault(field, {}).update(metadata[field])
    old["data"] = {**old.get("data", {}), **data} if behavior == "merge" else data


def _matches(obj: Obj, target: Obj) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    have = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "namespace": obj["metadata"].get("namespace"),
    }
    return all(have[key] == value for key, value in target.items())


def _apply_patch(folder: Path, patch: Obj, objs: list[Obj]) -> None:
    if set(patch) != {"path", "target"} or set(patch["target"]) - TARGET_KEYS:
        raise KustomizeError(f"only JSON6902 patches with path and target: {patch}")
    ops = yaml.safe_load((folder / patch["path"]).read_text())
    if not isinstance(ops, list):
        raise KustomizeError(f"{patch['path']}: not a JSON6902 patch (a list of operations)")
    hits = [i for i, obj in enumerate(objs) if _matches(obj, patch["target"])]
    if not hits:  # kustomize would do nothing; here a patch that applies to nothing is a bug
        raise KustomizeError(f"{patch['path']}: no object matches {patch['target']}")
    for i in hits:
        objs[i] = jsonpatch.apply_patch(objs[i], ops)


def _set_images(node: Any, image: Obj) -> None:
    """kustomize's images transformer: every containers/initContainers entry, any kind."""
    if isinstance(node, list):
        for item in node:
            _set_images(item, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                container["image"] = _new_image(container.get("image", ""), image)
        _set_images(value, image)


def _new_image(ref: str, image: Obj) -> str:
    name, digest = ref.split("@", 1) if "@" in ref else (ref, None)
    tag = None
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    if name != image["name"]:
        return ref
    name = image.get("newName", name)
    if "digest" in image:
        return f"{name}@{image['digest']}"
    tag = image.get("newTag", tag)
    out = f"{name}:{tag}" if tag else name
    return f"{out}@{digest}" if digest and "newTag" not in image else out


def index(objs: list[Obj]) -> dict[tuple[str, str, str], Obj]:
    """(kind, namespace, name) -> object; raises on duplicates (kustomize refuses them too)."""
    out: dict[tuple[str, str, str], Obj] = {}
    for obj in objs:
        key = (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if key in out:
            raise KustomizeError(f"duplicate object {key}")
        out[key] = deepcopy(obj)
    return out
