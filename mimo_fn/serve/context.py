"""What every HTTP handler shares (native and OpenAI alike): the server's context, JSON errors and
bodies, server-sent events, and the prompt and stop-id checks."""

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from mimo_fn.serve.args import ServerArgs
from mimo_fn.serve.generation import Generator, server_watches_disconnect, unless_disconnect
from mimo_fn.serve.loop import EngineError, EngineLoop
from mimo_fn.serve.protocol import Sampling
from mimo_fn.serve.tokenizer import TextTokenizer


@dataclass
class ServerContext:
    """What the handlers serve: the parsed flags, the loop, the tokenizer and the model's facts."""

    args: ServerArgs
    loop: EngineLoop
    tok: TextTokenizer
    vocab_size: int
    max_model_len: int  # tokens a request may reach (prompt + output)
    model_info: dict  # model_type, architectures, ...
    version: str = "0"

    def __post_init__(self) -> None:
        self.gen = Generator(self.loop, self.tok)
        self.created = int(time.time())


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    param = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"body: malformed JSON ({e})") from None


# json.dumps(x, ensure_ascii=False), without the encoder json.dumps builds per call for a non-default flag
to_json = json.JSONEncoder(ensure_ascii=False).encode


def event_stream(request: Request, payloads: AsyncIterator[dict | str]) -> StreamingResponse:
    """Server-sent events: `data: {json}` per payload (a str: its JSON already), then `data: [DONE]`.
    An engine failure mid-stream is an error event (the status went out already); a client that
    goes aborts it all."""
    async def body() -> AsyncIterator[str]:
        try:
            async for payload in payloads:
                yield f"data: {payload if isinstance(payload, str) else to_json(payload)}\n\n"
        except RuntimeError as e:
            code = 500 if isinstance(e, EngineError) else 503
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': code}})}\n\n"
        finally:  # closed early (the client went): its requests abort now, not when it is collected
            await payloads.aclose()
        yield "data: [DONE]\n\n"

    if server_watches_disconnect(request.scope):  # it cancels body() when the client goes: its requests abort
        return StreamingResponse(body(), media_type="text/event-stream")
    return StreamingResponse(unless_disconnect(request.receive, body()), media_type="text/event-stream")



def prompt_ids(ctx: ServerContext, prompt, field: str) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    ids = ctx.tok.encode(prompt)
    if not ids:
        raise ValueError(f"{field}: the prompt has no tokens")
    return ids


def check_stop_ids(ctx: ServerContext, sampling: Sampling, field: str) -> None:
    bad = [t for t in sampling.stop_token_ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise ValueError(f"{field}: {bad[0]} is outside the vocabulary; expected token ids in [0, {ctx.vocab_size})")
