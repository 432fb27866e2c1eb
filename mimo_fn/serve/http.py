"""The FastAPI app: errors as JSON, SGLang's native endpoints (/generate, /health, /flush_cache, ...).

Names and JSON fields are SGLang's, so its clients (and sglang-router in front of several servers)
work unchanged; the OpenAI-compatible endpoints are in openai_api.py, a trainer's (weight sync,
memory release) in rl_api.py. Every handler validates
(protocol.py), hands requests to the loop through `Generator` and formats what comes back; a bad
request is a 400 with {"error": {"message": ...}} naming the field, never a stack trace.
"""

import asyncio
import base64
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

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
from mimo_fn.serve.stream_json import GrowingList, KeptJson, ints_json

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


def native_meta(ctx: ServerContext, p: Progress, req: GenerateRequest) -> dict:
    """native_result's meta_info (native_chunk writes the same, key for key)."""
    meta = _meta_head(p)
    if req.return_logprob:
        meta["output_token_logprobs"] = _output_logprobs(ctx, p, req, 0, _num_output_logprobs(p))
        if _has_input_logprobs(p, req):
            meta["input_token_logprobs"] = _input_logprobs(ctx, p, req)
    routed = _routed_experts(p, req)
    if routed is not None:
        meta["routed_experts"] = routed
    return meta


@dataclass
class NativeStream:
    """What one /generate stream keeps encoded from chunk to chunk (stream_json.py)."""

    output_ids: GrowingList = field(default_factory=lambda: GrowingList(ints_json))
    output_logprobs: GrowingList = field(default_factory=GrowingList)
    input_logprobs: KeptJson = field(default_factory=KeptJson)


def native_chunk(ctx: ServerContext, p: Progress, req: GenerateRequest, s: NativeStream, index: int | None) -> str:
    """json.dumps(native_result(...) | {"index": index}, ensure_ascii=False) (no index: None), with
    what only grows kept encoded in `s`: at 64 streams of 256 tokens with log-probs, re-encoding the
    whole answer every chunk was 5.5 ms of each step's host work (10 ms with their texts, the tiny
    tokenizer's; a real one decodes slower), 0.7 ms so."""
    ids = s.output_ids.encode(len(p.output_ids), lambda a, b: p.output_ids[a:b])
    more = []  # meta_info's keys after the head's, in native_meta's order
    if req.return_logprob:
        lps = s.output_logprobs.encode(_num_output_logprobs(p), lambda a, b: _output_logprobs(ctx, p, req, a, b))
        more.append(f', "output_token_logprobs": {lps}')
        if _has_input_logprobs(p, req):  # fixed once the prompt is scored; a new length: encoded again
            lps = s.input_logprobs.encode(len(p.prompt_logprobs), lambda: _input_logprobs(ctx, p, req))
            more.append(f', "input_token_logprobs": {lps}')
    routed = _routed_experts(p, req)  # whole each chunk: it comes at the finish only (generation.py), one chunk
    if routed is not None:
        more.append(f', "routed_experts": {to_json(routed)}')
    meta = to_json(_meta_head(p))
    if more:
        meta = f'{meta[:-1]}{"".join(more)}}}'
    tail = "}" if index is None else f', "index": {int(index)}}}'
    return f'{{"text": {to_json(p.text)}, "output_ids": {ids}, "meta_info": {meta}{tail}'


def _meta_head(p: Progress) -> dict:
    return {"id": p.rid, "finish_reason": p.finish, "prompt_tokens": len(p.prompt),
            "completion_tokens": len(p.output_ids), "cached_tokens": 0, "e2e_latency": p.latency}


def _text_of(ctx: ServerContext, req: GenerateRequest, t: int) -> str | None:
    return ctx.tok.token_text(t) if req.return_text_in_logprobs else None


def _num_output_logprobs(p: Progress) -> int:
    return min(len(p.logprobs), len(p.output_ids))


def _output_logprobs(ctx: ServerContext, p: Progress, req: GenerateRequest, a: int, b: int) -> list:
    """output_token_logprobs[a:b]: [logprob, token id, its text or None] each."""
    return [[lp, t, _text_of(ctx, req, t)] for lp, t in zip(p.logprobs[a:b], p.output_ids[a:b])]


def _has_input_logprobs(p: Progress, req: GenerateRequest) -> bool:
    return req.logprob_start_len >= 0 and p.prompt_logprobs is not None


def _input_logprobs(ctx: ServerContext, p: Progress, req: GenerateRequest) -> list:
    lps = [None, *p.prompt_logprobs]  # the first token has none
    return [[lps[i], p.prompt[i], _text_of(ctx, req, p.prompt[i])]
            for i in range(req.logprob_start_len, len(p.prompt))]


def _routed_experts(p: Progress, req: GenerateRequest) -> str | None:
    if not req.return_routed_experts or p.routed_experts is None:
        return None
    # int32 bytes, base64, as SGLang sends them
    return base64.b64encode(p.routed_experts.to("cpu").int().contiguous().numpy().tobytes()).decode()


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
                streams = [NativeStream() for _ in runs]
                async for i, p in merged(runs):
                    yield native_chunk(ctx, p, req, streams[i], i if batch else None)
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


