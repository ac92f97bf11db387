"""NaiveDDP: after the whole backward, all-reduce every gradient, one parameter at a time.

    model = NaiveDDP(model, process_group=group)
    loss = model(x, y); loss.backward()        # gradients are averaged when backward returns

The simplest correct data parallelism, and the baseline `bucketed.py` improves on: it
waits for the last gradient before sending the first (no overlap with backward), and it
pays one collective's latency per parameter tensor (a GPT has a few hundred). Diff the
two files to see exactly what bucketing and overlap add.

Averaging: each rank's loss is the mean over its rows, so its gradient is the gradient of
its local mean; summing over ranks and dividing by the world size gives the gradient of
the global mean, because every rank holds the same number of rows.
"""

from __future__ import annotations

import torch

from tinyscale.data_parallel.base import DataParallelBase
from tinyscale.dist import comm


class NaiveDDP(DataParallelBase):
    """Data parallelism with one blocking all-reduce per gradient after backward."""

    def _grad_ready(self, param: torch.Tensor) -> None:
        pass  # naive: wait for the whole backward

    # --8<-- [start:finish]
    @torch.no_grad()
    def _finish_backward(self) -> None:
        # Which parameters got a gradient on some rank: one small all-reduce, always (the
        # naive baseline pays it separately; BucketedDDP folds it into its last bucket).
        used = self._used_anywhere([p.grad is not None for p in self.params])
        for p, used_somewhere in zip(self.params, used):
            if not used_somewhere:
                continue  # unused on every rank: no gradient, as in one process
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused here, used elsewhere: contribute zero
            p.grad.div_(self.world_size)  # before the sum, as torch DDP: fp16 sums can overflow
            comm.all_reduce(p.grad, group=self.process_group)
    # --8<-- [end:finish]
