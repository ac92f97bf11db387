"""FlashAttention-2 (Dao 2023) forward and backward in Triton, returning the log-sum-exp.

Attention softmax(Q K^T * scale) V without ever writing the (Tq, Tk) score matrix to memory:
one program owns a block of BM query rows, walks the keys BN at a time, and keeps three
running quantities per row (the online softmax of Milakov & Gimelshein):

    m = max score so far     l = sum of exp(score - m)     acc = sum of exp(score - m) v
    new block s:  m' = max(m, max s);  l = l e^(m - m') + sum e^(s - m');  acc = acc e^(m - m') + e^(s - m') V
    end:          out = acc / l,  lse = m + log l

Memory traffic: Q, K, V read once per query block, out written once: O(T D) instead of the
O(T^2) of materialised scores. The backward recomputes the probabilities from the saved lse
(P = exp(S - lse)) block by block rather than storing them, in two kernels: one program per
key block accumulates dK and dV over every query block (and, with GQA, over the G query
heads that share the K/V head, so no atomics), one per query block accumulates dQ.

Causal blocks stop at the diagonal (keys after the block's last row are never loaded).
Rows that see no key (every key masked) give out 0 and lse -inf, never NaN, so ring
attention can merge blocks with it: `flash_block` and `flash_block_backward` have the
signatures of `tinyscale.context_parallel.merge`'s `block_attention` and
`block_attention_backward`, and the ring uses them where the kernels run.

Shape legend: B batch, H query heads, K key/value heads (G = H / K), Tq queries, Tk keys,
D head dim; BM, BN, BD the tile sizes (powers of two, >= 16 for tl.dot).
Lesson: lessons/11-kernels.md. Tests: `pytest -k kernels_flash`.
"""

import torch

from tinyscale.kernels._triton import jit, tl, triton, use_triton

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.


# --8<-- [start:forward]
@jit
def _fwd(Q, K, V, KEY_OK, O, LSE, scale, Tq, Tk, H, G,
         D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv_base = (b * (H // G) + h // G) * Tk  # this query head's K/V head (GQA: no copy of K/V)
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    q = tl.load(Q + ((bh * Tq + rows) * D)[:, None] + dims[None, :],
                mask=(rows[:, None] < Tq) & (dims[None, :] < D), other=0.0)  # (BM, BD)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    hi = tl.minimum(Tk, (pid_m + 1) * BM) if CAUSAL else Tk  # causal: nothing after the diagonal
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        kmask = cols < Tk
        k = tl.load(K + ((kv_base + cols) * D)[:, None] + dims[None, :],
                    mask=kmask[:, None] & (dims[None, :] < D), other=0.0)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BM, BN)
        ok = kmask & (tl.load(KEY_OK + cols, mask=kmask, other=0) != 0)
        allowed = ok[None, :] & (rows[:, None] < Tq)
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no NaN
        p = tl.exp(s - m_safe[:, None])  # (BM, BN)
        alpha = tl.exp(m - m_safe)
        v = tl.load(V + ((kv_base + cols) * D)[:, None] + dims[None, :],
                    mask=kmask[:, None] & (dims[None, :] < D), other=0.0)  # (BN, BD)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # a row that saw no key: acc is 0, so out 0
    lse = tl.where(l == 0.0, float("-inf"), m + tl.log(tl.where(l == 0.0, 1.0, l)))
    tl.store(O + ((bh * Tq + rows) * D)[:, None] + dims[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < Tq) & (dims[None, :] < D))
    tl.store(LSE + bh * Tq + rows, lse, mask=rows < Tq)
# --8<-- [end:forward]


@jit
def _probs(q, k, lse, rows, cols, Tq, Tk, KEY_OK, scale, CAUSAL: tl.constexpr):
    """P = exp(S - lse) for one (BM, BN) tile, 0 where masked (recomputed in the backward)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    kmask = cols < Tk
    ok = kmask & (tl.load(KEY_OK + cols, mask=kmask, other=0) != 0)
    allowed = ok[None, :] & (rows[:, None] < Tq)
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    return tl.where(allowed, tl.exp(s - lse_safe[:, None]), 0.0)


# --8<-- [start:backward-dkdv]
@jit
def _bwd_dkdv(Q, K, V, KEY_OK, DO, LSE, DELTA, DK, DV, scale, Tq, Tk, H, G,
              D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
    pid_n, bk = tl.program_id(0), tl.program_id(1)  # a key block of K/V head bk (over B x K)
    cols = pid_n * BN + tl.arange(0, BN)
    dims = tl.arange(0, BD)
    kvmask = (cols[:, None] < Tk) & (dims[None, :] < D)
    k = tl.load(K + ((bk * Tk + cols) * D)[:, None] + dims[None, :], mask=kvmask, other=0.0)  # (BN, BD)
    v = tl.load(V + ((bk * Tk + cols) * D)[:, None] + dims[None, :], mask=kvmask, other=0.0)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BD], tl.float32)
    b, kh = bk // (H // G), bk % (H // G)
    lo = (pid_n * BN // BM) * BM if CAUSAL else 0  # causal: earlier query rows never see these keys
    for g in range(0, G):  # every query head that shares this K/V head
        bh = b * H + kh * G + g
        for start in range(lo, Tq, BM):
            rows = start + tl.arange(0, BM)
            qmask = (rows[:, None] < Tq) & (dims[None, :] < D)
            q = tl.load(Q + ((bh * Tq + rows) * D)[:, None] + dims[None, :], mask=qmask, other=0.0)  # (BM, BD)
            do = tl.load(DO + ((bh * Tq + rows) * D)[:, None] + dims[None, :], mask=qmask, other=0.0)
            lse = tl.load(LSE + bh * Tq + rows, mask=rows < Tq, other=0.0)
            delta = tl.load(DELTA + bh * Tq + rows, mask=rows < Tq, other=0.0)
            p = _probs(q, k, lse, rows, cols, Tq, Tk, KEY_OK, scale, CAUSAL)  # (BM, BN)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")  # (BM, BN)
            ds = p * (dp - delta[:, None]) * scale
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    tl.store(DK + ((bk * Tk + cols) * D)[:, None] + dims[None, :], dk.to(DK.dtype.element_ty), mask=kvmask)
    tl.store(DV + ((bk * Tk + cols) * D)[:, None] + dims[None, :], dv.to(DV.dtype.element_ty), mask=kvmask)
# --8<-- [end:backward-dkdv]


@jit
def _bwd_dq(Q, K, V, KEY_OK, DO, LSE, DELTA, DQ, scale, Tq, Tk, H, G,
            D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv_base = (b * (H // G) + h // G) * Tk
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    qmask = (rows[:, None] < Tq) & (dims[None, :] < D)
    q = tl.load(Q + ((bh * Tq + rows) * D)[:, None] + dims[None, :], mask=qmask, other=0.0)
    do = tl.load(DO + ((bh * Tq + rows) * D)[:, None] + dims[None, :], mask=qmask, other=0.0)
    lse = tl.load(LSE + bh * Tq + rows, mask=rows < Tq, other=0.0)
    delta = tl.load(DELTA + bh * Tq + rows, mask=rows < Tq, other=0.0)
    dq = tl.zeros([BM, BD], tl.float32)
    hi = tl.minimum(Tk, (pid_m + 1) * BM) if CAUSAL else Tk
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        kvmask = (cols[:, None] < Tk) & (dims[None, :] < D)
        k = tl.load(K + ((kv_base + cols) * D)[:, None] + dims[None, :], mask=kvmask, other=0.0)
        v = tl.load(V + ((kv_base + cols) * D)[:, None] + dims[None, :], mask=kvmask, other=0.0)
        p = _probs(q, k, lse, rows, cols, Tq, Tk, KEY_OK, scale, CAUSAL)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    tl.store(DQ + ((bh * Tq + rows) * D)[:, None] + dims[None, :], dq.to(DQ.dtype.element_ty), mask=qmask)


# --8<-- [start:reference]
def attention_reference(q, k, v, *, causal_mask_kind: str, scale: float, key_valid=None):
    """The kernels' math in plain PyTorch (scores materialised): out (B, H, Tq, D), lse (B, H, Tq)."""
    B, H, Tq, D = q.shape
    Kh, Tk = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(B, Kh, H // Kh, Tq, D).to(ct)  # query head h -> K/V head h // G
    s = (qg @ k.to(ct).unsqueeze(2).transpose(-2, -1)) * scale  # (B, K, G, Tq, Tk)
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if causal_mask_kind == "causal":
        allowed = allowed.tril()
    if key_valid is not None:
        allowed = allowed & key_valid.to(q.device)[None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, K, G, Tq); -inf on a row that sees no key
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])  # 0 on such rows
    out = p @ v.to(ct).unsqueeze(2)  # (B, K, G, Tq, D)
    return out.reshape(B, H, Tq, D).to(q.dtype), lse.reshape(B, H, Tq)
# --8<-- [end:reference]


# Triton launch options for every flash kernel ({"num_warps": 8, "num_stages": 3}): empty, Triton's
# defaults; scripts/gpu_perf.py sweeps them with the tile size on a GPU (lesson 11).
LAUNCH: dict = {}


def _tiles(D: int, block: int, q: torch.Tensor) -> dict:
    # Half precision at head dim 128 on an H100: 64-row tiles with 2 pipeline stages ran the
    # forward in 2.1 ms against 4.8 ms at 32 rows (Triton's default 3 stages: 1.9 ms forward but
    # 10.2 ms with the backward, against 8.1), measured by scripts/gpu_perf.py tiles (lesson 11).
    launch = {"num_stages": 2} if q.is_cuda and q.dtype != torch.float32 and D > 64 else {}
    return dict(D=D, BD=max(16, triton.next_power_of_2(D)), BM=block, BN=block, **{**launch, **LAUNCH})


def _block(q: torch.Tensor, block: int | None) -> int:
    """Query/key tile: 16 under the CPU interpreter (tiny tiles run fastest there); on a GPU 64,
    or 32 in float32 (three 64-row float32 tiles at head dim 128 are too big for shared memory).
    Half precision at head dim 128 was 32 until an H100 sweep (`_tiles`, lesson 11)."""
    if block is not None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"flash attention: block={block} must be a power of two >= 16 (tl.dot's minimum)")
        return block
    if not q.is_cuda:
        return 16
    return 32 if q.dtype == torch.float32 else 64


def _key_ok(key_valid, Tk: int, device) -> torch.Tensor:
    if key_valid is None:
        return torch.ones(Tk, dtype=torch.int8, device=device)
    return key_valid.to(device=device, dtype=torch.int8).contiguous()


def _check(q, k, v, causal_mask_kind: str) -> None:
    B, H, Tq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(f"flash attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         "(B, H, Tq, D), (B, K, Tk, D), (B, K, Tk, D) with H a multiple of K")
    if causal_mask_kind not in ("full", "causal"):
        raise ValueError(f"causal_mask_kind={causal_mask_kind!r} is unknown: use 'full' or 'causal'")
    if causal_mask_kind == "causal" and Tq != k.shape[2]:
        raise ValueError(f"a causal (diagonal) block needs as many queries as keys, got {Tq} and {k.shape[2]}")


def flash_block(q, k, v, *, causal_mask_kind: str, scale: float, key_valid=None, block: int | None = None):
    """`block_attention`'s contract with the Triton kernel: out (B, H, Tq, D), lse (B, H, Tq) float32."""
    _check(q, k, v, causal_mask_kind)
    if not kernel_ok(q):
        return attention_reference(q, k, v, causal_mask_kind=causal_mask_kind, scale=scale, key_valid=key_valid)
    B, H, Tq, D = q.shape
    Kh, Tk = k.shape[1], k.shape[2]
    block = _block(q, block)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    _fwd[(triton.cdiv(Tq, block), B * H)](q, k, v, _key_ok(key_valid, Tk, q.device), out, lse, scale, Tq, Tk, H,
                                          H // Kh, CAUSAL=causal_mask_kind == "causal", **_tiles(D, block, q))
    return out, lse


def flash_block_backward(dout, q, k, v, out, lse, *, causal_mask_kind: str, scale: float, key_valid=None,
                         block: int | None = None):
    """`block_attention_backward`'s contract: given the rows' merged out and lse -> dq, dk, dv."""
    _check(q, k, v, causal_mask_kind)
    if not kernel_ok(q):
        raise RuntimeError("flash_block_backward needs Triton (a GPU, or TRITON_INTERPRET=1 on the CPU) and a "
                           f"float32/16 q, got {q.dtype} on {q.device}; use autograd through attention_reference")
    B, H, Tq, D = q.shape
    Kh, Tk = k.shape[1], k.shape[2]
    block = _block(q, block)
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    # delta = rowsum(dO * O) = sum_j P_ij dP_ij: one small pass in torch before the kernels
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, H, Tq)
    lse = lse.float().contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    key_ok, causal, tiles = _key_ok(key_valid, Tk, q.device), causal_mask_kind == "causal", _tiles(D, block, q)
    _bwd_dkdv[(triton.cdiv(Tk, block), B * Kh)](q, k, v, key_ok, dout, lse, delta, dk, dv, scale, Tq, Tk, H,
                                                H // Kh, CAUSAL=causal, **tiles)
    _bwd_dq[(triton.cdiv(Tq, block), B * H)](q, k, v, key_ok, dout, lse, delta, dq, scale, Tq, Tk, H, H // Kh,
                                             CAUSAL=causal, **tiles)
    return dq, dk, dv


def kernel_ok(q: torch.Tensor) -> bool:
    """The kernels run for `q`: Triton can run here, in float32, or fp16/bf16 on a GPU (the
    CPU interpreter's reduced-precision paths are not trustworthy; float64 stays in PyTorch)."""
    if not use_triton(q):
        return False
    return q.dtype == torch.float32 or (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16))


class FlashAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v with the forward and backward kernels; returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        kind = "causal" if causal else "full"
        out, lse = flash_block(q, k, v, causal_mask_kind=kind, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kind, ctx.scale = kind, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_block_backward(dout, q, k, v, out, lse, causal_mask_kind=ctx.kind, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def flash_attention(q, k, v, *, causal: bool = True, scale: float | None = None):
    """Attention of q (B, H, T, D) over k, v (B, K, T, D) -> (out (B, H, T, D), lse (B, H, T)):
    the kernels where they run, else the reference through autograd."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not kernel_ok(q):
        return attention_reference(q, k, v, causal_mask_kind="causal" if causal else "full", scale=scale)
    return FlashAttention.apply(q, k, v, causal, scale)
