"""The planner: which layout to run on a cluster, and short trials to pick among the best.

    from tinyscale.planner import Cluster, Layout, estimate, plan
    result = plan("llama2-70b", Cluster(gpus=512), global_batch=1024, seq_len=4096)

- `cluster.py`: GPUs, nodes, memory, peak, and the alpha-beta cost of a collective per link.
- `models.py`: the presets (GPT-2 to Megatron's 1T) and sizes given on the command line.
- `estimate.py`: one layout's memory per GPU (model states exactly as the engine holds them,
  activations per policy, tp/SP/cp and schedule) and step time (FLOPs, collectives, bubble; an
  MoE GPT's experts, all-to-alls and expert-data-parallel reduction).
- `search.py`: every layout (ep too, for an MoE GPT), the ones that fit, ranked, and why each
  runner-up lost.
- `topology.py`: `nvidia-smi topo -m` to link bandwidths and the placement of tp/cp groups.
- `autotune.py`: short trials of the planner's best candidates on the ranks at hand.
- `measure.py`: the ranks at hand measured (matmul peak, gloo's alpha and beta, host overhead).
- `report.py`: `tinyscale plan`'s flags and tables.

Composes the engine (`engine.layout_memory`, `engine.plan`), `tinyscale.mfu`, the pipeline's
schedules and simulator and `checkpointing.formula`, as `engine/` composes the topics.
Lesson: lessons/12-engine.md ("Planning a run"), lessons/13-moe.md ("Choosing ep").
Tests: `pytest -k "planner or topology or autotune"` (`-k planner_ep`: expert parallelism).
"""

from tinyscale.planner.cluster import Cluster, Link
from tinyscale.planner.estimate import Estimate, Layout, estimate, layer_activation_bytes
from tinyscale.planner.models import PLANNER_PRESETS, resolve_model
from tinyscale.planner.search import PlanResult, plan, why_lost

__all__ = ["PLANNER_PRESETS", "Cluster", "Estimate", "Layout", "Link", "PlanResult", "estimate",
           "layer_activation_bytes", "plan", "resolve_model", "why_lost"]
