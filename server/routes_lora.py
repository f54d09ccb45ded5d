"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes, behind the API key):
LoRA adapters served as models at run time.

Bodies: `{"lora_name": NAME, "lora_path": DIR}` (a PEFT directory on the server's file system) and
`{"lora_name": NAME}`. A path that is not a servable adapter is a 400, unloading an unknown name a
404. Requests already queued with an unloaded adapter finish with it.
"""

from __future__ import annotations

from aiohttp import web

from jaxserve.engine_client import UnknownAdapterError
from server.errors import APIError, bad_request, not_found
from server.protocol import check_fields, read_json_object, require_str
from server.state import STATE

LOAD_FIELDS = frozenset({"lora_name", "lora_path"})
UNLOAD_FIELDS = frozenset({"lora_name"})
routes = web.RouteTableDef()


def _name(body: dict) -> str:
    name = require_str(body, "lora_name")
    if not name:
        raise bad_request("lora_name is required", param="lora_name")
    return name


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request)
    check_fields(body, LOAD_FIELDS)
    name, path = _name(body), require_str(body, "lora_path")
    if not path:
        raise bad_request("lora_path is required", param="lora_path")
    if name == state.info.name:
        raise bad_request(f"{name!r} is the base model's name", param="lora_name")
    if name in state.adapters and state.adapters[name] != path:
        raise bad_request(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
    if not state.engine.is_alive:
        raise APIError(503, "the engine is not running", code="engine_unavailable")
    try:
        await state.engine.load_lora_adapter(name, path)
    except ValueError as e:
        raise bad_request(str(e), param="lora_path") from None
    state.adapters[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request)
    check_fields(body, UNLOAD_FIELDS)
    name = _name(body)
    if name not in state.adapters:
        raise not_found(f"no LoRA adapter named {name!r} is loaded", code="model_not_found")
    try:
        await state.engine.unload_lora_adapter(name)
    except UnknownAdapterError as e:
        raise not_found(str(e), code="model_not_found") from None
    del state.adapters[name]
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
