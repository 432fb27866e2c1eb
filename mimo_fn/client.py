"""EngineClient: drive a `python -m mimo_fn.serve` server (or an SGLang one) from another process.

One method per endpoint, named as Engine's methods where they overlap (generate, flush_cache,
abort); each is a line over `_call`, so an endpoint is one method more. A failed call raises
`ServerError` with the server's message ({"error": {"message": ...}}) and HTTP status.

    client = EngineClient("http://127.0.0.1:30000")
    out = client.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0})
    out["output_ids"], out["meta_info"]["finish_reason"]
"""

from collections.abc import Sequence
from typing import Any


class ServerError(RuntimeError):
    """A call the server answered with an error: its HTTP status and message."""

    def __init__(self, status_code: int, message: str, path: str):
        super().__init__(f"{path}: HTTP {status_code}: {message}")
        self.status_code, self.message, self.path = status_code, message, path


class EngineClient:
    def __init__(self, base_url: str = "http://127.0.0.1:30000", timeout: float | None = 600.0):
        import httpx  # the `serve` extra

        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, json: Any = None, params: dict | None = None, ok=(200,)) -> Any:
        """One request; the decoded JSON answer (None for an empty body), or ServerError."""
        r = self._http.request(method, path, json=json, params=params)
        body = None
        if r.content:
            try:
                body = r.json()
            except ValueError:
                body = r.text
        if r.status_code not in ok:
            message = body.get("error", {}).get("message", str(body)) if isinstance(body, dict) else str(body)
            raise ServerError(r.status_code, message, path)
        return body

    # ---- Engine's names ----
    def generate(self, prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: dict | Sequence[dict] | None = None, *, return_logprob: bool = False,
                 logprob_start_len: int | None = None, return_routed_experts: bool = False,
                 rid: str | Sequence[str] | None = None) -> dict | list[dict]:
        """POST /generate. prompts: a text, a list of token ids, or a list of either (a batch: the
        answer is a list). sampling_params: SGLang's (temperature, top_p, top_k, max_new_tokens,
        stop, stop_token_ids, seed, ignore_eos), one for all or one per prompt."""
        is_text = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], str))
        body = {"text" if is_text else "input_ids": prompts if isinstance(prompts, str) else list(prompts),
                "return_logprob": return_logprob, "return_routed_experts": return_routed_experts}
        for key, value in (("sampling_params", sampling_params), ("logprob_start_len", logprob_start_len),
                           ("rid", rid)):
            if value is not None:
                body[key] = value
        return self._call("POST", "/generate", body)

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """POST /flush_cache: waits (at most timeout s) for requests in flight, then empties the
        prefix cache; False if they did not finish in time (nothing emptied)."""
        body = self._call("POST", "/flush_cache", {"timeout": timeout}, ok=(200, 400))
        if isinstance(body, dict) and body.get("success") is False and body.get("error", {}).get("type") == "timeout":
            return False
        if not (isinstance(body, dict) and body.get("success")):
            raise ServerError(400, str(body), "/flush_cache")
        return True

    def abort(self, rid: str) -> bool:
        """POST /abort_request: whether a request with that rid was in flight."""
        return bool(self._call("POST", "/abort_request", {"rid": rid})["success"])

    # ---- the server's own ----
    def health(self) -> bool:
        """GET /health: True once the server has warmed up (503 before: False)."""
        return self._http.get("/health").status_code == 200

    def health_generate(self) -> bool:
        return self._http.get("/health_generate").status_code == 200

    def get_server_info(self) -> dict:
        return self._call("GET", "/get_server_info")

    def get_model_info(self) -> dict:
        return self._call("GET", "/get_model_info")

    def get_load(self) -> list[dict]:
        return self._call("GET", "/get_load")
