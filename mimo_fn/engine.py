"""Engine: the thin stateful shell over the pure step functions, for scripts and RL frameworks.

It owns one EngineState, feeds it chunked prefills and batched decodes, samples, and hands
back per-prompt outputs. All model math lives in model.py; all paging in cache.py.
"""

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from mimo_fn.batch import Batch
from mimo_fn.cache import SeqPages, pages_needed
from mimo_fn.config import ModelConfig
from mimo_fn.layers.sampling import SamplingParams, sample, token_logprobs
from mimo_fn.model import EngineState, decode, init_state, prefill, release
from mimo_fn.params import Params


@dataclass(frozen=True)
class EngineConfig:
    max_tokens: int  # tokens the full-attention KV pool holds, all sequences together
    page_size: int = 16
    max_swa_tokens: int | None = None  # sliding-window pool size; None = max_tokens
    chunk_size: int = 16384  # longest prefill chunk of one sequence in one step
    max_batch: int = 256  # most sequences decoded together
    progress: bool = False  # progress bar over decode steps

    def __post_init__(self) -> None:
        for name in ("max_tokens", "page_size", "chunk_size", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} = {getattr(self, name)}: expected a positive int")


@dataclass(frozen=True)
class Output:
    tokens: list[int]  # generated tokens
    logprobs: list[float] | None = None  # log p of each generated token (raw logits)
    prompt_logprobs: list[float] | None = None  # log p of prompt tokens 1..n-1 given their prefix


class Engine:
    def __init__(self, cfg: ModelConfig, params: Params, config: EngineConfig):
        self.cfg, self.config = cfg, config
        self.state: EngineState = init_state(cfg, params, config.max_tokens, config.page_size,
                                             config.max_swa_tokens)
        self._next_id = 0

    def _fits(self, lengths: list[int]) -> bool:
        """Whether sequences of these total lengths fit in the free pages together."""
        cache = self.state.cache
        need = [0, 0]
        for n in lengths:
            f, s = pages_needed(cache, SeqPages(0, (), ()), n)
            # the SWA pool never holds more than the window plus one chunk per sequence
            s = min(s, math.ceil((self.cfg.sliding_window + self.config.chunk_size) / cache.page_size) + 1)
            need[0], need[1] = need[0] + f, need[1] + s
        return need[0] <= len(cache.full.free) and need[1] <= len(cache.swa.free)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16,
        sampling: SamplingParams | None = None, return_logprobs: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> list[Output]:
        """Generate for each prompt; outputs in prompt order. sampling None = greedy."""
        if max_new_tokens <= 0:
            raise ValueError(f"generate: max_new_tokens = {max_new_tokens}, expected a positive int")
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"generate: prompt {i} is empty")
            if not self._fits([len(p) + max_new_tokens]):
                raise ValueError(f"generate: prompt {i} needs {len(p) + max_new_tokens} tokens of KV cache; "
                                 f"the engine holds {self.config.max_tokens} (EngineConfig.max_tokens)")
        outputs: list[Output | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:  # serial admission: as many prompts as fit, run to completion, repeat
            wave = [todo[0]]
            while (len(wave) < min(len(todo), self.config.max_batch)
                   and self._fits([len(prompts[j]) + max_new_tokens for j in todo[:len(wave) + 1]])):
                wave.append(todo[len(wave)])
            todo = todo[len(wave):]
            for j, out in zip(wave, self._run_wave([prompts[j] for j in wave], wave, max_new_tokens, sampling,
                                                   return_logprobs, set(stop_token_ids))):
                outputs[j] = out
        return outputs  # type: ignore[return-value]

    def _run_wave(self, prompts, indices, max_new_tokens, sampling, return_logprobs, stops) -> list[Output]:
        ids = list(range(self._next_id, self._next_id + len(prompts)))
        self._next_id += len(prompts)
        seed = sampling.seed if sampling is not None else 0
        gens = [torch.Generator().manual_seed(seed + i) for i in indices]
        device = self.state.params.embed.device
        prompt_lp: list[list[float]] = [[] for _ in prompts]
        last_logits = []
        for b, (sid, p) in enumerate(zip(ids, prompts)):
            for start in range(0, len(p), self.config.chunk_size):
                chunk = p[start:start + self.config.chunk_size]
                self.state, out = prefill(self.state, Batch.from_tokens([sid], [chunk]), all_logits=return_logprobs)
                if return_logprobs:  # logits at t score token t+1
                    nxt = torch.tensor(p[start + 1:start + len(chunk) + 1], device=device)
                    prompt_lp[b] += token_logprobs(out.logits_TV[:len(nxt)], nxt).tolist()
            last_logits.append(out.logits_BV[0])
        logits_BV = torch.stack(last_logits)
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        for _ in tqdm(range(max_new_tokens), desc="decode", disable=not self.config.progress):
            nxt_B = sample(logits_BV, sampling, [gens[b] for b in live])
            lp_B = token_logprobs(logits_BV, nxt_B).tolist() if return_logprobs else None
            still = []
            for r, b in enumerate(live):
                t = int(nxt_B[r])
                tokens[b].append(t)
                if lp_B is not None:
                    logps[b].append(lp_B[r])
                if len(tokens[b]) < max_new_tokens and t not in stops:
                    still.append((r, b))
            if not still:
                break
            live = [b for _, b in still]
            batch = Batch.from_tokens([ids[b] for b in live], [[tokens[b][-1]] for b in live])
            self.state, out = decode(self.state, batch)
            logits_BV = out.logits_BV
        self.state = release(self.state, ids)
        return [Output(tokens[b], logps[b] if return_logprobs else None,
                       prompt_lp[b] if return_logprobs else None) for b in range(len(prompts))]

