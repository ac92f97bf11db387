"""The training data loader `initialize(training_data=...)` returns, built as DeepSpeed builds it.

DeepSpeed 0.19.8 (`deepspeed.runtime.dataloader.DeepSpeedDataLoader`, under a launcher):
torch's `DistributedSampler` over the data-parallel ranks (shuffle on, seed 0, and no
`set_epoch`: every epoch visits the rows in the same order), batches of
``train_micro_batch_size_per_gpu`` rows, the caller's ``collate_fn``, last partial batch kept
(``dataloader_drop_last`` false). Every rank of a tensor- or pipeline-parallel group is one
data-parallel rank and gets the same rows. So a script sees DeepSpeed's batches
(``pytest -k deepspeed_api`` runs both).
"""

from __future__ import annotations

from torch.utils.data import DataLoader, DistributedSampler


def deepspeed_loader(dataset, micro_batch_size: int, dp_size: int, dp_rank: int, collate_fn=None) -> DataLoader:
    """Micro-batches of this data-parallel rank's share of `dataset`, in DeepSpeed's order."""
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn)
