"""EngineClient: drive a `python -m mimo_fn.serve` server (or an SGLang one) from another process.

One method per endpoint, named as Engine's methods where they overlap (generate, flush_cache,
abort); each is a line over `_call`, so an endpoint is one method more. A failed call raises
`ServerError` with the server's message ({"error": {"message": ...}}) and HTTP status.

    client = EngineClient("http://127.0.0.1:30000")
    out = client.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0})
    out["output_ids"], out["meta_info"]["finish_reason"]

A trainer drives it with the colocated-RL methods of mimo_fn.Engine, same names and keywords
(update_weights_from_tensor, release_memory_occupation, ...), so it moves between an in-process
engine and a server by one line:

    client.release_memory_occupation()                    # train meanwhile
    client.resume_memory_occupation()
    client.update_weights_from_tensor(named_tensors)      # [(hub name, tensor)] by handle: no bytes copied
    client.get_weight_version()                           # "1"
"""

from collections.abc import Mapping, Sequence
from typing import Any

from mimo_fn.rl.transfer import flatten, serialize

WEIGHT_UPDATE_GROUP = "weight_update_group"


class ServerError(RuntimeError):
    """A call the server answered with an error: its HTTP status and message."""

    def __init__(self, status_code: int, message: str, path: str):
        super().__init__(f"{path}: HTTP {status_code}: {message}")
        self.status_code, self.message, self.path = status_code, message, path


class EngineClient:
    def __init__(self, base_url: str = "http://127.0.0.1:30000", timeout: float | None = 600.0,
                 num_ranks: int | None = None):
        """num_ranks: the server's ranks (dp_size x tp_size), one serialised payload each in
        update_weights_from_tensor; None: asked from /get_server_info on first use."""
        import httpx  # the `serve` extra

        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self.num_ranks = num_ranks

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

    # ---- a trainer's (colocated RL): mimo_fn.Engine's names and keywords (SGLang's) ----
    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> None:
        """POST /update_weights_from_tensor: (hub name, tensor) pairs, or a dict, by handle (CUDA
        IPC for CUDA tensors, shared memory for CPU ones; mimo_fn.rl.transfer), one payload per
        server rank. load_format="flattened_bucket" packs them into one flat tensor first (many
        small tensors: one handle), or takes a bucket that mimo_fn.rl.transfer.flatten made.
        The tensors must stay unchanged until it returns; the server holds none afterwards."""
        if isinstance(named_tensors, Mapping) and not (load_format == "flattened_bucket"
                                                       and "flattened_tensor" in named_tensors):
            named_tensors = list(named_tensors.items())
        payload = named_tensors if isinstance(named_tensors, Mapping) else list(named_tensors)
        if load_format == "flattened_bucket" and not isinstance(named_tensors, Mapping):
            payload = flatten(payload)
        if self.num_ranks is None:
            info = self.get_server_info()
            self.num_ranks = int(info.get("dp_size", 1)) * int(info.get("tp_size", 1))
        strings = [serialize(payload) for _ in range(self.num_ranks)]  # each rank opens (and lets go of) its own
        self._call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": strings, "load_format": load_format, "flush_cache": flush_cache,
            "weight_version": weight_version})

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                 weight_version: str | None = None) -> None:
        """POST /update_weights_from_disk: every weight from a hub-layout checkpoint directory
        that the server can read (mimo_fn.save_checkpoint writes one)."""
        self._call("POST", "/update_weights_from_disk", {"model_path": str(model_path), "flush_cache": flush_cache,
                                                         "weight_version": weight_version})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = WEIGHT_UPDATE_GROUP, backend: str | None = None) -> None:
        """POST /init_weights_update_group: the server's ranks join the trainer's group as ranks
        rank_offset.. (the trainer is rank 0). It returns once the trainer has joined too: call
        it in a thread, and mimo_fn.rl.transfer.init_trainer_group meanwhile."""
        self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]],
                                        group_name: str = WEIGHT_UPDATE_GROUP, flush_cache: bool = True,
                                        weight_version: str | None = None) -> None:
        """POST /update_weights_from_distributed: the server receives one broadcast per name from
        rank 0 of the group (dtypes as torch dtypes or their names), and returns once it has
        them all and wrote them. So the trainer calls it in a thread and broadcasts meanwhile:

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                done = pool.submit(client.update_weights_from_distributed, names, dtypes, shapes)
                for t in tensors:                        # in the order of names
                    mimo_fn.rl.transfer.broadcast(group, t)
                done.result()                            # the server's error, if it refused them
        """
        self._call("POST", "/update_weights_from_distributed", {
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version})

    def destroy_weights_update_group(self, group_name: str = WEIGHT_UPDATE_GROUP) -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """POST /release_memory_occupation: tags "weights", "kv_cache", "cuda_graph" (None: all).
        Waits for the requests in flight; new ones wait until the resume."""
        self._call("POST", "/release_memory_occupation", {"tags": None if tags is None else list(tags)})

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._call("POST", "/resume_memory_occupation", {"tags": None if tags is None else list(tags)})

    def pause_generation(self) -> None:
        """POST /pause_generation: requests in flight end with finish_reason "abort"; new ones
        wait until continue_generation."""
        self._call("POST", "/pause_generation", {})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {})

    def get_weight_version(self) -> str:
        return self._call("GET", "/get_weight_version")["weight_version"]
