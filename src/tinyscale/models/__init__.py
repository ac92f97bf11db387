"""The models every topic trains: a Llama-style GPT and a tiny MLP with tied and frozen parameters.

    from tinyscale.models import GPT, GPTConfig, PRESETS, TinyMLP
    model = GPT(GPTConfig.preset("tiny"), seed=0, dtype=torch.float64)
    loss = model(inputs, targets)   # scalar: mean cross-entropy over all B*T positions

With GPTConfig(dropout=p, dropout_masks="counter") the masks are hashed from global
coordinates (`models/dropout.py`); a training loop of your own tells the model each step and
micro-batch's first global row with `set_dropout_clock` (the reference trainer and the engine do).
`CausalLMLoss(lm)` makes a model that returns logits (a transformers Llama) return the loss.
"""

from tinyscale.models.causal_lm import CausalLMLoss
from tinyscale.models.config import PRESETS, GPTConfig
from tinyscale.models.dropout import DropoutClock, set_dropout_clock
from tinyscale.models.gpt import (
    GPT,
    Attention,
    Block,
    RMSNorm,
    SwiGLU,
    apply_rope,
    causal_attention,
    rope_tables,
)
from tinyscale.models.mlp import TinyMLP

__all__ = [
    "GPT",
    "GPTConfig",
    "PRESETS",
    "TinyMLP",
    "Attention",
    "Block",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "causal_attention",
    "rope_tables",
    "DropoutClock",
    "set_dropout_clock",
    "CausalLMLoss",
]
