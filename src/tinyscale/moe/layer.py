"""The MoE feed-forward: router, SwiGLU experts, optional shared experts, with expert parallelism.

    MoE(cfg) replaces a block's SwiGLU MLP when GPTConfig.moe_experts > 0 (its moe_layers).
    y = moe(x)                  # (B, T, C) -> (B, T, C); moe.aux_loss, moe.stats set by each forward

One forward, on the N = B*T tokens of this rank's micro-batch:

1. router logits (N, E) -> `route`: top-k experts and weights, the capacity drop, the Switch
   aux loss and the z-loss (router.py);
2. `dispatch` the kept assignments' rows to the ranks holding their experts (dispatch.py; in
   one process: just the gather in expert order);
3. the experts: three grouped GEMMs over the rows, one run of rows per expert
   (`tinyscale.kernels.grouped_gemm`: a Triton kernel, or the loop of matmuls it replaces);
4. `combine`: back to the source ranks, weighted sum per token by the dispatch permutation;
   plus the shared experts (DeepSeek-MoE), a SwiGLU every token goes through.

Expert parallelism (`apply_expert_parallel`, parallel.py) sets `ep_group` and this rank's
experts `local` (a [start, stop) range of the held expert tensors). Parameters:
`router.weight` (E, C); `experts.w_gate`, `experts.w_up` (E, C, F_e); `experts.w_down` (E, F_e, C):
one tensor per kind, stacked by expert, so an expert shard is a range along dim 0.

The aux loss (Switch + z) of each layer is stored in `aux_loss`: the GPT adds every layer's to
its cross-entropy (the loss it returns, and trains on). Under a pipeline, where the loss is
computed on the last stage only, each layer instead adds its aux loss's gradient in backward
itself (`AddAuxLoss`, with the scale the pipeline's backward gives the loss: `aux_grad_scale`).

Shape legend: B batch rows, T sequence, C d_model, N = B*T tokens, E experts, F_e expert width.
Lesson: lessons/13-moe.md. Tests: `pytest tests/moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tinyscale.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from tinyscale.moe.dispatch import combine, dispatch
from tinyscale.moe.router import route


@dataclass
class MoEStats:
    """One forward of one MoE layer, detached: what the engine and the lesson log."""

    load: torch.Tensor      # (E,) assignments per expert before the capacity drop
    kept: torch.Tensor      # (E,) assignments per expert after it (the rows dispatched)
    dropped: int            # assignments dropped for capacity
    assignments: int        # N * k
    aux_loss: float
    z_loss: float


class Experts(nn.Module):
    """E SwiGLU experts, stacked by expert along dim 0: expert e computes (silu(x Wg_e) * (x Wu_e)) Wd_e."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, hidden, **kw))  # (E, C, F_e)
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, hidden, **kw))  # (E, C, F_e)
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, d_model, **kw))  # (E, F_e, C)
        self.local = (0, num_experts)  # the held experts this rank computes (expert parallelism)
        self.first = 0  # the global index of the first held expert (`shard_experts` holds E / ep of them)
        self.impl = "kernel"  # "kernel": grouped_gemm (Triton where it runs, else the loop); "loop"

    # --8<-- [start:experts]
    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (R, C), rows grouped by local expert (`counts`, one per local expert) -> (R, C)."""
        start, stop = self.local
        gemm = grouped_gemm if self.impl == "kernel" else grouped_gemm_reference
        w_gate, w_up, w_down = (w[start:stop].to(x.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        h = F.silu(gemm(x, w_gate, counts)) * gemm(x, w_up, counts)  # (R, F_e)
        return gemm(h, w_down, counts)  # (R, C)
    # --8<-- [end:experts]


class AddAuxLoss(torch.autograd.Function):
    """Forward: x unchanged. Backward: x's gradient, and `scale` as the aux loss's (Megatron's
    MoEAuxLossAutoScaler): the aux loss trains as if it were added to the loss that is scaled by it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype, device=grad.device), None


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ shared experts); see the module docstring."""

    def __init__(self, cfg, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        E, C = cfg.moe_experts, cfg.d_model
        self.num_experts, self.top_k, self.router_kind = E, cfg.moe_top_k, cfg.moe_router
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.router = nn.Linear(C, E, bias=False, **kw)  # C -> E logits
        self.experts = Experts(E, C, cfg.expert_dim, **kw)
        self.shared = None
        if cfg.moe_shared_experts:  # DeepSeek-MoE: n_s experts every token uses, fused into one SwiGLU
            hidden = cfg.moe_shared_experts * cfg.expert_dim
            self.shared = nn.ModuleDict({"w_gate": nn.Linear(C, hidden, bias=False, **kw),
                                         "w_up": nn.Linear(C, hidden, bias=False, **kw),
                                         "w_down": nn.Linear(hidden, C, bias=False, **kw)})
        self.ep_group = None  # expert parallelism: the ranks the experts are split over
        self.aux_grad_scale: float | None = None  # set under a pipeline: AddAuxLoss's gradient
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None

    # --8<-- [start:forward]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # (N, C)
        logits = self.router(tokens).to(torch.promote_types(x.dtype, torch.float32))  # (N, E)
        r = route(logits, self.top_k, self.router_kind, self.capacity_factor, self.aux_loss_coef, self.z_loss_coef)
        rows, plan = dispatch(tokens, r.token_index, r.counts, self.ep_group)  # (R, C) by local expert
        out = self.experts(rows, plan.local_counts)  # (R, C)
        y = combine(out, r.token_index, r.weight, plan, B * T, self.ep_group).to(x.dtype)  # (N, C)
        if self.shared is not None:
            s = self.shared
            y = y + s["w_down"](F.silu(s["w_gate"](tokens)) * s["w_up"](tokens))  # (N, C)
        self.aux_loss = r.aux_loss + r.z_loss
        self.stats = MoEStats(load=r.load.detach(), kept=r.counts.detach(), dropped=r.dropped,
                              assignments=B * T * self.top_k, aux_loss=float(r.aux_loss.detach()),
                              z_loss=float(r.z_loss.detach()))
        y = y.view(B, T, C)
        if self.aux_grad_scale is not None and self.training:  # pipeline: the loss never sees aux_loss
            y = AddAuxLoss.apply(y, self.aux_loss, self.aux_grad_scale)
        return y
    # --8<-- [end:forward]


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss_of(model: nn.Module) -> torch.Tensor | None:
    """The sum of every MoE layer's aux loss from its last forward (None: no MoE layer ran)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack([loss.reshape(()) for loss in losses]).sum() if losses else None


def moe_stats(model: nn.Module) -> dict:
    """Every MoE layer's last forward, summed over layers: load per layer, dropped, the losses."""
    layers = [m for m in moe_layers(model) if m.stats is not None]
    if not layers:
        return {}
    return {"load": [m.stats.load.tolist() for m in layers],
            "dropped": sum(m.stats.dropped for m in layers),
            "assignments": sum(m.stats.assignments for m in layers),
            "aux_loss": sum(m.stats.aux_loss for m in layers),
            "z_loss": sum(m.stats.z_loss for m in layers)}
