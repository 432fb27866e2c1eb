"""ServerArgs: the flags of `python -m mimo_fn.serve`, spelled as SGLang's launch_server spells them.

This module imports nothing of torch, Triton or FastAPI itself, so the flags are read (and
`--triton-cache-dir` set) before any kernel can compile.
"""

import argparse
import json
from dataclasses import asdict, dataclass, fields

from mimo_fn.cli_help import HelpFormatter

QUANTIZATIONS = ("fp8", "mxfp4")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "bfloat16", "float16", "float32")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# --speculative-algorithm: SGLang's names, and the proposer each builds (mimo_fn.speculative.build)
SPEC_ALGORITHMS = {"NGRAM": "ngram", "DFLASH": "dflash", "NEXTN": "mtp", "MTP": "mtp"}
EP_DISPATCH_ALGORITHMS = ("static", "fake")  # fake: benchmark-only balanced routing (layers.moe.balanced_routing)
TINY_MODEL_NAME = "mimo-fn-tiny-random"  # what /v1/models calls the embedded tiny model


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # hub-layout checkpoint dir; None: the embedded tiny random model
    tokenizer_path: str | None = None  # default: model_path
    host: str = "127.0.0.1"
    port: int = 30000
    dp_size: int = 1  # DP attention groups
    tp_size: int = 1  # attention tensor-parallel ranks per DP group
    ep_size: int = 1  # expert-parallel ranks (across all of them)
    # prefill tokens per pass and DP group (EngineConfig.chunk_size); -1: as large as the pool
    chunked_prefill_size: int = 16384
    max_total_tokens: int | None = None  # tokens of the KV pool; None: what the device's free memory holds
    max_running_requests: int = 256  # EngineConfig.max_batch
    page_size: int | None = None  # tokens per KV page; None: mimo_fn.cache.DEFAULT_PAGE_SIZE
    quantization: str | None = None  # "fp8" GEMM weights, "mxfp4" routed experts (+ FP8 others)
    speculative_num_draft_tokens: int = 0  # drafts verified per decode step; 0: off (or the algorithm's default)
    speculative_algorithm: str | None = None  # SPEC_ALGORITHMS; None: NGRAM where draft tokens are asked for
    speculative_draft_model_path: str | None = None  # DFLASH: the draft dir; NEXTN: the MTP layers' (default model_path)
    speculative_min_confidence: float = 0.0  # DFLASH / NEXTN: a confidence cut (EngineConfig.draft_min_confidence)
    ep_dispatch_algorithm: str = "static"  # "fake": every expert gets the same tokens (benchmarks, as SGLang's)
    enable_prefix_caching: bool = False  # keep finished requests' K/V for later prompts (EngineConfig.prefix_cache)
    enable_memory_saver: bool = False  # CUDA VMM release / resume at the same addresses
    enable_weights_cpu_backup: bool = False  # a release keeps the weights' bytes on the host (EngineConfig)
    enable_deterministic_inference: bool = False  # batch-invariant kernels (EngineConfig.deterministic)
    skip_warmup: bool = False  # report healthy without compiling / capturing first
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    json_model_override_args: str = "{}"  # JSON applied to config.json before the model is built
    random_seed: int = 0  # seed of dummy / tiny weights
    dummy_quiet_layers: float = 1.0  # random weights' layer outputs divided by this (params.quiet_layers)
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on the CPU
    device: str | None = None  # default: cuda when available
    served_model_name: str | None = None  # the name /v1/models gives; default: model_path
    triton_cache_dir: str | None = None  # TRITON_CACHE_DIR, set before any kernel compiles
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name, low in (("port", 1), ("dp_size", 1), ("tp_size", 1), ("ep_size", 1), ("max_running_requests", 1),
                          ("speculative_num_draft_tokens", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} = {getattr(self, name)}: expected >= {low}")
        for name in ("max_total_tokens", "page_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} = {getattr(self, name)}: expected >= 1")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(f"--chunked-prefill-size = {self.chunked_prefill_size}: expected >= 1, or -1 "
                             "(no chunking: the whole pool)")
        if self.port > 65535:
            raise ValueError(f"--port = {self.port}: expected at most 65535")
        if self.load_format == "dummy" and self.model_path is None:
            raise ValueError("--load-format dummy builds random weights from the config.json of --model-path; "
                             "give --model-path (without it the tiny random model is served already)")
        if self.dummy_quiet_layers != 1.0 and self.model_path is not None and self.load_format != "dummy":
            raise ValueError(f"--dummy-quiet-layers {self.dummy_quiet_layers}: it scales random weights "
                             "(--load-format dummy, or the tiny model without --model-path), not a checkpoint's")
        if not self.dummy_quiet_layers > 0:
            raise ValueError(f"--dummy-quiet-layers = {self.dummy_quiet_layers}: expected > 0 (1: as drawn)")
        if self.speculative_algorithm is not None and self.speculative_algorithm not in SPEC_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm}: expected one of "
                             f"{', '.join(SPEC_ALGORITHMS)}")
        if self.speculative_algorithm == "DFLASH" and self.speculative_draft_model_path is None:
            raise ValueError("--speculative-algorithm DFLASH reads a DFlash draft: give its directory as "
                             "--speculative-draft-model-path (python -m mimo_fn.speculative.train_dflash writes one)")
        if self.speculative_algorithm == "NGRAM" and self.speculative_num_draft_tokens == 0:
            raise ValueError("--speculative-algorithm NGRAM: give the drafts a step verifies as "
                             "--speculative-num-draft-tokens N > 0 (prompt lookup has no default)")
        if not 0 <= self.speculative_min_confidence < 1:
            raise ValueError(f"--speculative-min-confidence {self.speculative_min_confidence}: expected a "
                             "probability in [0, 1) (0: verify every draft)")
        if self.speculative_min_confidence and self.speculative_algorithm in (None, "NGRAM"):
            raise ValueError(f"--speculative-min-confidence {self.speculative_min_confidence} is read by "
                             f"--speculative-algorithm DFLASH or NEXTN (a draft model's probabilities); the algorithm "
                             f"is {self.speculative_algorithm or 'not set'}")
        if self.speculative_draft_model_path is not None and self.speculative_algorithm in (None, "NGRAM"):
            raise ValueError("--speculative-draft-model-path is read by --speculative-algorithm DFLASH or NEXTN; "
                             f"the algorithm is {self.speculative_algorithm or 'not set'}")
        if self.ep_dispatch_algorithm not in EP_DISPATCH_ALGORITHMS:
            raise ValueError(f"--ep-dispatch-algorithm {self.ep_dispatch_algorithm}: expected one of "
                             f"{', '.join(EP_DISPATCH_ALGORITHMS)}")
        if not isinstance(self.enable_deterministic_inference, bool):
            raise ValueError(f"--enable-deterministic-inference = {self.enable_deterministic_inference!r}: expected a "
                             "flag (True or False)")
        self.model_overrides()  # a bad JSON fails here, before anything loads

    def model_overrides(self) -> dict:
        """--json-model-override-args as a dict (config.json keys)."""
        try:
            overrides = json.loads(self.json_model_override_args)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-model-override-args {self.json_model_override_args!r}: not JSON ({e})") from None
        if not isinstance(overrides, dict):
            raise ValueError(f"--json-model-override-args {self.json_model_override_args!r}: expected a JSON object "
                             "of config.json keys, e.g. '{\"num_hidden_layers\": 6}'")
        return overrides

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path or TINY_MODEL_NAME

    def to_dict(self) -> dict:
        return asdict(self)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mimo_fn.serve", formatter_class=HelpFormatter,
        description="Serve a MiMo-V2-Flash model over HTTP (SGLang-native and OpenAI-compatible endpoints). "
                    "Without --model-path it serves a tiny random model with a tokenizer built locally. "
                    "Under torchrun, rank 0 serves HTTP and every rank runs its part of the mesh.",
    )
    add_server_args(ap)
    return ap


def add_server_args(ap: argparse.ArgumentParser) -> None:
    """The server's flags (also taken by `python -m mimo_fn.bench serve-bare`)."""
    d = ServerArgs()
    ap.add_argument("--model-path", help="hub-layout checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--tokenizer-path", help="tokenizer directory (default: --model-path)")
    ap.add_argument("--host", default=d.host, help="address to listen on")
    ap.add_argument("--port", type=int, default=d.port, help="port to listen on")
    ap.add_argument("--dp-size", type=int, default=d.dp_size, help="DP attention groups")
    ap.add_argument("--tp-size", type=int, default=d.tp_size, help="attention tensor-parallel ranks per DP group")
    ap.add_argument("--ep-size", type=int, default=d.ep_size, help="expert-parallel ranks")
    ap.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                    help="prefill tokens per pass and DP group; -1: no chunking")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="tokens the KV pool holds (default: what the device's free memory holds; 65536 on the CPU)")
    ap.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                    help="most requests in flight at once (EngineConfig.max_batch)")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 128)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="fp8: 128x128 block FP8 GEMM weights; mxfp4: MXFP4 routed experts, FP8 the others")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens,
                    help="draft tokens verified per decode step; 0: no speculation, or with --speculative-algorithm "
                         "its default (DFLASH: the draft's block - 1; NEXTN / MTP: the MTP layers; NGRAM has none: "
                         "give N > 0)")
    ap.add_argument("--speculative-algorithm", choices=tuple(SPEC_ALGORITHMS), default=None,
                    help="NGRAM: prompt lookup (the default with draft tokens); DFLASH: a DFlash block draft; "
                         "NEXTN (or MTP): the checkpoint's MTP layers")
    ap.add_argument("--speculative-draft-model-path", default=None,
                    help="DFLASH: the draft's directory; NEXTN: a checkpoint with MTP layers (default --model-path; "
                         "random layers with --load-format dummy)")
    ap.add_argument("--speculative-min-confidence", type=float, default=d.speculative_min_confidence,
                    help="DFLASH / NEXTN: verify a request's drafts only while the draft's own probability that all "
                         "of them are right stays >= P; the others read no experts (default 0: verify every draft)")
    ap.add_argument("--ep-dispatch-algorithm", choices=EP_DISPATCH_ALGORITHMS, default=d.ep_dispatch_algorithm,
                    help="fake: route every token to experts dealt round-robin, so each expert gets the same "
                         "number (benchmarks of a balanced load; the outputs are meaningless)")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="keep finished requests' K/V: a later prompt that begins with them forks it")
    ap.add_argument("--enable-memory-saver", action="store_true",
                    help="release / resume GPU memory at the same addresses (CUDA, torch_memory_saver)")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true",
                    help="/release_memory_occupation keeps the weights' bytes in host memory, so the resumed "
                         "weights are the old ones (without: push every weight after the resume)")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="a request's tokens and log-probs are the same bits whatever shares its batch, however its "
                         "prompt is chunked or cached (kernels with one tiling for every batch; slower)")
    ap.add_argument("--skip-warmup", action="store_true", help="report healthy without warming up first")
    ap.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                    help="dummy: random weights from config.json alone (benchmarks)")
    ap.add_argument("--json-model-override-args", default=d.json_model_override_args,
                    help="JSON applied to config.json, e.g. '{\"num_hidden_layers\": 6}'")
    ap.add_argument("--random-seed", type=int, default=d.random_seed, help="seed of random (dummy / tiny) weights")
    ap.add_argument("--dummy-quiet-layers", type=float, default=d.dummy_quiet_layers,
                    help="divide the random weights' layer outputs (attention o, MLP down) by this, so that a draft "
                         "model can learn their greedy continuations (speculative-decoding benchmarks; 1: as drawn)")
    ap.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    ap.add_argument("--served-model-name", help="the model name of the OpenAI API (default: --model-path)")
    ap.add_argument("--triton-cache-dir", help="where Triton keeps compiled kernels (TRITON_CACHE_DIR)")
    ap.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level, help="the server's log level")


def server_args(ns: argparse.Namespace) -> ServerArgs:
    """ServerArgs from a namespace holding the server's flags and maybe others."""
    names = {f.name for f in fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """ServerArgs from the command line; a bad value exits with the parser's usage and message."""
    ap = build_parser()
    ns = ap.parse_args(argv)
    try:
        return server_args(ns)
    except ValueError as e:
        ap.error(str(e))
