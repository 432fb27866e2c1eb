"""The endpoints a trainer drives (colocated RL), with SGLang's names and JSON fields.

    POST /update_weights_from_tensor      {"serialized_named_tensors": [one string per rank], "load_format":
                                           null | "flattened_bucket", "flush_cache": true, "weight_version": null}
    POST /update_weights_from_disk        {"model_path": DIR, ...}
    POST /init_weights_update_group       {"master_address", "master_port", "rank_offset", "world_size",
                                           "group_name": "weight_update_group", "backend": null}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", ...}
    POST /destroy_weights_update_group    {"group_name"}
    POST /release_memory_occupation       {"tags": null | ["weights", "kv_cache", "cuda_graph"]}
    POST /resume_memory_occupation        {"tags": ...}
    POST /pause_generation, /continue_generation
    GET  /get_weight_version              {"weight_version": "3"}

Each answers SGLang's {"success": true, "message": ...}; a call that fails is a 400 that also
carries {"success": false, "message": ...} and the server's usual {"error": {"message": ...}}
naming the field or tensor, and nothing changed. Updates and releases wait for the requests in
flight (at most `timeout` seconds, 60 by default; `abort_all_requests: true` aborts them
instead); commands.py says what runs when, mimo_fn.engine.rl_api what each call does on a rank.
"""

import base64
import binascii
import json
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator, model_validator

from mimo_fn.engine.rl_api import WEIGHT_UPDATE_GROUP, engine_tags, tensor_specs
from mimo_fn.rl.transfer import LOAD_FORMATS
from mimo_fn.serve.commands import Command
from mimo_fn.serve.context import ServerContext, error, read_json
from mimo_fn.serve.protocol import _Body, parse

DEFAULT_TIMEOUT_S = 60.0  # an update's or release's wait for the requests in flight


class _Update(_Body):
    flush_cache: bool = True
    weight_version: str | None = None
    abort_all_requests: bool = False
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0)

    def command(self, name: str, **kwargs) -> Command:
        return Command(name, {**kwargs, "flush_cache": self.flush_cache, "weight_version": self.weight_version},
                       self.timeout, self.abort_all_requests)


class UpdateFromTensorRequest(_Update):
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None

    @field_validator("load_format")
    @classmethod
    def _format(cls, v: str | None) -> str | None:
        if v not in LOAD_FORMATS:
            raise ValueError(f"load_format = {v!r}: expected one of {list(LOAD_FORMATS)}")
        return v

    @field_validator("serialized_named_tensors")
    @classmethod
    def _base64(cls, v: list[str]) -> list[str]:
        for i, s in enumerate(v):
            try:
                base64.b64decode(s, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"serialized_named_tensors[{i}]: not a base64 string (expected what "
                                 "mimo_fn.rl.transfer.serialize makes)") from None
        return v


class UpdateFromDiskRequest(_Update):
    model_path: str


class UpdateFromDistributedRequest(_Update):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = WEIGHT_UPDATE_GROUP

    @model_validator(mode="after")
    def _specs(self) -> "UpdateFromDistributedRequest":
        tensor_specs(self.names, self.dtypes, self.shapes)  # a ValueError naming the tensor
        return self


class InitGroupRequest(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = WEIGHT_UPDATE_GROUP
    backend: str | None = None


class GroupRequest(_Body):
    group_name: str = WEIGHT_UPDATE_GROUP


class MemoryRequest(_Body):
    tags: list[str] | None = None
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0)
    abort_all_requests: bool = False

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str] | None) -> list[str] | None:
        engine_tags(v, "tags")
        return v


class PauseRequest(_Body):
    NEUTRAL: ClassVar[dict] = {"mode": "abort"}  # SGLang's other modes keep requests: not supported


def failed(message: str) -> JSONResponse:
    """A 400 in both shapes a client may read: SGLang's {"success": false, "message"} and ours."""
    body = json.loads(error(400, message).body)
    return JSONResponse({"success": False, "message": message, **body}, status_code=400)


def add_rl_routes(app: FastAPI, ctx: ServerContext) -> None:
    world = ctx.args.dp_size * ctx.args.tp_size

    async def run(command: Command, done: str):
        try:
            version = await ctx.loop.command(command)
        except ValueError as e:
            return failed(str(e))
        return {"success": True, "message": done, "weight_version": version}

    async def body_of(request: Request, model):
        return parse(model, await read_json(request))

    def route(path: str):
        """A POST route whose ValueErrors (bad fields) answer failed()."""
        def wrap(handler):
            async def endpoint(request: Request):
                try:
                    return await handler(request)
                except ValueError as e:
                    return failed(str(e))
            app.post(path)(endpoint)
            return handler
        return wrap

    @route("/update_weights_from_tensor")
    async def update_from_tensor(request: Request):
        req = await body_of(request, UpdateFromTensorRequest)
        if len(req.serialized_named_tensors) != world:
            raise ValueError(f"serialized_named_tensors: {len(req.serialized_named_tensors)} strings; expected one "
                             f"per rank of this server ({world} = dp_size x tp_size, SGLang's tp_size), each made "
                             "by mimo_fn.rl.transfer.serialize")
        return await run(req.command("update_weights_from_tensor", serialized_named_tensors=req.serialized_named_tensors,
                                     load_format=req.load_format), "Succeeded to update model weights.")

    @route("/update_weights_from_disk")
    async def update_from_disk(request: Request):
        req = await body_of(request, UpdateFromDiskRequest)
        return await run(req.command("update_weights_from_disk", model_path=req.model_path),
                         f"Succeeded to update model weights from {req.model_path}.")

    @route("/init_weights_update_group")
    async def init_group(request: Request):
        req = await body_of(request, InitGroupRequest)
        return await run(Command("init_weights_update_group", req.model_dump()),
                         f"Joined {req.group_name!r} as ranks {req.rank_offset}..{req.rank_offset + world - 1}.")

    @route("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        req = await body_of(request, UpdateFromDistributedRequest)
        return await run(req.command("update_weights_from_distributed", names=req.names, dtypes=req.dtypes,
                                     shapes=req.shapes, group_name=req.group_name),
                         f"Succeeded to update {len(req.names)} weights by broadcast.")

    @route("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        req = await body_of(request, GroupRequest)
        return await run(Command("destroy_weights_update_group", {"group_name": req.group_name}),
                         f"Left {req.group_name!r}.")

    @route("/release_memory_occupation")
    async def release(request: Request):
        req = await body_of(request, MemoryRequest)
        return await run(Command("release_memory_occupation", {"tags": req.tags}, req.timeout, req.abort_all_requests),
                         "Memory released.")

    @route("/resume_memory_occupation")
    async def resume(request: Request):
        req = await body_of(request, MemoryRequest)
        return await run(Command("resume_memory_occupation", {"tags": req.tags}), "Memory resumed.")

    @route("/pause_generation")
    async def pause(request: Request):
        await body_of(request, PauseRequest)
        return await run(Command("pause_generation"), "Generation paused.")

    @route("/continue_generation")
    async def resume_generation(request: Request):
        await body_of(request, PauseRequest)
        return await run(Command("continue_generation"), "Generation continued.")

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": ctx.loop.weight_version}
