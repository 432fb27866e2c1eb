"""Start a server from ServerArgs: the mesh, the memory plan, the weights, the engine, then HTTP.

Under torchrun every rank builds its engine over its slice of the weights; rank 0 also serves
HTTP and runs the loop (loop.py), the others follow its passes. Before any weight loads, each
rank's memory plan (weights, KV pool, one prefill chunk; mimo_fn.memory_plan) is checked against
the device's free memory, and a launch that does not fit stops with what to shrink.
"""

import json
import logging
import os
import shutil
import signal
import tempfile

import torch
import torch.distributed as dist

import mimo_fn as mf
from mimo_fn.cache import DEFAULT_PAGE_SIZE, pool_page_bytes
from mimo_fn.memory_plan import GiB, fp8_attention_page_bytes, plan_memory
from mimo_fn.parallel.mesh import init_mesh
from mimo_fn.parallel.sharding import shard_params
from mimo_fn.params import quantize_params, random_params
from mimo_fn.serve.args import SPEC_ALGORITHMS, ServerArgs
from mimo_fn.serve.loop import EngineLoop, MeshTransport, Runner, Transport, follow
from mimo_fn.serve.tokenizer import TextTokenizer, load_tokenizer, tiny_tokenizer
from mimo_fn.speculative.build import RANDOM_MTP_LAYERS, build_proposer
from mimo_fn.speculative.mtp_checkpoint import num_mtp_layers

log = logging.getLogger("mimo_fn.serve")
CPU_MAX_TOTAL_TOKENS = 65536  # the KV pool on the CPU when --max-total-tokens is not given
# config.json lists with one entry per layer: a smaller num_hidden_layers keeps their first entries
PER_LAYER_KEYS = ("layer_types", "mlp_layer_types", "hybrid_layer_pattern", "moe_layer_freq")


def override_config(d: dict, overrides: dict) -> dict:
    """config.json with --json-model-override-args applied (inside text_config where it nests)."""
    if "text_config" in d:
        return {**d, "text_config": override_config(d["text_config"], overrides)}
    out = {**d, **overrides}
    n = overrides.get("num_hidden_layers")
    for key in PER_LAYER_KEYS:
        if isinstance(n, int) and key not in overrides and isinstance(out.get(key), list) and len(out[key]) > n:
            out[key] = out[key][:n]  # the slice of the first n layers
    return out


def model_config(args: ServerArgs) -> tuple[mf.ModelConfig, dict]:
    """(config, its config.json dict) with the overrides applied; the tiny model without --model-path."""
    if args.model_path is None:
        d = mf.ModelConfig.tiny().to_hf()
    else:
        path = os.path.join(args.model_path, "config.json")
        if not os.path.exists(path):
            raise SystemExit(f"--model-path {args.model_path}: no config.json there")
        with open(path) as f:
            d = json.load(f)
    d = override_config(d, args.model_overrides())
    try:
        return mf.ModelConfig.from_hf(d), d
    except (ValueError, TypeError) as e:
        raise SystemExit(f"the model config (--model-path / --json-model-override-args): {e}") from None


def stored_format(args: ServerArgs, d: dict) -> str:
    """The weight format the memory plan counts: --quantization, else what the checkpoint stores
    (FP8 by its quantization_config, MXFP4 experts by a `*_proj.weight_scale` tensor)."""
    if args.quantization or args.model_path is None or args.load_format == "dummy":
        return args.quantization or "none"
    qc = d.get("quantization_config") or {}
    index = os.path.join(args.model_path, "model.safetensors.index.json")
    names: list[str] = []
    if os.path.exists(index):
        with open(index) as f:
            names = list(json.load(f)["weight_map"])
    elif os.path.exists(os.path.join(args.model_path, "model.safetensors")):
        from safetensors import safe_open

        with safe_open(os.path.join(args.model_path, "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
    if qc.get("quant_method") == "mxfp4" or any(k.endswith("_proj.weight_scale") for k in names):
        return "mxfp4"
    return "fp8" if qc.get("quant_method") == "fp8" else "none"


def kv_tokens_that_fit(cfg, mesh, dtype, page_size: int, budget: int) -> int:
    """Tokens of KV pool (full + sliding-window pages, as init_state allocates them, and with
    MIMO_FN_ATTENTION_FP8=1 a page's FP8 copy during a full-attention call) in `budget` bytes."""
    full_b, swa_b = pool_page_bytes(cfg, page_size, dtype, mesh.tp)
    return max(0, budget // (full_b + swa_b + fp8_attention_page_bytes(cfg, page_size, mesh.tp))) * page_size


def plan(args: ServerArgs, cfg, d: dict, mesh, dtype, free: int | None, page_size: int) -> tuple[int, int]:
    """(max_total_tokens, chunk): checked against the memory plan of a device with `free` bytes
    (None: not known, the CPU); SystemExit with what to shrink."""
    fmt = stored_format(args, d)
    chunk = args.chunked_prefill_size if args.chunked_prefill_size != -1 else None
    max_tokens = args.max_total_tokens
    if max_tokens is None and free is None:
        max_tokens = CPU_MAX_TOTAL_TOKENS
    if max_tokens is None:  # what the device holds beside the weights and one chunk's activations
        base = plan_memory(cfg, mesh, dtype, fmt, page_size, page_size, chunk or 16384, free)
        max_tokens = kv_tokens_that_fit(cfg, mesh, dtype, page_size, int(0.9 * free) - base.weights - base.activations)
        if max_tokens < page_size:
            max_tokens = page_size  # the plan below says it does not fit
    chunk = chunk or max_tokens
    if chunk < page_size:
        raise SystemExit(f"--chunked-prefill-size {chunk} is smaller than --page-size {page_size}: a prefill chunk "
                         "holds at least one page")
    p = plan_memory(cfg, mesh, dtype, fmt, max_tokens, page_size, min(chunk, max_tokens), free)
    if mesh.rank == 0:
        log.info("memory plan %s (%s weights, %d KV tokens)", p.summary(), fmt, max_tokens)
    if not p.fits:
        raise SystemExit(
            f"this launch does not fit (rank {mesh.rank}): {p.summary()}, of which {1 - p.headroom:.0%} may be planned "
            f"({(1 - p.headroom) * free / GiB:.1f} GiB). Shrink it: more ranks over the weights (--tp-size / "
            "--ep-size under torchrun), FP8 or MXFP4 weights (--quantization), a smaller KV pool (--max-total-tokens) "
            "or prefill chunk (--chunked-prefill-size)")
    return max_tokens, chunk


def load_params(args: ServerArgs, cfg, d: dict, mesh, dtype, device):
    """This rank's weights: random (tiny / --load-format dummy; the same on every rank, then its
    slice) or read from the checkpoint (each rank its slice)."""
    experts = "mxfp4" if args.quantization == "mxfp4" else "fp8"
    if args.model_path is None or args.load_format == "dummy":
        quiet = args.dummy_quiet_layers
        if mesh.world == 1 and args.quantization:  # quantised as drawn (or one weight at a time after quieting)
            return random_params(cfg, args.random_seed, dtype, device, quantize=experts, quiet=quiet)
        params = shard_params(random_params(cfg, args.random_seed, dtype, device, quiet=quiet), cfg, mesh)
        return quantize_params(cfg, params, experts=experts) if args.quantization else params
    path, tmp = args.model_path, None
    if args.model_overrides():  # load_checkpoint reads config.json from the directory: give it the new one
        tmp = tempfile.mkdtemp(prefix="mimo_fn_serve_")
        for name in os.listdir(args.model_path):
            if name != "config.json":
                os.symlink(os.path.join(os.path.abspath(args.model_path), name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(d, f)
        path = tmp
    try:
        _, params = mf.load_checkpoint(path, dtype=dtype, device=device, mesh=mesh, progress=mesh.rank == 0,
                                       quant="fp8" if args.quantization == "fp8" else "auto")
    except ValueError as e:
        hint = (" (--json-model-override-args changes the model, and load_checkpoint reads every tensor of the "
                "checkpoint: serve a slice with --load-format dummy)") if tmp else ""
        raise SystemExit(f"--model-path {args.model_path}: {e}{hint}") from None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return quantize_params(cfg, params, experts="mxfp4") if args.quantization == "mxfp4" else params


def tokenizer_for(args: ServerArgs, cfg) -> TextTokenizer:
    if args.model_path is None and args.tokenizer_path is None:
        return tiny_tokenizer(cfg.vocab_size)
    path = args.tokenizer_path or args.model_path
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        if args.load_format == "dummy" and args.tokenizer_path is None:
            log.warning("no tokenizer in %s (%s): serving the character-level one (send input_ids)", path, e)
            return tiny_tokenizer(cfg.vocab_size)
        raise SystemExit(f"--tokenizer-path {path}: no tokenizer could be loaded from there ({e})") from None


def nccl_graph_register(environ, pausable_graphs: bool) -> str | None:
    """With the memory saver on a mesh, a release unmaps pages under addresses that the captured
    CUDA graphs keep (the graphs stay across it): NCCL's registration of the graphs' buffers
    (NCCL_GRAPH_REGISTER, on by default) could let a rank read released pages through a
    registered path, and the ranks deadlock. Set it to 0 in `environ` unless the user set it;
    then a warning naming the hazard (None: nothing to say)."""
    if not pausable_graphs:
        return None
    if "NCCL_GRAPH_REGISTER" not in environ:
        environ["NCCL_GRAPH_REGISTER"] = "0"
        return None
    if environ["NCCL_GRAPH_REGISTER"] == "0":
        return None
    return (f"NCCL_GRAPH_REGISTER={environ['NCCL_GRAPH_REGISTER']} with --enable-memory-saver on a mesh: NCCL "
            "registers the CUDA graphs' buffers, whose pages a release unmaps, so a rank may read released pages "
            "through a registered path and the ranks deadlock. Unset it (the server then sets 0) unless you know "
            "the released pages are never reached")


def init_distributed(args: ServerArgs) -> torch.device:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.dp_size * args.tp_size:
        raise SystemExit(f"--dp-size {args.dp_size} x --tp-size {args.tp_size} = {args.dp_size * args.tp_size} ranks, "
                         f"but the world has {world}: launch with torchrun --nproc-per-node (x --nnodes) giving "
                         "that many")
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        hazard = nccl_graph_register(os.environ, args.enable_memory_saver and cuda)  # before NCCL reads it
        if hazard:
            log.warning(hazard)
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def mesh_for(args: ServerArgs):
    """The mesh of --dp-size / --tp-size / --ep-size (over the initialised world) and --ep-dispatch-algorithm."""
    return init_mesh(args.dp_size, args.tp_size, args.ep_size, fake_balanced_routing=args.ep_dispatch_algorithm == "fake")


def build_engine(args: ServerArgs, device: torch.device, mesh) -> tuple[mf.Engine, mf.ModelConfig, dict, int]:
    """The engine the flags describe, built as the server builds it: (engine, config, config.json
    dict, KV pool tokens). The memory plan is checked before any weight is made or read."""
    cfg, d = model_config(args)
    try:
        mesh.validate(cfg)
    except ValueError as e:
        raise SystemExit(f"--tp-size / --ep-size: {e}") from None
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    page_size = args.page_size or DEFAULT_PAGE_SIZE
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    max_tokens, chunk = plan(args, cfg, d, mesh, dtype, free, page_size)
    params = load_params(args, cfg, d, mesh, dtype, device)
    try:
        proposer, draft_tokens = speculative(args, cfg, d, params)
        engine = mf.Engine(cfg, params, mf.EngineConfig(
            max_tokens=max_tokens, page_size=page_size, chunk_size=chunk, max_batch=args.max_running_requests,
            num_draft_tokens=draft_tokens, proposer=proposer, memory_saver=args.enable_memory_saver,
            prefix_cache=args.enable_prefix_caching, weights_cpu_backup=args.enable_weights_cpu_backup,
            deterministic=args.enable_deterministic_inference), mesh=mesh)
    except ValueError as e:
        raise SystemExit(f"the engine rejected these flags: {e}") from None
    return engine, cfg, d, max_tokens


def speculative(args: ServerArgs, cfg, d: dict, params) -> tuple[object, int]:
    """(EngineConfig.proposer, num_draft_tokens) of the --speculative-* flags."""
    name = SPEC_ALGORITHMS.get(args.speculative_algorithm or "NGRAM")
    if args.speculative_algorithm is None or name == "ngram":
        return None, args.speculative_num_draft_tokens
    path = args.speculative_draft_model_path
    dummy = name == "mtp" and path is None and (args.model_path is None or args.load_format == "dummy")
    if name == "mtp" and path is None and not dummy:
        path = args.model_path
    proposer = build_proposer(name, cfg, params, path, random_draft=dummy, seed=args.random_seed,
                              num_mtp_layers=num_mtp_layers(d) or RANDOM_MTP_LAYERS,
                              min_confidence=args.speculative_min_confidence)
    k = args.speculative_num_draft_tokens
    if not k:  # the algorithm's own: a DFlash block's drafts, one per MTP layer
        k = proposer.dcfg.block_size - 1 if name == "dflash" else len(proposer.params.layers)
    return proposer, k


def serve(args: ServerArgs) -> None:
    device = init_distributed(args)
    try:
        mesh = mesh_for(args)
        engine, cfg, d, max_tokens = build_engine(args, device, mesh)
        runner = Runner(engine, mesh.dp_rank, mesh.tp_rank)
        transport = MeshTransport(mesh.host_group, mesh.world, mesh.rank) if mesh.world > 1 else Transport()
        if mesh.rank != 0:
            # a Ctrl-C or torchrun's SIGTERM reaches every rank at once: the others leave when rank 0's
            # HTTP server has shut down and says stop (or when its connection drops, if it died)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            follow(runner, transport, warmup=not args.skip_warmup)
            return
        loop = EngineLoop(runner, transport, mesh.dp, mesh.tp, warmup=not args.skip_warmup, device=device)
        run_http(args, loop, tokenizer_for(args, cfg), cfg, d, min(cfg.max_position_embeddings, max_tokens))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_http(args: ServerArgs, loop: EngineLoop, tok: TextTokenizer, cfg, d: dict, max_model_len: int) -> None:
    import uvicorn

    from mimo_fn.serve.context import ServerContext
    from mimo_fn.serve.http import create_app

    try:
        from importlib.metadata import version

        ver = version("mimo_fn")
    except Exception:  # not installed (run from a checkout)
        ver = "0+local"
    info = {"model_type": d.get("model_type", "mimo_v2_flash"), "architectures": d.get("architectures"),
            "num_hidden_layers": cfg.num_layers}
    ctx = ServerContext(args, loop, tok, cfg.vocab_size, max_model_len, info, ver)
    log.info("serving %s on http://%s:%d", args.model_name, args.host, args.port)
    uvicorn.run(create_app(ctx), host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5)  # open streams: cancelled (their requests abort) after 5 s
