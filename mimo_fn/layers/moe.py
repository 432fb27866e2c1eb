"""The MoE block: route, then the expert GEMMs (Triton on CUDA, plain torch elsewhere), locally or across EP ranks.

Legend: T tokens, H hidden, K experts per token, R token copies received by this EP rank,
n rows of the EP group (Mesh.ep_dispatch "gather").
"""

import torch

from mimo_fn._types import Bool, Float, Int, Tensor, typed
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.moe.dispatch import moe_experts
from mimo_fn.layers.router import replay_weights, route
from mimo_fn.parallel.ep import combine, dispatch
from mimo_fn.parallel.ep_gather import gather_for_experts, gather_rows, scatter_from_experts
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.params import MoE


@typed
def balanced_routing(
    num_tokens: int, cfg: ModelConfig, mesh: Mesh, device: torch.device
) -> tuple[Float[Tensor, "T K"], Int[Tensor, "T K"]]:
    """Benchmark-only routing: every expert gets the same number of copies, weights 1/K."""
    start = mesh.rank * num_tokens * cfg.top_k
    ids_TK = (torch.arange(num_tokens * cfg.top_k, device=device) + start) % cfg.num_experts
    return torch.full((num_tokens, cfg.top_k), 1.0 / cfg.top_k, device=device), ids_TK.view(num_tokens, cfg.top_k)


@typed
def moe(
    x_TH: Float[Tensor, "T H"], mlp: MoE, cfg: ModelConfig, mesh: Mesh | None = None, num_valid: int | None = None,
    ep_rows: int | None = None, routed_TK: Int[Tensor, "T K"] | None = None, deterministic: bool = False,
    *, residual_TH: Float[Tensor, "T H"] | None = None, rows_T: Bool[Tensor, " T"] | None = None,
) -> tuple[Float[Tensor, "T H"], Int[Tensor, "T K"]]:
    """Returns the block's output and the routed expert ids (for routing capture / replay); with
    residual_TH (the decoder layer's residual rows), residual_TH + the block's output instead, with
    the bits of torch's add: without EP the experts' last pass adds it (kernels.moe.dispatch), with
    EP it is added after the combine.
    Rows from num_valid on are padding: their ids are -1 and they get no expert. ep_rows: the
    rows every EP rank contributes to the "gather" dispatch (None: ep_gather.gather_rows).
    routed_TK: routing replay, the experts each token goes to instead of the router's top-k
    (their weights still come from the router: router.replay_weights). deterministic: the router's
    and the expert kernels' (router.py, kernels.moe.dispatch); across EP ranks the combine's
    order is the collectives' (docs/deterministic.md). rows_T: the rows routed; the others' ids
    are -1 as padding's, so they read no expert (a verify step's drafts past a confidence cut,
    Batch.moe_rows_T; without EP only)."""
    det = deterministic
    mesh = mesh or Mesh.single()
    if routed_TK is not None:
        ids_TK = routed_TK.to(device=x_TH.device, dtype=torch.int64)  # as route's
        weights_TK = replay_weights(x_TH, mlp.router, ids_TK, cfg, det)
    elif mesh.fake_balanced_routing:
        weights_TK, ids_TK = balanced_routing(x_TH.shape[0], cfg, mesh, x_TH.device)
    else:
        weights_TK, ids_TK = route(x_TH, mlp.router, mlp.router_bias, cfg, det)
    if num_valid is not None and num_valid < x_TH.shape[0]:
        ids_TK = ids_TK.clone()
        ids_TK[num_valid:] = -1
    if rows_T is not None:
        if mesh.ep != 1:
            raise ValueError("moe: rows_T (a row mask) needs every expert on this rank (EP 1)")
        ids_TK = ids_TK.masked_fill(~rows_T[:, None], -1)
    if mesh.ep == 1:
        # the experts add the residual in their last pass; one of another dtype keeps torch's type promotion
        fused_TH = residual_TH if residual_TH is not None and residual_TH.dtype == x_TH.dtype else None
        y_TH = moe_experts(x_TH, mlp.w13, mlp.w2, ids_TK, weights_TK, deterministic=det, residual_TH=fused_TH)
        return (y_TH if fused_TH is not None else _plus(residual_TH, y_TH)), ids_TK
    if mesh.ep_dispatch == "gather":
        rows = gather_rows(x_TH.shape[0], mesh, x_TH.device) if ep_rows is None else ep_rows
        x_nH, ids_nK, weights_nK = gather_for_experts(x_TH, ids_TK, weights_TK, rows, cfg.num_experts, mesh)
        # ids of other ranks' experts are -1 here: a local expert gets n * K / E_global pairs
        y_nH = moe_experts(x_nH, mlp.w13, mlp.w2, ids_nK, weights_nK,
                           pairs_per_expert=x_nH.shape[0] * cfg.top_k / cfg.num_experts, deterministic=det)
        return _plus(residual_TH, scatter_from_experts(y_nH, x_TH.shape[0], mesh)), ids_TK
    x_RH, ids_R, _, meta = dispatch(x_TH, ids_TK, cfg.num_experts, mesh, mesh.ep_capacity)
    ones_R1 = torch.ones(ids_R.shape[0], 1, dtype=torch.float32, device=x_TH.device)
    y_RH = moe_experts(x_RH, mlp.w13, mlp.w2, ids_R[:, None], ones_R1, deterministic=det)
    return _plus(residual_TH, combine(y_RH, weights_TK, meta, mesh)), ids_TK


def _plus(residual_TH: torch.Tensor | None, y_TH: torch.Tensor) -> torch.Tensor:
    return y_TH if residual_TH is None else residual_TH + y_TH
