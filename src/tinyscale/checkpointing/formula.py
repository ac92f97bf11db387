"""Activation bytes per transformer layer: Korthikanti et al.'s formula, and ours for our block.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022,
arXiv:2205.05198), in their analysis of activation memory per transformer layer, count
the bytes a GPT-3-style layer (LayerNorm, GeLU MLP of width 4h, 16-bit activations,
1-byte dropout masks) saves for backward:

    sbh (34 + 5 a s / h)      s sequence, b micro-batch, h hidden size, a heads

Our block (models/gpt.py) is Llama-style, so the count changes; every term below is one
tensor that `saved_tensors` lists (tests/checkpointing/test_memory.py checks the sum to the
byte, in float32, float64, bf16 and fp16). p = bytes per element of the compute dtype (2 bf16
or fp16, 4 float32, 8 float64); u = bytes of the dtype the block computes its norms and softmax
in, at least float32 (`models.gpt.compute_dtype`: u = max(p, 4)); d = 1 if dropout > 0 else 0,
F = ffn width, kv = K * D (key/value width), on a CPU (where dropout saves a p-byte scaled
mask, not a 1-byte one as on a GPU):

    RMSNorm x2   input upcast to u (at p >= 4: the input itself), 1/rms (s b elements)
                                                                    u (2 sbh + 2 sb)
                 normalised input, cast back to p                   p 2 sbh
    attention    norm output (shared by wq, wk, wv), q, repeated
                 k and v, wo's input; residual dropout mask         p (5 + d) sbh
    core (math)  softmax output (computed in u)                     u a s^2 b
                 with dropout: mask, dropped probs; without, the
                 probs cast back to p for P V when p < u            p (2d or [p < u]) a s^2 b
                 causal mask (bool, s x s; "sdpa" has none)         s^2
    SwiGLU       norm output, residual dropout mask                 p (1 + d) sbh
                 gate pre-activation, silu(gate), up, w_down input  p 4 sbF

    total (math) u (2 sbh + 2 sb + a s^2 b) + p [(8 + 2d) sbh + 4 sbF + (2d or [p < u]) a s^2 b] + s^2

With "sdpa" and no dropout the CPU kernel is FlashAttention-like: the s^2 terms become one
log-sum-exp of a s b elements, in u. With "sdpa" and dropout torch's CPU fallback computes in
u: q, k, v and the three s^2 terms (softmax, mask, dropped probs) are u bytes each, no causal
mask. At p >= 4 (u = p) all of this is the single-dtype count p [(10 + 2d) sbh + 4 sbF + 2 sb
+ (1 + 2d) a s^2 b] + s^2. In Korthikanti's units (every tensor 2 bytes, 1-byte masks,
F = 8h/3) our block is sbh (43.3 + 5 a s / h) + 4 sb: the same 5as/h, and 9.3 more sbh from
SwiGLU's extra matrix and RMSNorm keeping its normalised input. Our bf16 block keeps more than
that: its norms' inputs and 1/rms and its softmax (or log-sum-exp) are float32.
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
def upcast_bytes(p: int) -> int:
    """u: bytes per element of what our GPT computes in at least float32 (norms, softmax, the
    loss; `models.gpt.compute_dtype`) when its compute dtype has p bytes: 4 under bf16 / fp16."""
    return max(p, 4)


def block_saved_bytes(cfg: GPTConfig, batch: int, seq: int, dtype: torch.dtype, policy: str = "none") -> int:
    """Bytes one block of our GPT saves for backward in training mode on a CPU, per policy
    (parameters and buffers not counted; "offload": what stays on the device)."""
    p = dtype.itemsize
    u = upcast_bytes(p)  # the norms' upcast input and 1/rms, the softmax, the log-sum-exp
    s, b, h, a, F, kv = seq, batch, cfg.d_model, cfg.n_head, cfg.ffn_dim, cfg.kv_dim
    d = 1 if cfg.dropout > 0 else 0
    norms = u * (2 * s * b * h + 2 * s * b) + p * 2 * s * b * h  # two RMSNorms: input, 1/rms; normalised input
    mlp = p * 4 * s * b * F  # gate pre-activation, silu(gate), up, w_down's input
    if policy == "full":
        return p * s * b * h  # the block's input
    if policy == "offload":
        return 0
    if policy == "selective":  # attention core's inputs q, k, v kept; its insides recomputed
        return norms + p * ((4 + 2 * d) * s * b * h + 2 * s * b * kv) + mlp
    if policy != "none":
        raise ValueError(f"policy {policy!r}: block_saved_bytes knows none, full, selective, offload")
    outs = p * (3 + 2 * d) * s * b * h  # norm outputs x2, wo's input, residual dropout masks
    qkv = 3 * s * b * h  # q, k and v repeated to every query head
    if cfg.attn_impl == "sdpa" and d == 0:  # fused kernel: output's log-sum-exp, (B, H, T), in u
        return norms + outs + p * qkv + mlp + u * a * s * b
    if cfg.attn_impl == "sdpa":  # torch's CPU fallback for dropout computes in u: q, k, v, softmax, mask, probs
        return norms + outs + u * (qkv + 3 * a * s * s * b) + mlp
    probs = 2 * d if d else int(p < u)  # dropout's mask and dropped probs, or the probs cast back to p
    core = (u + p * probs) * a * s * s * b  # softmax output (in u) and those
    causal_mask = s * s  # bool (T, T)
    return norms + outs + p * qkv + mlp + core + causal_mask
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
