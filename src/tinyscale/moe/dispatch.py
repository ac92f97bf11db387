"""Dispatch and combine: tokens to their experts' ranks and back (expert parallelism).

    expert_in, plan = dispatch(x, routing, group)   # rows for this rank's experts, grouped by expert
    y = combine(expert_out, routing, plan, num_tokens)

Each rank of the ep group holds E / P of the E experts (rank r: global experts r*E_l .. (r+1)*E_l - 1).
The routing's kept assignments are already sorted by expert, so they are sorted by destination
rank too, and one `all_to_all_single` with split sizes sends rank j its run. First the counts
travel (a (P, E_l) matrix: what I send to each expert of each rank), so every rank knows its
receive splits; then the rows. What arrives is source-major (rank 0's rows for my experts, then
rank 1's, ...); a stable sort by local expert groups it for the experts' grouped GEMM. The way
back is the same in reverse: undo the sort, the reverse all-to-all, then the combine

    y_t = sum over t's kept assignments a of w_a * E_{e_a}(x_t)     (index_add_ over token_index)

which uses the dispatch permutation (routing.token_index), not the expert's row order.

`AllToAll` is the autograd op: forward all-to-all with splits (out, in), backward the reverse
all-to-all of the gradient (splits swapped): the gradient of a permutation is its inverse.

Shape legend: N tokens, C d_model, M kept assignments sent by this rank, R rows received,
P ep ranks, E_l experts per rank. Lesson: lessons/13-moe.md. Tests: `pytest -k expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinyscale.dist import comm


# --8<-- [start:all-to-all]
class AllToAll(torch.autograd.Function):
    """Forward: all-to-all of dim-0 runs (rank i's j-th run -> rank j's i-th run).
    Backward: the reverse all-to-all of the gradient, split sizes swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), *x.shape[1:])  # (R, C)
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.in_splits), *grad.shape[1:])  # (M, C)
        comm.all_to_all(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None
# --8<-- [end:all-to-all]


@dataclass
class DispatchPlan:
    """What the way back needs: the splits and the sort of the received rows."""

    send_splits: list[int]        # rows sent to each ep rank (P,)
    recv_splits: list[int]        # rows received from each (P,)
    local_counts: list[int]       # rows for each of this rank's experts, after the sort (E_l,)
    order: torch.Tensor | None    # (R,) received rows -> grouped by local expert


# --8<-- [start:dispatch]
def dispatch(x: torch.Tensor, token_index: torch.Tensor, counts: torch.Tensor,
             group=None) -> tuple[torch.Tensor, DispatchPlan]:
    """x (N, C), kept assignments sorted by expert (`Routing.token_index`, `.counts` (E,)) ->
    (rows for this rank's experts grouped by local expert (R, C), the plan for `combine`)."""
    rows = x[token_index]  # (M, C): one row per kept assignment, in expert order
    P = 1 if group is None else dist.get_world_size(group)
    if P == 1:
        return rows, DispatchPlan([rows.shape[0]], [rows.shape[0]], counts.tolist(), None)
    send_counts = counts.reshape(P, -1)  # (P, E_l): to rank j's local expert i
    recv_counts = torch.empty_like(send_counts)  # (P, E_l): from rank j to my local expert i
    comm.all_to_all(recv_counts, send_counts.contiguous(), group=group)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = AllToAll.apply(rows, recv_splits, send_splits, group)  # (R, C) source-major
    E_l = send_counts.shape[1]
    local_expert = torch.arange(E_l, device=x.device).repeat(P).repeat_interleave(recv_counts.reshape(-1))  # (R,)
    order = torch.sort(local_expert, stable=True).indices  # (R,): grouped by expert, sources in rank order
    return received[order], DispatchPlan(send_splits, recv_splits, recv_counts.sum(0).tolist(), order)
# --8<-- [end:dispatch]


# --8<-- [start:combine]
def combine(expert_out: torch.Tensor, token_index: torch.Tensor, weight: torch.Tensor, plan: DispatchPlan,
            num_tokens: int, group=None) -> torch.Tensor:
    """Expert outputs in dispatch order (R, C) -> each token's weighted sum (N, C); a token whose
    assignments were all dropped gets zeros (the residual carries it)."""
    if plan.order is not None:  # undo the sort, then send every row back to the rank it came from
        # index_put keeps only the index (dispatch's sort keeps it already); index_copy would keep
        # expert_out too, (R, C), for nothing: its gradient is the gradient's rows at `order`
        received = expert_out.new_empty(expert_out.shape).index_put((plan.order,), expert_out)  # (R, C) source-major
        expert_out = AllToAll.apply(received, plan.send_splits, plan.recv_splits, group)  # (M, C)
    out = expert_out.new_zeros(num_tokens, expert_out.shape[-1])  # (N, C)
    return out.index_add(0, token_index, weight[:, None].to(expert_out.dtype) * expert_out)
# --8<-- [end:combine]


def all_to_all_bytes(counts_sent: int, rows_sent: int, rows_received: int, width: int, element_size: int,
                     count_size: int = 8) -> dict[str, int]:
    """The ledger's all-to-all bytes for one MoE layer's forward and backward on one rank, from
    the routing counts: the counts matrix (E int64) once; the rows out and back in the forward
    (sent M, then R), and the gradients the same way reversed in the backward (R, then M; the
    last only when the layer's input needs a gradient, as in a model). `comm` records an
    all-to-all's input size."""
    row = width * element_size
    return {"counts": counts_sent * count_size, "forward": (rows_sent + rows_received) * row,
            "backward": (rows_received + rows_sent) * row}
