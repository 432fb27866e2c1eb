"""Request bodies of the SGLang-native and OpenAI-compatible APIs, validated with pydantic.

Every check that needs only the request lives here; `error_message` turns a ValidationError into
one line that names the field ("sampling_params.top_p: ..."), which the server answers with an
HTTP 400. Checks that need the model (ids inside the vocabulary) read `vocab_size` from the
validation context. Field names and defaults are SGLang's (`/generate`) and OpenAI's (`/v1/...`);
fields the engine has no use for are accepted only at their neutral value, so a client that asks
for a penalty or n > 1 hears that it is not supported instead of silently getting something else.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import (
    BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator,
)

# SGLang sampling_params fields accepted only at these values (the engine implements none of them)
NATIVE_NEUTRAL = {
    "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
    "n": 1, "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
    "custom_params": None, "stream_interval": None,
}
# /generate fields accepted only at these values
GENERATE_NEUTRAL = {"top_logprobs_num": 0, "token_ids_logprob": None, "return_hidden_states": False,
                    "lora_path": None, "image_data": None, "audio_data": None, "video_data": None, "input_embeds": None}
# OpenAI request fields accepted only at these values
OPENAI_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "logit_bias": None, "suffix": None, "tools": None, "response_format": None, "top_logprobs": 0}
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def error_message(e: ValidationError) -> str:
    """The first error as 'field: what is wrong (got ...)'; this module's own checks name the
    field in their message already."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err['input']!r:.80})"
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown field"
    return f"{loc or 'body'}: {err['msg']}{got}"


def parse(model: type[BaseModel], data: Any, where: str = "", context: dict | None = None) -> BaseModel:
    """model_validate, with a ValueError whose message names the field under `where`."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        msg = error_message(e)
        raise ValueError(f"{where}.{msg}" if where else msg) from None




def stop_strings(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"{field}: expected a string or a list of strings (got {value!r:.80})")
    if any(not s for s in stops):
        raise ValueError(f"{field}: an empty stop string would stop before the first token")
    return tuple(stops)


def token_ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ValueError(f"{field}: expected a list of token ids (ints) (got {value!r:.80})")
    return value


class _Body(BaseModel):
    """Strict types (no "1" for 1, no true for 1); a null field means its default; the fields of
    NEUTRAL are accepted at their neutral value only (and then dropped)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    NEUTRAL: ClassVar[dict] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            if key in cls.NEUTRAL and value is not None and value != cls.NEUTRAL[key]:
                raise ValueError(f"{key} = {value!r:.80}: not supported (only {cls.NEUTRAL[key]!r})")
        return {k: v for k, v in data.items() if v is not None and k not in cls.NEUTRAL}


@dataclass(frozen=True)
class Sampling:
    """One request's generation settings, as every API gives them to the server's loop."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    seed: int | None = None  # None: a fresh one per request when sampling
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def _check_top_k(v: int) -> int:
    if v == 0 or v < -1:
        raise ValueError(f"top_k = {v}: expected -1 (no limit) or a positive int")
    return v


class NativeSampling(_Body):
    """SGLang's sampling_params."""

    model_config = ConfigDict(strict=True, extra="forbid")
    NEUTRAL: ClassVar[dict] = NATIVE_NEUTRAL

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop: Any = ()
    stop_token_ids: list[int] = []
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for the seed
    ignore_eos: bool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return _check_top_k(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> tuple[str, ...]:
        return stop_strings(v, "stop")

    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k,
                        self.seed if self.seed is not None else self.sampling_seed, self.stop,
                        tuple(self.stop_token_ids), self.ignore_eos)


def check_vocab(prompts: list, field: str, info: ValidationInfo, batch: bool) -> None:
    vocab = (info.context or {}).get("vocab_size")
    for i, p in enumerate(prompts):
        if isinstance(p, list) and vocab is not None:
            bad = next((j for j, t in enumerate(p) if not 0 <= t < vocab), None)
            if bad is not None:
                where = f"{field}[{i}][{bad}]" if batch else f"{field}[{bad}]"
                raise ValueError(f"{where} = {p[bad]}: outside the vocabulary; expected a token id in [0, {vocab})")


def prompt_list(value: Any, field: str, text_ok: bool, ids_ok: bool) -> tuple[list, bool]:
    """(prompts, is_batch): one prompt (a string, or a list of token ids) or a non-empty list of them."""
    def one(p: Any, where: str):
        if text_ok and isinstance(p, str):
            if not p:
                raise ValueError(f"{where}: empty prompt")
            return p
        if ids_ok and isinstance(p, list) and (not p or type(p[0]) is int):
            if not p:
                raise ValueError(f"{where}: empty prompt")
            return token_ids(p, where)
        want = " or ".join(w for w, ok in (("a string", text_ok), ("a list of token ids", ids_ok)) if ok)
        raise ValueError(f"{where}: expected {want} (got {p!r:.80})")

    if isinstance(value, list) and value and not (ids_ok and type(value[0]) is int):
        return [one(p, f"{field}[{i}]") for i, p in enumerate(value)], True
    if isinstance(value, list) and not value:
        raise ValueError(f"{field}: empty prompt")
    return [one(value, field)], False


class GenerateRequest(_Body):
    """POST /generate (SGLang's GenerateReqInput, the fields this server implements)."""

    NEUTRAL: ClassVar[dict] = GENERATE_NEUTRAL
    text: Any = None  # a string or a list of them
    input_ids: Any = None  # a list of ids or a list of such lists
    sampling_params: Any = None  # one object for every prompt, or a list of one per prompt
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # >= 0: also the prompt's log-probs from there
    return_text_in_logprobs: bool = False  # each log-prob entry's third item: its token's text
    return_routed_experts: bool = False
    stream: bool = False
    rid: Any = None  # a string, or a list of one per prompt
    _parsed: Any = PrivateAttr(None)  # (prompts, is_batch, samplings, rids)

    @model_validator(mode="after")
    def _prompts(self, info: ValidationInfo) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text / input_ids: give exactly one of them")
        field = "text" if self.text is not None else "input_ids"
        prompts, batch = prompt_list(self.text if self.text is not None else self.input_ids, field,
                                     text_ok=field == "text", ids_ok=field == "input_ids")
        check_vocab(prompts, field, info, batch)
        sps = self.sampling_params
        if isinstance(sps, list):
            if len(sps) != len(prompts):
                raise ValueError(f"sampling_params: {len(sps)} of them for {len(prompts)} prompts; give one per "
                                 "prompt, or one object for all")
            samplings = [parse(NativeSampling, sp, f"sampling_params[{i}]").sampling() for i, sp in enumerate(sps)]
        elif sps is None or isinstance(sps, dict):
            samplings = [parse(NativeSampling, sps or {}, "sampling_params").sampling()] * len(prompts)
        else:
            raise ValueError(f"sampling_params: expected an object, or a list of one per prompt (got {sps!r:.80})")
        self._parsed = (prompts, batch, samplings, self._rids(len(prompts), batch))
        return self

    def _rids(self, n: int, batch: bool) -> list[str | None]:
        if self.rid is None:
            return [None] * n
        rids = self.rid if batch else [self.rid]
        if (not isinstance(rids, list) or len(rids) != n or len(set(rids)) != n
                or not all(isinstance(r, str) and r for r in rids)):
            want = f"a list of {n} distinct non-empty strings, one per prompt" if batch else "a non-empty string"
            raise ValueError(f"rid: expected {want} (got {self.rid!r:.80})")
        return rids

    @property
    def prompts(self) -> list:
        return self._parsed[0]

    @property
    def is_batch(self) -> bool:
        return self._parsed[1]

    @property
    def samplings(self) -> list[Sampling]:
        return self._parsed[2]

    @property
    def rids(self) -> list[str | None]:
        return self._parsed[3]


class AbortRequest(_Body):
    rid: str = ""  # SGLang: the request's rid
    abort_all: bool = False


class FlushRequest(_Body):
    timeout: float = Field(30.0, ge=0)  # seconds to wait for requests in flight


class _OpenAISampling(_Body):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1  # SGLang / vLLM extension
    stop: Any = ()
    stop_token_ids: list[int] = []  # extension
    seed: int | None = None
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}
    NEUTRAL: ClassVar[dict] = OPENAI_NEUTRAL

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return _check_top_k(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> tuple[str, ...]:
        return stop_strings(v, "stop")

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_tokens: int) -> Sampling:
        return Sampling(max_tokens, self.temperature, self.top_p, self.top_k, self.seed, self.stop,
                        tuple(self.stop_token_ids), self.ignore_eos)


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions."""

    prompt: Any = None  # a string, a list of strings, a list of token ids, or a list of such lists
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    _parsed: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _prompts(self, info: ValidationInfo) -> "CompletionRequest":
        if self.prompt is None:
            raise ValueError("prompt: required")
        prompts, batch = prompt_list(self.prompt, "prompt", text_ok=True, ids_ok=True)
        check_vocab(prompts, "prompt", info, batch)
        self._parsed = prompts
        return self

    @property
    def prompts(self) -> list:
        return self._parsed


class ChatRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: Any = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: Any) -> list[dict]:
        if not isinstance(v, list) or not v:
            raise ValueError("messages: expected a non-empty list of {role, content} objects")
        out = []
        for i, m in enumerate(v):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role: expected one of {CHAT_ROLES} (got {m!r:.80})")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ValueError(f"messages[{i}].content: only text parts ({{type: text, text: ...}}) are "
                                     "supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: expected a string (got {content!r:.80})")
            out.append({"role": m["role"], "content": content})
        return out

    @model_validator(mode="after")
    def _required(self) -> "ChatRequest":
        if self.messages is None:
            raise ValueError("messages: required")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
