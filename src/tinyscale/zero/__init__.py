"""ZeRO: sharded optimizer states, gradients and parameters over the data-parallel group.

| stage | sharded across N ranks | gradients reach the owner by | per-rank model states |
| --- | --- | --- | --- |
| 1 | optimizer states, master weights | one reduce-scatter per unit after backward | B Psi + B Psi + K Psi / N |
| 2 | + gradients | bucketed reduce-scatters during backward | B Psi + (B + K) Psi / N |
| 3 | + parameters | (planned) | (2B + K) Psi / N |

Stages 1 and 2 step the same `ShardedOptimizer` (flat padded shards, `flat.FlatUnit`);
they differ in when and how the gradient shards are filled. The lesson:
lessons/03-zero.md (planned).
"""

from tinyscale.zero.flat import FlatUnit, split_into_units
from tinyscale.zero.optimizer import ShardedOptimizer, normalize_param_groups
from tinyscale.zero.stage1 import ZeroStage1
from tinyscale.zero.stage2 import ZeroStage2

__all__ = ["FlatUnit", "ShardedOptimizer", "ZeroStage1", "ZeroStage2", "normalize_param_groups",
           "split_into_units"]
