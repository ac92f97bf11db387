"""Context parallelism: one sequence split over ranks, attention computed across them.

| file | what |
| --- | --- |
| `sharding.py` | contiguous and zigzag layouts, RoPE positions, padding, per-block causal plan, attention work |
| `merge.py` | attention on a block with its log-sum-exp, and the exact merge of two blocks |
| `ring.py` | ring attention (K/V passed around the ring; dK/dV passed back in the backward) |
| `ulysses.py` | DeepSpeed-Ulysses (all-to-all sequence -> heads, local attention, all-to-all back) |
| `apply.py` | `apply_context_parallel(model, group, ...)` for the GPT, `shard_batch`, `reduce_cp_grads` |

Shape legend: B batch, H query heads, K key/value heads, T sequence length, Tl per-rank
length, D head dim. Lesson: lessons/09-context-parallel.md. Tests:
`pytest tests/context_parallel` (keys: ring_attention, ulysses, zigzag, cp).
"""

from tinyscale.context_parallel.apply import (
    ALGORITHMS,
    ContextParallel,
    apply_context_parallel,
    reduce_cp_grads,
    shard_batch,
)
from tinyscale.context_parallel.merge import block_attention, block_attention_backward, merge_lse, merge_partials
from tinyscale.context_parallel.ring import RingAttention, ring_attention
from tinyscale.context_parallel.sharding import (
    IGNORE_INDEX,
    SHARDINGS,
    Layout,
    attention_work,
    block_plan,
    plan_work,
    shard,
    unshard,
)
from tinyscale.context_parallel.ulysses import HeadToSeq, SeqToHead, kv_replication, ulysses_attention

__all__ = [
    "ALGORITHMS",
    "IGNORE_INDEX",
    "SHARDINGS",
    "ContextParallel",
    "HeadToSeq",
    "Layout",
    "RingAttention",
    "SeqToHead",
    "apply_context_parallel",
    "attention_work",
    "block_attention",
    "block_attention_backward",
    "block_plan",
    "kv_replication",
    "merge_lse",
    "merge_partials",
    "plan_work",
    "reduce_cp_grads",
    "ring_attention",
    "shard",
    "shard_batch",
    "ulysses_attention",
    "unshard",
]
