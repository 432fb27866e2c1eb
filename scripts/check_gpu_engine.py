"""GPU smoke check: Engine.generate (Triton attention + MoE kernels) against forward() on the tiny config."""
import torch, mimo_fn as mf
cfg = mf.ModelConfig.tiny()
for dtype in (torch.float32, torch.bfloat16):
    params = mf.init_params(cfg, seed=1, dtype=dtype, device="cuda")
    eng = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=512, page_size=16, chunk_size=32))
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (5, 77, 140)]
    outs = eng.generate(prompts, max_new_tokens=24, return_logprobs=True)
    agree = tot = 0; errs = []
    for p, o in zip(prompts, outs):
        full = torch.tensor(p + o.tokens, device="cuda")
        ref = mf.forward(params, cfg, full).float()
        agree += sum(int(a == b) for a, b in zip(o.tokens, ref[len(p) - 1:-1].argmax(-1).tolist())); tot += len(o.tokens)
        lp = torch.log_softmax(ref, -1)[:-1].gather(-1, full[1:, None]).squeeze(-1)
        errs.append((torch.tensor(o.prompt_logprobs + o.logprobs, device="cuda") - lp).abs().max().item())
    print(f"GPU engine {dtype}: greedy tokens equal forward argmax {agree}/{tot}, max logprob diff {max(errs):.2e}")
