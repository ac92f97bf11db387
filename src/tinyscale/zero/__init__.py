"""ZeRO: sharded optimizer states, gradients and parameters over the data-parallel group.

| stage | sharded across N ranks | gradients reach the owner by | per-rank model states |
| --- | --- | --- | --- |
| 1 | optimizer states, master weights | one reduce-scatter per unit after backward | B Psi + B Psi + K Psi / N |
| 2 | + gradients | bucketed reduce-scatters during backward | B Psi + (B + K) Psi / N |
| 3 | + parameters | reduce-scatter per unit as soon as its backward is done | (2B + K) Psi / N |

All three step the same `ShardedOptimizer` (flat padded shards, `flat.FlatUnit`); they
differ in when and how the gradient shards are filled, and stage 3 also shards the
parameters, all-gathering each unit (a module) just before its forward and its backward:
3 Psi of communication per step instead of 2 Psi.

Offload (`offload.py`) moves master shards, optimizer states and the step to the host
(ZeRO-Offload) or into files with read-ahead threads (ZeRO-Infinity), and stage 3's
parameter shards likewise. Checkpoints (`state_dict.py`) gather the sharded state by
parameter name, so they load into any stage and world size. The lesson: lessons/03-zero.md.

The PyTorch way, beside the engine's: `fully_shard(model)` (stage 3; then any torch.optim
optimizer on `model.parameters()`, the shards; `full_parameters(model)` gathers them) and
`ZeroOptimizer(params, optimizer_class, **defaults)` (stages 1 and 2, like torch's
ZeroRedundancyOptimizer). Tests: `pytest -k fully_shard`, `pytest -k zero_optimizer_api`.
"""

from tinyscale.zero.flat import FlatUnit, split_into_units
from tinyscale.zero.fully_shard import MixedPrecisionPolicy, full_parameters, fully_shard
from tinyscale.zero.offload import DiskSwapper, ParamShards
from tinyscale.zero.optimizer import ShardedOptimizer, normalize_param_groups
from tinyscale.zero.stage1 import ZeroStage1
from tinyscale.zero.stage2 import ZeroStage2
from tinyscale.zero.stage3 import ZeroStage3
from tinyscale.zero.state_dict import gather_optimizer_state, load_optimizer_state
from tinyscale.zero.zero_optimizer import ZeroOptimizer

__all__ = ["DiskSwapper", "FlatUnit", "MixedPrecisionPolicy", "ParamShards", "ShardedOptimizer", "ZeroOptimizer", "ZeroStage1", "ZeroStage2", "ZeroStage3",
           "full_parameters", "fully_shard", "gather_optimizer_state", "load_optimizer_state", "normalize_param_groups", "split_into_units"]
