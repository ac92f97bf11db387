"""Data parallelism: every rank holds the whole model, trains on its share of the batch, and
gradients are averaged so that every rank takes the same step.

    from tinyscale.data_parallel import NaiveDDP, BucketedDDP
    model = BucketedDDP(model, process_group=group, bucket_cap_mb=25)
    for i, micro in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (model(*micro) / len(micro_batches)).backward()
    optimizer.step()

| wrapper | when gradients move | messages per step |
| --- | --- | --- |
| `NaiveDDP` | after backward, one blocking all-reduce per parameter | one per parameter tensor |
| `BucketedDDP` | during backward, one async all-reduce per full bucket | one per bucket |

Both take torch DDP's argument names (``process_group``, ``bucket_cap_mb``,
``find_unused_parameters``), so tests hold all three to the same properties through one
seam (`IMPLEMENTATIONS`). The lesson: lessons/02-data-parallel.md.
"""

from tinyscale.data_parallel.base import DataParallelBase, broadcast_parameters
from tinyscale.data_parallel.bucketed import BucketedDDP, assign_buckets
from tinyscale.data_parallel.naive import NaiveDDP

# The seam (tinyscale.testing.implementations): name -> import string.
IMPLEMENTATIONS = {
    "naive": "tinyscale.data_parallel:NaiveDDP",
    "bucketed": "tinyscale.data_parallel:BucketedDDP",
    "torch": "torch.nn.parallel:DistributedDataParallel",
}

__all__ = ["IMPLEMENTATIONS", "BucketedDDP", "DataParallelBase", "NaiveDDP", "assign_buckets",
           "broadcast_parameters"]
