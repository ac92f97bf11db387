"""ZeRO: sharded optimizer states, gradients and parameters over the data-parallel group.

| stage | sharded across N ranks | gradients reach the owner by | per-rank model states |
| --- | --- | --- | --- |
| 1 | optimizer states, master weights | one reduce-scatter per unit after backward | B Psi + B Psi + K Psi / N |
| 2 | + gradients | bucketed reduce-scatters during backward | B Psi + (B + K) Psi / N |
| 3 | + parameters | reduce-scatter per unit as soon as its backward is done | (2B + K) Psi / N |

All three step the same `ShardedOptimizer` (flat padded shards, `flat.FlatUnit`); they
differ in when and how the gradient shards are filled, and stage 3 also shards the
parameters, all-gathering each unit (a module) just before its forward and its backward:
3 Psi of communication per step instead of 2 Psi. The lesson:
lessons/03-zero.md (planned).
"""

from tinyscale.zero.flat import FlatUnit, split_into_units
from tinyscale.zero.optimizer import ShardedOptimizer, normalize_param_groups
from tinyscale.zero.stage1 import ZeroStage1
from tinyscale.zero.stage2 import ZeroStage2
from tinyscale.zero.stage3 import ZeroStage3

__all__ = ["FlatUnit", "ShardedOptimizer", "ZeroStage1", "ZeroStage2", "ZeroStage3", "normalize_param_groups",
           "split_into_units"]
