"""Attention on one block of keys, returning its log-sum-exp, and the rule that merges blocks.

Softmax over all keys can be computed a block of keys at a time (Milakov & Gimelshein,
"Online normalizer calculation for softmax"; Dao et al., FlashAttention, sec. 3.1): for
each block keep the normalised output `o` and the row log-sum-exp `lse = log sum_j exp(s_j)`.
Two blocks merge exactly:

    lse = log(exp(lse_a) + exp(lse_b))                    computed as m + log(e^(lse_a-m) + e^(lse_b-m)), m = max
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

Subtracting the max keeps it finite however far one block dominates; a row that sees no key
in a block has lse = -inf there and weight 0, and a row that sees none at all gets o = 0.

`block_attention` (and its hand-written backward, which recomputes the probabilities from
the merged lse, as FlashAttention does) is the one function a Triton kernel replaces.

Shape legend: B batch, H query heads, K key/value heads (H % K == 0, G = H / K queries per
K/V head: GQA without repeating K/V), Tq query rows, Tk keys, D head dim.
Lesson: lessons/09-context-parallel.md. Tests: `pytest tests/context_parallel -k cp_merge`.
"""

from __future__ import annotations

import torch

MASK_KINDS = ("full", "causal")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row with no visible key) -> 0, so `x - that` stays -inf instead of NaN."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


def check_mask_kind(Tq: int, Tk: int, kind: str) -> None:
    """Raise unless `kind` is known and, if causal, the block is square (nothing is built)."""
    if kind not in MASK_KINDS:
        raise ValueError(f"causal_mask_kind={kind!r} is unknown: use one of {MASK_KINDS}")
    if kind == "causal" and Tq != Tk:
        raise ValueError(f"a causal (diagonal) block needs as many queries as keys, got {Tq} and {Tk}")


def _mask(Tq: int, Tk: int, kind: str, key_valid: torch.Tensor | None, device) -> torch.Tensor | None:
    """(Tq, Tk) bool, True where query i may see key j; None when every pair is visible."""
    check_mask_kind(Tq, Tk, kind)
    allowed = None
    if kind == "causal":
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril()  # key j <= query i
    if key_valid is not None:
        keys = key_valid.to(device)[None, :].expand(Tq, Tk)  # padded keys are never visible
        allowed = keys if allowed is None else allowed & keys
    return allowed


def _scores(q, k, scale, kind, key_valid):
    """(B, K, G, Tq, Tk) scaled scores in at least float32, masked entries -inf."""
    B, H, Tq, D = q.shape
    K, Tk = k.shape[1], k.shape[2]
    ct = _compute_dtype(q.dtype)
    qg = q.reshape(B, K, H // K, Tq, D).to(ct)  # query head h = kv head h // G, member h % G
    s = (qg @ k.to(ct).unsqueeze(2).transpose(-2, -1)) * scale  # (B,K,G,Tq,D) @ (B,K,1,D,Tk) -> (B,K,G,Tq,Tk)
    allowed = _mask(Tq, Tk, kind, key_valid, q.device)
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


# --8<-- [start:block-attention]
def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal_mask_kind: str,
                    scale: float, key_valid: torch.Tensor | None = None,
                    dropout_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v over this block's keys, and its lse. q (B, H, Tq, D); k, v
    (B, K, Tk, D); key_valid (Tk,) bool or None -> out (B, H, Tq, D), lse (B, H, Tq).

    dropout_scale (B, H, Tq, Tk), 0 or 1/(1-p): dropout on the probabilities, as FlashAttention
    drops them: the output uses the dropped ones, lse the undropped (the merge rule is linear
    in each block's output, so merged blocks equal dropout after the full softmax).
    Rows that see no key get out 0 and lse -inf. Differentiable by autograd (Ulysses uses
    that); the ring uses `block_attention_backward` instead."""
    B, H, Tq, D = q.shape
    s = _scores(q, k, scale, causal_mask_kind, key_valid)  # (B, K, G, Tq, Tk)
    lse = torch.logsumexp(s, dim=-1)  # (B, K, G, Tq); -inf where a row sees nothing
    probs = torch.exp(s - _finite_or_zero(lse)[..., None])  # (B, K, G, Tq, Tk); all 0 on such rows
    if dropout_scale is not None:
        probs = probs * dropout_scale.to(probs.dtype).reshape(probs.shape)  # (B, H, ..) -> (B, K, G, ..)
    out = probs @ v.to(s.dtype).unsqueeze(2)  # (B,K,G,Tq,Tk) @ (B,K,1,Tk,D) -> (B,K,G,Tq,D)
    return out.reshape(B, H, Tq, D).to(q.dtype), lse.reshape(B, H, Tq)
# --8<-- [end:block-attention]


def block_attention_backward(dout, q, k, v, out, lse, *, causal_mask_kind: str, scale: float,
                             key_valid: torch.Tensor | None = None, dropout_scale: torch.Tensor | None = None):
    """Gradients of one block, given the *merged* out and lse of the rows (so the block's
    probabilities are its share of the full softmax). dout, out (B, H, Tq, D); lse (B, H, Tq)
    -> dq (B, H, Tq, D), dk, dv (B, K, Tk, D), in at least float32. With dropout_scale M (as in
    `block_attention`): dV = (P o M)^T dO, dP = (dO V^T) o M, and rowsum(P o dP) is still
    rowsum(dO o O), so the softmax backward below is unchanged."""
    B, H, Tq, D = q.shape
    K = k.shape[1]
    G = H // K
    s = _scores(q, k, scale, causal_mask_kind, key_valid)  # (B, K, G, Tq, Tk)
    ct = s.dtype
    p = torch.exp(s - _finite_or_zero(lse.to(ct)).reshape(B, K, G, Tq, 1))  # P_ij of the full softmax
    do = dout.to(ct).reshape(B, K, G, Tq, D)
    m = None if dropout_scale is None else dropout_scale.to(ct).reshape(p.shape)  # (B, K, G, Tq, Tk)
    dv = ((p if m is None else p * m).transpose(-2, -1) @ do).sum(2)  # (B,K,G,Tk,Tq) @ (B,K,G,Tq,D) -> (B,K,Tk,D)
    dp = do @ v.to(ct).unsqueeze(2).transpose(-2, -1)  # (B,K,G,Tq,D) @ (B,K,1,D,Tk) -> (B,K,G,Tq,Tk)
    dp = dp if m is None else dp * m
    delta = (do * out.to(ct).reshape(B, K, G, Tq, D)).sum(-1, keepdim=True)  # rowsum(dO o O) = sum_j P dP
    ds = p * (dp - delta) * scale  # (B, K, G, Tq, Tk): softmax backward
    dq = ds @ k.to(ct).unsqueeze(2)  # (B,K,G,Tq,Tk) @ (B,K,1,Tk,D) -> (B,K,G,Tq,D)
    dk = (ds.transpose(-2, -1) @ q.to(ct).reshape(B, K, G, Tq, D)).sum(2)  # -> (B, K, Tk, D)
    return dq.reshape(B, H, Tq, D), dk, dv


# --8<-- [start:merge]
def merge_lse(lse_a: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """log(exp(lse_a) + exp(lse_b)) without overflow; -inf only if both are -inf."""
    m = _finite_or_zero(torch.maximum(lse_a, lse_b))  # the larger one: its exp is 1, never inf
    return m + torch.log(torch.exp(lse_a - m) + torch.exp(lse_b - m))


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' (out (..., Tq, D), lse (..., Tq)) -> those of attention over both blocks."""
    lse = merge_lse(lse_a, lse_b)
    ref = _finite_or_zero(lse)  # rows that saw nothing in either block: weights exp(-inf) = 0
    w_a = torch.exp(lse_a - ref)[..., None]  # (..., Tq, 1): block a's share of the softmax mass
    w_b = torch.exp(lse_b - ref)[..., None]
    return w_a * out_a + w_b * out_b, lse
# --8<-- [end:merge]
