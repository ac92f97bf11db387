"""`CausalLMLoss`: a language model that returns logits (a transformers `...ForCausalLM`) made into
the engine's kind of model, whose `forward(*batch)` returns the batch's mean loss.

    model = CausalLMLoss(LlamaForCausalLM(LlamaConfig(...)))   # nothing downloaded: random weights
    engine = ts.initialize(model, config)                      # parallel.tensor > 1: AutoTP
    engine.train_batch((idx, targets))                         # targets: idx shifted by one

The loss is the mean next-token cross-entropy over every position of every row, as the GPT's
(so the mean over rows of each row's mean is the global mean, whatever the rows' split).
Lesson 12, "Module injection: AutoTP".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# --8<-- [start:causal-lm-loss]
class CausalLMLoss(nn.Module):
    """forward(idx (B, T), targets (B, T)) -> the mean cross-entropy of `lm(input_ids=idx).logits`."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=idx, use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # mean over B*T
# --8<-- [end:causal-lm-loss]
