"""The exercise topics: which functions of which module a learner writes, and which tests judge them.

A topic's name is also its `pytest -k` key: `pytest --impl exercises -k zero3`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

HAS_TRITON = importlib.util.find_spec("triton") is not None  # found, not imported: the CLI starts fast


@dataclass(frozen=True)
class Topic:
    name: str  # the topic and its pytest -k key
    module: str  # the tinyscale module whose functions the learner rewrites
    stubs: tuple[str, ...]  # functions ("name") and methods ("Class.name") whose bodies are removed
    tests: tuple[str, ...]  # test files that judge it (under --impl, only these run)
    quick: tuple[str, ...]  # a fast subset (node ids): tests/course checks stubs fail them, ours pass
    lesson: str  # where the technique is explained
    ranks: bool  # do the quick tests run on rank processes (slower: a failing rank restarts the pool)

    @property
    def filename(self) -> str:
        return self.module.rsplit(".", 1)[1] + ".py"


TOPICS = {t.name: t for t in (
    Topic("ring_allreduce", "tinyscale.collectives.ring",
          ("_reduce_scatter_chunks", "_all_gather_chunks"),
          ("tests/collectives/test_ring.py", "tests/collectives/test_allreduce.py"),
          ("tests/collectives/test_ring.py::test_ring_allreduce_each_round_sends_one_chunk_to_the_right_neighbour",),
          "lessons/01-collectives.md", True),
    Topic("bucketed", "tinyscale.data_parallel.bucketed",
          ("BucketedDDP._grad_ready", "BucketedDDP._launch", "BucketedDDP._finish_backward"),
          ("tests/data_parallel/test_ddp.py",),
          ("tests/data_parallel/test_ddp.py::test_ddp_bucketed_issues_one_allreduce_per_bucket[25.0-1]",),
          "lessons/02-data-parallel.md", True),
    Topic("zero1", "tinyscale.zero.stage1",
          ("ZeroStage1._launch", "ZeroStage1.step"),
          ("tests/zero/test_zero_stages.py",),
          ("tests/zero/test_zero_stages.py::test_zero1_agrees_with_torch_zero_redundancy_optimizer[2]",),
          "lessons/03-zero.md", True),
    Topic("zero3", "tinyscale.zero.stage3",
          ("ZeroStage3._materialize", "ZeroStage3._free", "ZeroStage3._reduce"),
          ("tests/zero/test_zero3.py",),
          ("tests/zero/test_zero3.py::test_zero3_in_one_process_matches_the_reference",),
          "lessons/03-zero.md", False),
    Topic("scaler", "tinyscale.precision.scaler",
          ("found_overflow", "LossScaler.unscale_", "DynamicLossScaler.update"),
          ("tests/precision/test_scaler.py",),
          ("tests/precision/test_scaler.py::test_mixed_precision_scaler_follows_deepspeed_hysteresis[tinyscale]",),
          "lessons/04-mixed-precision.md", False),
    Topic("activation_checkpoint", "tinyscale.checkpointing.reentrant",
          ("ReentrantCheckpoint.forward", "ReentrantCheckpoint.backward"),
          ("tests/checkpointing/test_checkpoint.py",),
          ("tests/checkpointing/test_checkpoint.py::test_activation_checkpoint_multiple_outputs[reentrant]",),
          "lessons/05-activation-checkpointing.md", False),
    Topic("mfu", "tinyscale.mfu.mfu",
          ("mfu", "hfu"),
          ("tests/mfu/test_mfu.py",),
          ("tests/mfu/test_mfu.py::test_mfu_on_a_synthetic_timing_equals_counted_flops_over_time_and_peak",),
          "lessons/06-mfu.md", False),
    Topic("tp_column_row", "tinyscale.tensor_parallel.layers",
          ("ColumnParallelLinear.forward", "RowParallelLinear.forward"),
          ("tests/tensor_parallel/test_tp_layers.py",),
          ("tests/tensor_parallel/test_tp_layers.py::test_tp_column_row_match_dense[False-False-2]",),
          "lessons/07-tensor-parallel.md", True),
    Topic("pp_1f1b", "tinyscale.pipeline.schedules",
          ("one_f_one_b",),
          ("tests/pipeline/test_schedules.py",),
          ("tests/pipeline/test_schedules.py::test_pp_1f1b_order_by_hand",),
          "lessons/08-pipeline-parallel.md", False),
    Topic("cp_merge", "tinyscale.context_parallel.merge",
          ("merge_lse", "merge_partials"),
          ("tests/context_parallel/test_cp_merge.py",),
          ("tests/context_parallel/test_cp_merge.py::test_cp_merge_of_two_key_blocks_equals_attention_over_all_keys[1]",),
          "lessons/09-context-parallel.md", False),
    Topic("moe_dispatch", "tinyscale.moe.dispatch",
          ("dispatch", "combine"),
          ("tests/moe/test_moe.py", "tests/moe/test_expert_parallel.py"),
          ("tests/moe/test_moe.py::test_moe_dispatch_then_combine_is_each_tokens_weighted_sum",),
          "lessons/13-moe.md", False),
    # Triton kernels (only with Triton installed: without it their tests skip, and nothing runs a stub):
    # the stubs raise inside the @jit functions, which the CPU runs in Triton's interpreter
    *([Topic("kernels_rmsnorm", "tinyscale.kernels.rmsnorm",
          ("_rms_forward", "_rms_backward"),
          ("tests/kernels/test_kernels.py",),
          ("tests/kernels/test_kernels.py::test_kernels_rmsnorm_forward_and_backward_equal_the_reference",),
          "lessons/11-kernels.md", False)] if HAS_TRITON else []),
)}
