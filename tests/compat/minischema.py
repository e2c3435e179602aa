"""A validator for the JSON-schema subset hmoe/compat/schema.json uses (type, enum, const,
properties, required, additionalProperties, items): jsonschema is not a test dependency."""
from __future__ import annotations

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
          "number": (int, float)}


def _is(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number" and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def errors(value, schema: dict, path: str = "$") -> list[str]:
    """Every way `value` breaks `schema`, as 'path: what' lines (empty when it conforms)."""
    out = []
    t = schema.get("type")
    if t is not None:
        names = [t] if isinstance(t, str) else t
        if not any(_is(value, n) for n in names):
            return [f"{path}: {value!r:.60} is not {'/'.join(names)}"]
    if "const" in schema and value != schema["const"]:
        out.append(f"{path}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                out.append(f"{path}: missing {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                out += errors(v, props[key], f"{path}.{key}")
            elif extra is False:
                out.append(f"{path}: unexpected {key!r}")
            elif isinstance(extra, dict):
                out += errors(v, extra, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += errors(v, schema["items"], f"{path}[{i}]")
    return out


KNOWN = {"$schema", "$id", "title", "description", "type", "enum", "const", "properties",
         "required", "additionalProperties", "items"}


def unknown_keywords(schema, path="$") -> list[str]:
    """Keywords this validator would silently ignore (the schema must not use any)."""
    out = []
    if isinstance(schema, dict):
        out += [f"{path}.{k}" for k in schema if k not in KNOWN]
        for k in ("properties",):
            for name, sub in schema.get(k, {}).items():
                out += unknown_keywords(sub, f"{path}.{name}")
        for k in ("items", "additionalProperties"):
            if isinstance(schema.get(k), dict):
                out += unknown_keywords(schema[k], f"{path}.{k}")
    return out
