"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Same loop and same text as /generate (generation.py); only the JSON differs. A completion's
`logprobs` (an int) gives each token's text, log-prob and offset in the text; the engine keeps no
alternatives, so `top_logprobs` is null.
"""

import time
import uuid

from fastapi import FastAPI, Request

from mimo_fn.serve.generation import Ask, Progress, finish_all, merged, or_disconnect
from mimo_fn.serve.context import ServerContext, check_stop_ids, event_stream, prompt_ids, read_json
from mimo_fn.serve.protocol import ChatRequest, CompletionRequest, parse

DEFAULT_CHAT_MAX_TOKENS = 4096  # a chat without max_tokens: at most this, or what the context has room for


def usage(progress: list[Progress]) -> dict:
    prompt = sum(len(p.prompt) for p in progress)
    completion = sum(len(p.output_ids) for p in progress)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(ctx: ServerContext, p: Progress, start: int = 0, at: int | None = None) -> dict:
    """OpenAI's legacy logprobs object for output tokens start.. (text_offset: where each begins in
    the completion's text). at: where token `start` begins, when the caller kept it from the chunk
    before (a stream then decodes each token once, not every token every chunk)."""
    if at is None:
        at = sum(len(ctx.tok.token_text(t)) for t in p.output_ids[:start])
    tokens = [ctx.tok.token_text(t) for t in p.output_ids[start:]]
    offsets = []
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": p.logprobs[start:], "text_offset": offsets, "top_logprobs": None}


def chat_logprobs(ctx: ServerContext, p: Progress, start: int = 0) -> dict:
    content = []
    for t, lp in zip(p.output_ids[start:], p.logprobs[start:]):
        text = ctx.tok.token_text(t)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    def header(kind: str, prefix: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": ctx.args.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.args.model_name, "object": "model", "created": ctx.created,
                                            "owned_by": "mimo_fn", "root": ctx.args.model_path or ctx.args.model_name,
                                            "max_model_len": ctx.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request), context={"vocab_size": ctx.vocab_size})
        sampling = req.sampling(req.max_tokens)
        check_stop_ids(ctx, sampling, "stop_token_ids")
        many = len(req.prompts) > 1
        asks = [Ask(prompt_ids(ctx, prompt, f"prompt[{i}]" if many else "prompt"), sampling, req.logprobs is not None)
                for i, prompt in enumerate(req.prompts)]
        runs = await or_disconnect(request.receive, ctx.gen.start_all(asks, "prompt"))
        head = header("text_completion", "cmpl")
        if req.stream:
            async def chunks():
                sent = [0] * len(runs)  # output tokens whose log-probs went out
                at = [0] * len(runs)  # where the next of them begins in the text
                finals = {}
                async for i, p in merged(runs):
                    choice = {"index": i, "text": p.new_text, "logprobs": None, "finish_reason": p.finish_reason}
                    if req.logprobs is not None:
                        lp = choice["logprobs"] = completion_logprobs(ctx, p, sent[i], at[i])
                        sent[i], at[i] = len(p.output_ids), at[i] + sum(map(len, lp["tokens"]))
                    if p.finish is not None:
                        finals[i] = p
                    yield {**head, "choices": [choice]}
                if req.include_usage:
                    yield {**head, "choices": [], "usage": usage(list(finals.values()))}
            return event_stream(request, chunks())
        done = await or_disconnect(request.receive, finish_all(runs))
        choices = [{"index": i, "text": p.text, "finish_reason": p.finish_reason,
                    "logprobs": completion_logprobs(ctx, p) if req.logprobs is not None else None}
                   for i, p in enumerate(done)]
        return {**head, "choices": choices, "usage": usage(done)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await read_json(request))
        prompt = prompt_ids(ctx, ctx.tok.chat_prompt(req.messages), "messages")
        room = ctx.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(f"messages: the chat is {len(prompt)} tokens; the context holds {ctx.max_model_len}")
        sampling = req.sampling(req.limit or min(room, DEFAULT_CHAT_MAX_TOKENS))
        check_stop_ids(ctx, sampling, "stop_token_ids")
        runs = await or_disconnect(request.receive, ctx.gen.start_all([Ask(prompt, sampling, req.logprobs)],
                                                                      "messages"))
        head = header("chat.completion", "chatcmpl")
        if req.stream:
            head = {**head, "object": "chat.completion.chunk"}

            async def chunks():
                yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
                sent, final = 0, None
                async for _, p in merged(runs):
                    choice = {"index": 0, "delta": {"content": p.new_text} if p.new_text else {},
                              "logprobs": chat_logprobs(ctx, p, sent) if req.logprobs else None,
                              "finish_reason": p.finish_reason}
                    sent = len(p.output_ids)
                    final = p if p.finish is not None else final
                    yield {**head, "choices": [choice]}
                if req.include_usage and final is not None:
                    yield {**head, "choices": [], "usage": usage([final])}
            return event_stream(request, chunks())
        (p,) = await or_disconnect(request.receive, finish_all(runs))
        return {**head, "choices": [{"index": 0, "message": {"role": "assistant", "content": p.text},
                                     "logprobs": chat_logprobs(ctx, p) if req.logprobs else None,
                                     "finish_reason": p.finish_reason}], "usage": usage([p])}
