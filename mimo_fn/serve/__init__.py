"""The HTTP server: `python -m mimo_fn.serve` (SGLang-native and OpenAI-compatible endpoints).

Importing this package loads nothing of the server (FastAPI, uvicorn, tokenizers): only starting
it needs the `serve` extra. Modules: args (flags), launch (mesh, memory plan, weights, engine),
loop (the thread that owns the engine), generation (one request's tokens to text), protocol
(request bodies), tokenizer, http (the app, native endpoints), openai_api (/v1 endpoints); and
process (launch_server: the server as a child process, for tests, scripts and trainers).
"""
