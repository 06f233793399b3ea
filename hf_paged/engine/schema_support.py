"""Which JSON Schema rules the grammar engine enforces, so that a schema whose rules it
would skip is refused instead of served as if it held.

xgrammar compiles a schema with rules it does not enforce without a word, and the outputs
then break them (measured on xgrammar 0.2.9, each rule with a value that breaks it and one
that keeps it):

- assertion keywords it ignores: `uniqueItems`, `contains` / `minContains` /
  `maxContains`, `not`, `if` / `then` / `else`, `dependentRequired`, `dependentSchemas`,
  `dependencies`, `$dynamicRef`, `$recursiveRef`;
- `allOf` of more than one schema, and `allOf` / `anyOf` / `oneOf` / `$ref` next to other
  rules of the same schema (only `type` beside `anyOf` / `oneOf` holds);
- `multipleOf` other than an integer's integer step;
- a number's bounds or a string's length or pattern in a schema without that `type`;
- a string's length beside a `pattern` or `format`;
- `required` names that `properties` does not list;
- `type` beside an `enum` or `const` value of another type (the value is served).

It also serves invalid schemas as if they were valid: an empty `anyOf` / `oneOf` / `allOf`
(which no value matches) ends at once, `"type": []` takes any value, and a negative
`maxLength` is read as no bound. Those are refused as invalid.

`oneOf` is enforced as `anyOf` (a value matching two of its schemas passes). Annotations
and keywords JSON Schema does not define are ignored, as the specification says.
"""

from __future__ import annotations

_IGNORED = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
            "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef",
            "$recursiveRef")
_NUMBER = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING = ("minLength", "maxLength", "pattern")
_RULES = {"type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "format", "items",
          "prefixItems", "minItems", "maxItems", "unevaluatedItems", "properties", "required",
          "additionalProperties", "patternProperties", "propertyNames", "minProperties",
          "maxProperties", "unevaluatedProperties", *_NUMBER, *_STRING}  # (the enforced ones)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMAS = ("additionalProperties", "propertyNames", "items", "unevaluatedItems",
            "unevaluatedProperties")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def refusal(schema) -> str | None:
    """Why the grammar engine must not serve `schema` (parsed JSON), or None."""
    return _node(schema, "the root")


def _node(schema, where: str) -> str | None:
    if not isinstance(schema, dict):
        return None  # true / false (and malformed parts, which the compiler refuses)
    reason = _invalid(schema)
    if reason is not None:
        return f"invalid schema at {where}: {reason}"
    reason = _own(schema)
    if reason is not None:
        return f"{reason} (at {where}); the grammar engine would serve it unchecked"
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                reason = reason or _node(child, f"{where} > {key} > {name}")
    for key in _SCHEMAS:
        reason = reason or _node(schema.get(key), f"{where} > {key}")
    for key in _SCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                reason = reason or _node(child, f"{where} > {key}[{i}]")
    return reason


def _is_a(value, kind) -> bool:
    """Whether a JSON value is of JSON Schema type `kind`."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    python = {"string": str, "number": (int, float), "boolean": bool, "null": type(None),
              "object": dict, "array": list}.get(kind)
    return python is not None and isinstance(value, python) and not (
        kind == "number" and isinstance(value, bool))


def _invalid(schema: dict) -> str | None:
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key) == []:
            return f"{key!r} must list at least one schema, got []"
    if schema.get("type") == []:
        return "'type' must name at least one type, got []"
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
            return f"{key!r} must be a non-negative integer, got {value!r}"
    return None


def _own(schema: dict) -> str | None:
    """The first rule of this schema itself (not its subschemas) left unenforced."""
    for key in _IGNORED:
        if key in schema:
            return f"{key!r} is not enforced"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems' is not enforced"
    rules = _RULES.intersection(schema)
    combined = [k for k in ("allOf", "anyOf", "oneOf", "$ref") if k in schema]
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "'allOf' of more than one schema is not enforced"
    for key in combined:
        beside = sorted(rules - {key} - ({"type"} if key in ("anyOf", "oneOf") else set()))
        if beside:
            return f"{key!r} beside {beside} in one schema is not enforced (nest them)"
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values is not None and "type" in schema and not all(
            any(_is_a(value, kind) for kind in types) for value in values):
        return "'type' beside an 'enum' or 'const' value of another type is not enforced"
    step = schema.get("multipleOf")
    if step is not None and (types != {"integer"} or isinstance(step, bool)
                             or not isinstance(step, int)):
        return "'multipleOf' other than an integer's integer step is not enforced"
    if any(k in schema for k in _NUMBER) and not types & {"integer", "number"}:
        return "a number's bounds need 'type': 'integer' or 'number' to be enforced"
    if any(k in schema for k in _STRING) and "string" not in types:
        return "a string's length or pattern needs 'type': 'string' to be enforced"
    if ("minLength" in schema or "maxLength" in schema) and (
            "pattern" in schema or "format" in schema):
        return "a string's length beside a 'pattern' or 'format' is not enforced"
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list) and required:
        listed = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in listed]
        if missing:
            return f"'required' names {missing} that 'properties' does not list"
    return None
