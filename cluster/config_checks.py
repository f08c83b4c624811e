"""How the cluster config checks itself: the type of every field of a section (a role dataclass)
against its annotation, value checks by dotted path, and a section built from a YAML mapping.
Every message names the field by its dotted path from the top of the YAML (`routing.kv_lease_s`)."""

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

from engine.config import EngineConfigError

# (field, predicate over the section, why): a section's value checks, run before the section's
# own class is built so that the message names the dotted path
Check = tuple[str, Callable[[Any], bool], str]


class ConfigError(ValueError):
    """An invalid cluster config; the message names the field by its dotted path."""


def check_types(cls: type, obj: object, prefix: str = "") -> None:
    """Every field of the dataclass `cls`, read from `obj`, holds a value of its annotated type
    (ints are accepted for floats; bools are never numbers)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        value, hint = getattr(obj, f.name), hints[f.name]
        if not is_a(value, hint):
            raise ConfigError(
                f"{prefix}{f.name} must be {describe(hint)} (got {type(value).__name__} {value!r})"
            )


def is_a(value: object, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(is_a(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is dict:
        key_t, value_t = typing.get_args(hint)
        return isinstance(value, dict) and all(
            is_a(k, key_t) and is_a(v, value_t) for k, v in value.items()
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is dict:
        key_t, value_t = typing.get_args(hint)
        return f"a mapping of {describe(key_t)} to {describe(value_t)}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def run_checks(checks: list[Check], obj: object, prefix: str = "") -> None:
    for name, ok, why in checks:
        if not ok(obj):
            raise ConfigError(f"{prefix}{name} {why} (got {getattr(obj, name)!r})")


def reject_unknown(data: dict[str, Any], known: set[str], prefix: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        names = ", ".join(f"{prefix}{u}" for u in unknown)
        raise ConfigError(f"unknown config field {names}; known fields: {sorted(known)}")


def defaults(cls: type) -> dict[str, Any]:
    """The default of every field of the dataclass `cls` (each has one)."""
    out = {}
    for f in fields(cls):
        has_factory = f.default_factory is not dataclasses.MISSING
        out[f.name] = f.default_factory() if has_factory else f.default
    return out


def build_section(
    cls: type, raw: object, path: str, checks: list[Check], exclude: tuple[str, ...] = ()
) -> Any:
    """The section `path` of the config, an instance of `cls` from its YAML mapping: unknown
    fields, wrong types and bad values are refused naming `path.field`. `exclude`: fields of
    `cls` the YAML may not set here (the cluster sets them)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of {path} fields, got {raw!r}")
    reject_unknown(raw, {f.name for f in fields(cls)} - set(exclude), f"{path}.")
    view = SimpleNamespace(**{**defaults(cls), **raw})
    check_types(cls, view, f"{path}.")
    run_checks(checks, view, f"{path}.")
    try:
        return cls(**raw)
    except EngineConfigError as e:
        raise ConfigError(engine_message(e, f"{path}.")) from e
    except ValueError as e:  # a check of the role class that `checks` does not repeat
        raise ConfigError(f"{path}: {e}") from e


def build_nested(cls: type, raw: dict[str, Any], path: str) -> dict[str, Any]:
    """raw with each mapping given for a dataclass-typed field of `cls` (EngineConfig.kv_tiers:
    KVTiersConfig | None) built into that dataclass, checked and named `path.field.sub`."""
    hints, out = typing.get_type_hints(cls), dict(raw)
    for name, value in raw.items():
        if not isinstance(value, dict) or name not in hints:
            continue
        nested = [h for h in _members(hints[name]) if dataclasses.is_dataclass(h)]
        if len(nested) == 1:
            out[name] = build_section(nested[0], value, f"{path}.{name}", [])
    return out


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def engine_message(e: EngineConfigError, prefix: str) -> str:
    return f"{prefix}{e.field} {e.why} (got {e.value!r})"


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    """tree[a][b][c] = value for path "a.b.c", making the mappings on the way (copies of the
    ones there, so the caller's nested mappings are left as they were)."""
    *parents, leaf = path.split(".")
    node, walked = tree, []
    for key in parents:
        walked.append(key)
        child = node.get(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(walked)} must be a mapping of fields, got {child!r}")
        node[key] = node = dict(child)
    node[leaf] = value


def has_path(tree: dict[str, Any], path: str) -> bool:
    node: Any = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True
