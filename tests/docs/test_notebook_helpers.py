"""The notebooks' rank helpers build what their lessons say (checked here, in seconds, not only when
`make notebooks` executes the notebooks).

Notebook 02's "Adam with L2" row silently trained AdamW for days: a DeepSpeed-style "Adam" config
with weight decay decouples it unless `adam_w_mode` is false (as DeepSpeed does), and the helper's
config did not say so; lesson 02's L2 claim then went unshown.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from tinyscale.config import OptimizerConfig
from tinyscale.optim import build_optimizer

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_notebook_{name}", NOTEBOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_notebook_02_optimizers_are_the_torch_classes_lesson_02_compares():
    """sgd: torch's SGD; adamw: AdamW (decay decoupled); adam_l2: torch's Adam with the decay
    added to the gradient (L2), not AdamW."""
    ddp_ranks = _load("ddp_ranks")
    params = [torch.nn.Parameter(torch.zeros(2))]
    built = {name: type(build_optimizer(params, OptimizerConfig.model_validate(cfg)))
             for name, cfg in ddp_ranks.OPTIMIZERS.items()}
    assert built == {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam_l2": torch.optim.Adam}, built
    assert build_optimizer(params, OptimizerConfig.model_validate(ddp_ranks.OPTIMIZERS["adam_l2"])) \
        .param_groups[0]["weight_decay"] > 0  # L2 on: the row shows what L2 does
