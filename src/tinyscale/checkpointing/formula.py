"""Activation bytes per transformer layer: Korthikanti et al.'s formula, and ours for our block.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022,
arXiv:2205.05198), in their analysis of activation memory per transformer layer, count
the bytes a GPT-3-style layer (LayerNorm, GeLU MLP of width 4h, 16-bit activations,
1-byte dropout masks) saves for backward:

    sbh (34 + 5 a s / h)      s sequence, b micro-batch, h hidden size, a heads

Our block (models/gpt.py) is Llama-style, so the count changes; every term below is one
tensor that `saved_tensors` lists (tests/checkpointing/test_formula.py checks the sum to
the byte). p = bytes per element (4 float32, 8 float64), d = 1 if dropout > 0 else 0,
F = ffn width, kv = K * D (key/value width), on a CPU (where dropout saves a p-byte
scaled mask, not a 1-byte one as on a GPU):

    RMSNorm x2   input, normalised input, 1/rms (s b elements)    p (4 sbh + 2 sb)
    attention    norm output (shared by wq, wk, wv), q, repeated
                 k and v, wo's input; residual dropout mask         p (5 + d) sbh
    core (math)  softmax out; with dropout: mask, dropped probs     p (1 + 2d) a s^2 b
                 causal mask (bool, s x s; "sdpa" has none)         s^2
    SwiGLU       norm output, residual dropout mask                 p (1 + d) sbh
                 gate pre-activation, silu(gate), up, w_down input  p 4 sbF

    total (math) p [(10 + 2d) sbh + 4 sbF + 2 sb + (1 + 2d) a s^2 b] + s^2

With "sdpa" and no dropout the CPU kernel is FlashAttention-like: the three s^2 terms
become one log-sum-exp of a s b elements. In Korthikanti's units (p = 2, 1-byte masks,
F = 8h/3) our block is sbh (43.3 + 5 a s / h) + 4 sb: the same 5as/h, and 9.3 more sbh
from SwiGLU's extra matrix and RMSNorm keeping its normalised input.
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.
"""

from __future__ import annotations

import torch

from tinyscale.models.config import GPTConfig


def korthikanti_layer_bytes(seq: int, batch: int, hidden: int, heads: int) -> float:
    """sbh(34 + 5as/h): one GPT-3-style layer's saved activations in bytes (16-bit)."""
    s, b, h, a = seq, batch, hidden, heads
    return s * b * h * (34 + 5 * a * s / h)


# --8<-- [start:block-formula]
def block_saved_bytes(cfg: GPTConfig, batch: int, seq: int, dtype: torch.dtype, policy: str = "none") -> int:
    """Bytes one block of our GPT saves for backward in training mode on a CPU, per policy
    (parameters and buffers not counted; "offload": what stays on the device)."""
    p = torch.finfo(dtype).bits // 8
    s, b, h, a, F, kv = seq, batch, cfg.d_model, cfg.n_head, cfg.ffn_dim, cfg.kv_dim
    d = 1 if cfg.dropout > 0 else 0
    norms = 4 * s * b * h + 2 * s * b  # two RMSNorms: input, normalised input, 1/rms
    mlp = 4 * s * b * F  # gate pre-activation, silu(gate), up, w_down's input
    if policy == "full":
        return p * s * b * h  # the block's input
    if policy == "offload":
        return 0
    if policy == "selective":  # attention core's inputs q, k, v kept; its insides recomputed
        return p * (norms + (4 + 2 * d) * s * b * h + 2 * s * b * kv + mlp)
    if policy != "none":
        raise ValueError(f"policy {policy!r}: block_saved_bytes knows none, full, selective, offload")
    linear_inputs = (6 + 2 * d) * s * b * h  # norm outputs x2, q, k, v, wo input, dropout masks
    if cfg.attn_impl == "sdpa" and d == 0:  # fused kernel: output's log-sum-exp, (B, H, T)
        return p * (norms + linear_inputs + mlp + a * s * b)
    core = p * (1 + 2 * d) * a * s * s * b  # softmax output (+ dropout mask, dropped probs)
    causal_mask = s * s if cfg.attn_impl == "math" else 0  # bool (T, T)
    return p * (norms + linear_inputs + mlp) + core + causal_mask
# --8<-- [end:block-formula]


def model_saved_bytes_drop(cfg: GPTConfig, batch: int, seq: int, dtype: torch.dtype, policy: str,
                           every_k: int | None = None) -> int:
    """How many bytes fewer the whole GPT saves under `policy` than under "none"."""
    none = block_saved_bytes(cfg, batch, seq, dtype, "none")
    if policy == "every_k":
        if not isinstance(every_k, int) or every_k < 1:
            raise ValueError(f"every_k={every_k!r}: a positive int is needed for policy 'every_k'")
        changed, per_block = cfg.n_layer // every_k, block_saved_bytes(cfg, batch, seq, dtype, "full")
    elif policy == "none":
        changed, per_block = 0, none
    else:
        changed, per_block = cfg.n_layer, block_saved_bytes(cfg, batch, seq, dtype, policy)
    return changed * (none - per_block)
