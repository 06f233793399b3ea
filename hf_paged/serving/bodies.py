"""Request bodies, parsed and validated on a worker thread, never on the event loop: a body
of megabytes (a million token ids) takes the parser and pydantic most of a second, which
would hold up /health and every other client's stream. pydantic's errors become OpenAI 400s
that name the field, say what was expected and show what was given.

The endpoints take the raw `Request` and call `parse`; `document` puts the body models back
into the OpenAPI schema that FastAPI builds for /docs.
"""

from __future__ import annotations

import json
import re
import reprlib

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from ..errors import APIError

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 48
_short.maxlist = _short.maxdict = 4
_short.maxlevel = 2
# How pydantic names a union's member in an error's path (a model by its class name).
_TAG = re.compile(r"(str|int|float|bool|none|(list|dict|tuple|union|literal)\[.*\]|[A-Z]\w*)$")


def shown(value) -> str:
    """A short rendering of a client's value for an error message (JSON's names for the
    JSON types; long strings and lists cut)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return _short.repr(value)


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def validation_error(err, body=None) -> APIError:
    """pydantic's (or FastAPI's RequestValidationError's) first error as a 400 naming the
    top-level field (FastAPI's "body" left out of the path); a union's errors (one per
    member type) become one message listing the members."""
    errors = err.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc:
        if first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
            return APIError(400, f"The request body must be a JSON object; got "
                            f"{_json_type(first.get('input', body))}.")
        return APIError(400, first.get("msg", "invalid request body"))
    field = loc[0]
    members = [str(e["loc"][1]) for e in errors if len(e["loc"]) > 1
               and str(e["loc"][0]) == field and _TAG.match(str(e["loc"][1]))]
    if len(set(members)) > 1:  # a union: its members, and the value the field had
        value = body.get(field) if isinstance(body, dict) else first.get("input")
        expected = " or ".join(dict.fromkeys(members))
        return APIError(400, f"{field}: expected {expected}; got {shown(value)}.", field)
    if first.get("type") == "missing":
        return APIError(400, f"{'.'.join(loc)}: this field is required.", field)
    message = first.get("msg", "invalid value")
    if "input" in first:
        message += f"; got {shown(first['input'])}"
    return APIError(400, f"{'.'.join(loc)}: {message}.", field)


def _decoded(raw: bytes):
    """The JSON of a body (Python's parser, as FastAPI's: NaN and lone surrogates reach
    validation, which names their field) or a 400 saying why it is not JSON."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "The request body is not valid UTF-8.") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply to parse.") from None
    except ValueError as err:  # (JSONDecodeError; an integer of too many digits)
        raise APIError(400, f"The request body is not valid JSON: {err}.") from None


def validated(model: type[BaseModel], raw: bytes) -> BaseModel:
    body = _decoded(raw)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err, body) from None


async def parse(server, model: type[BaseModel], request: Request) -> BaseModel:
    """The request's body as `model`, parsed and validated on one of `server`'s workers."""
    return await server.off_loop(validated, model, await request.body())


def body_of(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose body `parse` reads as `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def document(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Adds the body models (and the models they use) to the app's OpenAPI components."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            parts = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                own = model.model_json_schema(ref_template="#/components/schemas/{model}")
                parts.update(own.pop("$defs", {}))
                parts[model.__name__] = own
        return app.openapi_schema

    app.openapi = openapi
