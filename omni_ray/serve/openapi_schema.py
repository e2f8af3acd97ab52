"""The request bodies in /openapi.json: the routes read raw bytes (parsed off the event loop), so FastAPI knows none."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from omni_ray.serve.openai_protocol import ChatCompletionRequest, SpeechRequest

REF = "#/components/schemas/{model}"
MODELS = {"chat": ChatCompletionRequest, "speech": SpeechRequest}


def _body(model: type) -> dict[str, Any]:
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# each POST route's `openapi_extra`
REQUEST_BODIES: dict[str, dict[str, Any]] = {name: _body(model) for name, model in MODELS.items()}


def request_schemas() -> dict[str, Any]:
    """The request models' JSON schemas and every schema they refer to, keyed as components/schemas."""
    schemas: dict[str, Any] = {}
    for model in MODELS.values():
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def with_request_schemas(app: FastAPI) -> None:
    """`app.openapi()` with the request models' schemas among its components (made once, on first call)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
