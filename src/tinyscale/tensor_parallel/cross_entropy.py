"""Vocab-parallel cross-entropy: the loss of logits split over the vocab, never gathered.

Megatron-LM (Shoeybi et al. 2019, sec. 3, "Input embedding"; `vocab_parallel_cross_entropy`).
The LM head is column-parallel, so rank r holds logits z[:, v] for its vocab slice
[r*Vp/t, (r+1)*Vp/t) only. Cross-entropy per token is

    loss = log(sum_v exp(z_v - m)) - (z_target - m),   m = max_v z_v

and each term is a sum (or max) over the vocab, so three all-reduces of one number per token
assemble it: the max (MAX), the target's logit (SUM: only its owner contributes) and the sum
of exponentials (SUM). Gathering the logits instead would move and hold (N, V) per rank; this
holds (N, ceil(V/t)) and moves 3N numbers.

Backward, without communication: d loss / d z_v = softmax(z)_v - [v == target], each rank
for its own columns (the max is a constant for the gradient: it cancels).

Padding: with Vp = ceil(V/t)*t > V, columns >= `vocab_size` are Megatron's padding; they are
set to -inf before the max and the sum, so they neither change the loss nor get a gradient.
No ignore_index: the GPT trains on every position (it has none either).

Shape legend: N tokens (B*T), Vl = Vp/t local vocab columns. Run: `pytest tests/tensor_parallel -k vocab_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.dist import comm


# --8<-- [start:loss]
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, group, vocab_size):
        n_local = local_logits.shape[-1]
        start = dist.get_rank(group) * n_local  # first global vocab id of this rank's columns
        logits = local_logits.clone()  # (N, Vl); forward works in place on the copy
        padding = torch.arange(start, start + n_local, device=logits.device) >= vocab_size  # (Vl,)
        if padding.any():
            logits[:, padding] = float("-inf")
        # 1. the max over the whole vocab (for a stable exp)
        row_max = logits.max(dim=-1).values  # (N,)
        comm.all_reduce(row_max, op=comm.ReduceOp.MAX, group=group)
        logits -= row_max.unsqueeze(-1)  # (N, Vl)
        # 2. the target's (shifted) logit: only the rank that owns the target contributes
        local_target = targets - start  # (N,)
        mine = (local_target >= 0) & (local_target < n_local)
        index = local_target.clamp(0, n_local - 1).unsqueeze(-1)  # (N, 1)
        target_logit = logits.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)  # (N,)
        comm.all_reduce(target_logit, group=group)
        # 3. the sum of exponentials over the whole vocab
        exp = logits.exp_()  # (N, Vl), in place: the shifted logits are not needed again
        sum_exp = exp.sum(dim=-1)  # (N,)
        comm.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, Vl): the only (N, Vl) tensor saved
        ctx.save_for_backward(softmax, index, mine)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine = ctx.saved_tensors
        grad = softmax.clone()  # (N, Vl): softmax - one_hot(target), on this rank's columns
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None
# --8<-- [end:loss]


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group, *,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (N,) from this rank's vocab columns `local_logits` (N, Vl).

    `targets` (N,) are global vocab ids, the same on every rank. `vocab_size` is the true V
    (columns at or beyond it are padding); None means no padding (V = t * Vl). Take `.mean()`
    for the GPT's loss."""
    if local_logits.dim() != 2 or targets.shape != local_logits.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy: local_logits must be (N, Vl) and targets (N,); got "
                         f"{tuple(local_logits.shape)} and {tuple(targets.shape)}")
    padded = local_logits.shape[-1] * dist.get_world_size(group)
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size={vocab_size} must be in 1..{padded}, the "
                         f"padded columns of all ranks ({local_logits.shape[-1]} per rank)")
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group, vocab_size)
