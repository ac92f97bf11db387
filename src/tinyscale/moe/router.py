"""The router: which experts each token goes to, with what weight, and which assignments are dropped.

    routing = route(logits, top_k=2, kind="softmax", capacity_factor=1.25)

Two gates:
- "softmax" (Switch, GShard, Mixtral): p = softmax(logits); the top-k probabilities are the
  weights, renormalised over the k chosen when k > 1 (Mixtral; Switch's top-1 keeps p itself).
- "sigmoid" (DeepSeek-V3, sec. 2.1.2): s = sigmoid(logits), each expert scored on its own; the
  top-k scores normalised to sum 1 are the weights.

Capacity (GShard sec. 2.2, Switch sec. 2.2): an expert takes at most
``ceil(capacity_factor * N * k / E)`` of the N * k assignments; the rest are dropped: their
token gets no output from that expert (the block's residual carries it through unchanged when
every one of its k assignments is dropped). Priority is k-major: every token's first choice
before any token's second, then token order (GShard's rule), so a token keeps its best expert
whenever it can.

Losses (both differentiable through the router's probabilities, both added to the training loss):
- the Switch load-balancing loss ``L_aux = alpha * E * sum_i f_i * P_i`` (Switch sec. 2.2, eq. 4):
  f_i the fraction of the N * k assignments routed to expert i (counted before the capacity
  drop; a count, no gradient), P_i the mean over tokens of the router's probability of expert i
  (differentiable). Its gradient lowers P_i in proportion to f_i: the busy experts' probabilities
  fall. At uniform routing L_aux = alpha;
- the router z-loss ``L_z = beta * mean_t (logsumexp_i logits_ti)^2`` (ST-MoE sec. 3.1): keeps
  the logits small, so the gate's softmax stays stable in low precision.

Shape legend: N tokens (B*T of one micro-batch, flattened), E experts, k experts per token,
A = N*k assignments, M kept assignments (A minus the dropped).
Lesson: lessons/13-moe.md. Tests: `pytest tests/moe -k moe_router`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROUTERS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One micro-batch's routing, with the kept assignments sorted by expert (the dispatch order)."""

    token_index: torch.Tensor   # (M,) the token of each kept assignment, grouped by expert
    expert_index: torch.Tensor  # (M,) its expert, non-decreasing
    weight: torch.Tensor        # (M,) its gate weight (differentiable)
    counts: torch.Tensor        # (E,) kept assignments per expert (int64)
    load: torch.Tensor          # (E,) assignments per expert before the capacity drop (int64)
    dropped: int                # assignments over capacity
    aux_loss: torch.Tensor      # alpha E sum f_i P_i (differentiable through P)
    z_loss: torch.Tensor        # beta mean (logsumexp logits)^2


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert may take from N tokens: ceil(cf * N * k / E); None: unlimited."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


# --8<-- [start:gate]
def gate(logits: torch.Tensor, top_k: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (N, k), experts (N, k), probs (N, E)): the chosen experts, their weights, and the
    distribution over all experts the aux loss averages (softmax, or sigmoid scores normalised)."""
    if kind == "softmax":
        probs = logits.softmax(dim=-1)  # (N, E)
        weights, experts = probs.topk(top_k, dim=-1)  # (N, k)
        if top_k > 1:  # Mixtral / GShard: the k weights sum to 1
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs
    if kind == "sigmoid":
        scores = logits.sigmoid()  # (N, E), each expert's own affinity
        top, experts = scores.topk(top_k, dim=-1)  # (N, k)
        return top / top.sum(dim=-1, keepdim=True), experts, scores / scores.sum(dim=-1, keepdim=True)
    raise ValueError(f"router kind {kind!r} is unknown: use one of {ROUTERS}")
# --8<-- [end:gate]


# --8<-- [start:route]
def route(logits: torch.Tensor, top_k: int, kind: str = "softmax", capacity_factor: float | None = None,
          aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> Routing:
    """Route N tokens given the router's logits (N, E); see the module docstring."""
    N, E = logits.shape
    weights, experts, probs = gate(logits, top_k, kind)  # (N, k), (N, k), (N, E)
    # k-major: all first choices, then all second choices (GShard's priority)
    flat_expert = experts.t().reshape(-1)  # (A,)
    flat_token = torch.arange(N, device=logits.device).repeat(top_k)  # (A,)
    flat_weight = weights.t().reshape(-1)  # (A,)
    order = torch.sort(flat_expert, stable=True).indices  # (A,) grouped by expert, priority kept within
    load = torch.bincount(flat_expert, minlength=E)  # (E,)
    kept = order
    cap = capacity(N, E, top_k, capacity_factor)
    if cap is not None:  # position of each assignment in its expert's queue; keep the first `cap`
        first = torch.cumsum(load, 0) - load  # (E,) where each expert's run starts in `order`
        position = torch.arange(order.numel(), device=logits.device) - first[flat_expert[order]]
        kept = order[position < cap]  # (M,)
    expert_index = flat_expert[kept]
    f = load.to(probs.dtype) / (N * top_k)  # (E,) fractions of assignments; no gradient (counts)
    P = probs.mean(dim=0)  # (E,) mean router probability; the gradient flows here
    aux = aux_loss_coef * E * (f * P).sum()
    z = z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return Routing(token_index=flat_token[kept], expert_index=expert_index, weight=flat_weight[kept],
                   counts=torch.bincount(expert_index, minlength=E), load=load,
                   dropped=int(flat_expert.numel() - kept.numel()), aux_loss=aux, z_loss=z)
# --8<-- [end:route]
