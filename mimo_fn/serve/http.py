"""The FastAPI app: errors as JSON, SGLang's native endpoints (/generate, /health, /flush_cache, ...).

Names and JSON fields are SGLang's, so its clients (and sglang-router in front of several servers)
work unchanged; the OpenAI-compatible endpoints are in openai_api.py, a trainer's (weight sync,
memory release) in rl_api.py. Every handler validates
(protocol.py), hands requests to the loop through `Generator` and formats what comes back; a bad
request is a 400 with {"error": {"message": ...}} naming the field, never a stack trace.
"""

import asyncio
import base64
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mimo_fn.serve.context import (  # noqa: F401 (ServerContext: launch builds the app from it)
    ServerContext, check_stop_ids, error, event_stream, prompt_ids, read_json, to_json,
)
from mimo_fn.serve.generation import Ask, ClientGone, Progress, finish_all, merged, or_disconnect
from mimo_fn.serve.loop import EngineError
from mimo_fn.serve.openai_api import add_openai_routes
from mimo_fn.serve.protocol import AbortRequest, FlushRequest, GenerateRequest, Sampling, parse
from mimo_fn.serve.rl_api import add_rl_routes

log = logging.getLogger("mimo_fn.serve")
HEALTH_GENERATE_TIMEOUT_S = 60.0


def create_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.loop.start(asyncio.get_running_loop())
        yield
        ctx.loop.stop()

    app = FastAPI(title="mimo_fn", lifespan=lifespan)
    app.state.ctx = ctx
    _errors(app)
    _native(app, ctx)
    add_openai_routes(app, ctx)
    add_rl_routes(app, ctx)
    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ValueError)
    async def bad_request(request: Request, exc: ValueError):
        return error(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):  # FastAPI's 422, as the 400 of the rest
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if p != "body")
        return error(400, f"{loc or 'body'}: {err['msg']}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http_error")

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError):  # a pass failed; the server goes on
        return error(500, str(exc), "internal_error")

    @app.exception_handler(RuntimeError)
    async def unavailable(request: Request, exc: RuntimeError):  # the engine loop stopped (failed, shutting down)
        return error(503, str(exc), "service_unavailable")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


def native_result(ctx: ServerContext, p: Progress, req: GenerateRequest) -> dict:
    """SGLang's /generate answer for one prompt (cumulative, also for each stream chunk)."""
    return {"text": p.text, "output_ids": list(p.output_ids), "meta_info": native_meta(ctx, p, req)}


class GrowingIds:
    """json.dumps of one stream's output_ids, which only grow from chunk to chunk: the ids sent
    before are kept encoded and only the new ones are (a stream of n tokens encodes n ids, not
    n * n / 2; at 64 streams of 256 tokens the whole list was ~1 ms of each step's host work)."""

    def __init__(self):
        self.count, self.body = 0, ""

    def encode(self, ids: list[int]) -> str:
        if len(ids) < self.count:  # never for output_ids; exact anyway
            return json.dumps(ids)
        if len(ids) > self.count:
            new = ", ".join([str(int(t)) for t in ids[self.count:]])  # json.dumps' ints and separator
            self.body = f"{self.body}, {new}" if self.count else new
            self.count = len(ids)
        return f"[{self.body}]"


def native_chunk(ctx: ServerContext, p: Progress, req: GenerateRequest, ids: GrowingIds, index: int | None) -> str:
    """json.dumps(native_result(...) | {"index": index}, ensure_ascii=False) (no index: None), its
    output_ids encoded by `ids`."""
    text, meta = to_json(p.text), to_json(native_meta(ctx, p, req))
    tail = "}" if index is None else f', "index": {int(index)}}}'
    return f'{{"text": {text}, "output_ids": {ids.encode(p.output_ids)}, "meta_info": {meta}{tail}'


def native_meta(ctx: ServerContext, p: Progress, req: GenerateRequest) -> dict:
    """native_result's meta_info."""
    meta = {"id": p.rid, "finish_reason": p.finish, "prompt_tokens": len(p.prompt),
            "completion_tokens": len(p.output_ids), "cached_tokens": 0, "e2e_latency": p.latency}

    def text_of(t: int) -> str | None:
        return ctx.tok.token_text(t) if req.return_text_in_logprobs else None

    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(p.logprobs, p.output_ids)]
        if req.logprob_start_len >= 0 and p.prompt_logprobs is not None:  # the first token has none
            lps = [None, *p.prompt_logprobs]
            meta["input_token_logprobs"] = [[lps[i], p.prompt[i], text_of(p.prompt[i])]
                                            for i in range(req.logprob_start_len, len(p.prompt))]
    if req.return_routed_experts and p.routed_experts is not None:  # int32 bytes, base64, as SGLang sends them
        meta["routed_experts"] = base64.b64encode(p.routed_experts.to("cpu").int().contiguous().numpy().tobytes()
                                                  ).decode()
    return meta


def _native(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        req = parse(GenerateRequest, await read_json(request), context={"vocab_size": ctx.vocab_size})
        field = "text" if req.text is not None else "input_ids"
        asks = []
        for i, (prompt, sampling, rid) in enumerate(zip(req.prompts, req.samplings, req.rids)):
            where = f"{field}[{i}]" if req.is_batch else field
            check_stop_ids(ctx, sampling, f"sampling_params{f'[{i}]' if req.is_batch else ''}.stop_token_ids")
            asks.append(Ask(prompt_ids(ctx, prompt, where), sampling, req.return_logprob,
                            req.return_routed_experts, rid))
        runs = await or_disconnect(request.receive, ctx.gen.start_all(asks, field))
        if req.stream:
            batch = req.is_batch  # a pydantic private attribute: slow to read per chunk

            async def chunks():  # each chunk JSON already (event_stream sends a str as it is)
                ids = [GrowingIds() for _ in runs]
                async for i, p in merged(runs):
                    yield native_chunk(ctx, p, req, ids[i], i if batch else None)
            return event_stream(request, chunks())
        results = await or_disconnect(request.receive, finish_all(runs))
        outs = [native_result(ctx, p, req) for p in results]
        return outs if req.is_batch else outs[0]

    @app.get("/health")
    async def health():
        if ctx.loop.failed is not None:
            return error(503, f"the engine failed: {ctx.loop.failed}", "service_unavailable")
        if not ctx.loop.ready.is_set():
            return error(503, "warming up", "service_unavailable")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        if not ctx.loop.ready.is_set() or ctx.loop.failed is not None:
            return await health()
        ask = Ask([0], Sampling(max_new_tokens=1, temperature=0.0, ignore_eos=True), rid=None)
        try:
            runs = await ctx.gen.start_all([ask], "health_generate")
            await asyncio.wait_for(finish_all(runs), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error(503, f"a 1-token generate took over {HEALTH_GENERATE_TIMEOUT_S:.0f} s", "service_unavailable")
        return Response(status_code=200)

    def model_info() -> dict:
        return {"model_path": ctx.args.model_path or ctx.args.model_name,
                "tokenizer_path": ctx.args.tokenizer_path or ctx.args.model_path,
                "served_model_name": ctx.args.model_name, "is_generation": True,
                "max_context_length": ctx.max_model_len, "vocab_size": ctx.vocab_size,
                "eos_token_ids": list(ctx.tok.eos_token_ids), "preferred_sampling_params": None, **ctx.model_info}

    async def server_info() -> dict:
        info = await ctx.loop.info()
        return {**ctx.args.to_dict(), "served_model_name": ctx.args.model_name, "version": ctx.version,
                "max_total_num_tokens": info.get("max_total_num_tokens"), **info,
                "internal_states": [info], "ready": ctx.loop.ready.is_set(), "num_requests_total": ctx.gen.num_requests,
                "weight_version": ctx.loop.weight_version}

    # sglang-router asks a worker for /model_info and /server_info; SGLang serves both names
    app.get("/get_model_info")(model_info)
    app.get("/model_info")(model_info)
    app.get("/get_server_info")(server_info)
    app.get("/server_info")(server_info)

    @app.get("/get_load")
    async def get_load():
        info = await ctx.loop.info()
        return [{"dp_rank": g, "num_reqs": i["num_running_reqs"] + i["num_waiting_reqs"],
                 "num_waiting_reqs": i["num_waiting_reqs"], "num_tokens": i["num_used_pages"] * i["page_size"]}
                for g, i in enumerate(info.get("dp_groups", [info]))]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        body = await read_json(request)
        if isinstance(body, dict) and "timeout" not in body and "timeout" in request.query_params:
            try:
                body = {**body, "timeout": float(request.query_params["timeout"])}
            except ValueError:
                raise ValueError(f"timeout: expected a number of seconds (got {request.query_params['timeout']!r})")
        req = parse(FlushRequest, body)
        if await ctx.loop.flush(req.timeout):
            return {"success": True, "message": "Cache flushed."}
        return JSONResponse({"success": False, "error": {
            "message": f"flush_cache: requests still in flight after {req.timeout:g} s; nothing was flushed",
            "type": "timeout", "param": None, "code": 400}}, status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = parse(AbortRequest, await read_json(request))
        if not req.rid and not req.abort_all:
            raise ValueError("rid: give the rid of a request in flight (or abort_all: true)")
        return {"success": ctx.gen.abort(None if req.abort_all else req.rid)}


