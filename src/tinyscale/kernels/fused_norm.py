"""Fused dropout + residual + LayerNorm (DS-32): the pre-norm block's hot path in one pass.

    h = residual + dropout(x + bias)        the new residual stream
    y = LayerNorm(h) * weight + ln_bias     the next sub-layer's input

Eager PyTorch runs it as add, dropout (which writes its boolean mask), add, layer_norm:
each a pass over a (rows, C) tensor. The kernel gives one program per row: it loads x and the
residual once, keeps or drops each element, adds, reduces the row's mean and variance in
registers and stores h and y (plus a float32 mean and rstd per row). Returns (y, h).

The dropout mask is the counter mask of `tinyscale.models.dropout` (splitmix64 chained over the
element's coordinates), computed inside the kernel: an element at batch row b, token t and
feature c is kept when hash(key; rows[b], positions[t], c) / 2^53 >= p, with `key` the site's
`site_key(seed, step, layer, site)`. So the kernel drops exactly what the eager model's
`residual_dropout` drops for the same clock (`counter_site` builds the coordinates from a
`DropoutClock`). Kept elements are scaled by 1/(1-p): each element has its own counter, so no
two elements of a row share a draw, and the keep probability is 1-p.

The backward recomputes the mask from the same counter rather than storing it: the forward
then writes only y and h (an (R, C) bool mask would be one more byte per element written and
read back, a quarter more than the bf16 forward's 8 bytes per element), and, like the model's
activation recomputation, redraws it from nothing but the coordinates. The cost is the hash's
three 64-bit multiply-xorshift rounds per element, again. The backward saves h (the residual
stream, kept alive by the next layer anyway) and mean, rstd per row. Sums over rows (the
LayerNorm weight's and bias's gradients) are float32 partials, one per backward program: P
programs (`backward_programs`, 4 per SM) each walk rows pid, pid + P, ... and sum their dW and
db in registers, then torch sums the (P, C) partials (`BACKWARD = "two_pass"` instead runs one
program per row for dx and dres, then column tiles that sum dW and db over row segments, reading
h and dy twice). No atomics, deterministic; the first
version wrote one partial per row, an (R, C) float32 copy that made the backward slower than
eager on an H100 (lesson 11, DS-32).

Float32 arithmetic inside for every input dtype; h is rounded to its dtype before it is
normalised, so y is the LayerNorm of the h that is returned (as eager computes it).
Refused: p outside [0, 1), shapes that do not match. Float64, and fp16/bf16 on the CPU
(the interpreter's reduced precision is not trusted), run `fused_norm_reference`.

Shape legend: B batch rows, T tokens, C features (normalised); R = B T kernel rows.
Lesson: lessons/11-kernels.md ("DS-32: dropout, residual and LayerNorm in one kernel").
Tests: `pytest -k fused_norm` (CPU, interpreter), `-k kernels_gpu_fused_norm` (GPU).
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.

import math

import torch
import torch.nn.functional as F

from tinyscale.kernels._triton import jit, tl, triton
from tinyscale.kernels.flash_attention import kernel_ok
from tinyscale.models.dropout import BITS, DropoutClock, keep_mask, site_key


def counter_site(clock: DropoutClock, layer: int, site: int, batch: int, seq: int, device,
                 sequence_shard=None) -> tuple:
    """(key, rows (B,), positions (T,)): the coordinates `residual_dropout` hashes for this site."""
    return (site_key(clock.seed, clock.step, layer, site), clock.rows(batch, device),
            clock.token_positions(seq, device, sequence_shard))


# --8<-- [start:reference]
def fused_norm_reference(x, residual, weight, ln_bias, p: float, key: int, rows, positions, bias=None,
                         eps: float = 1e-5):
    """The eager version, the same math for reading: (LayerNorm(h), h), h = residual + dropout(x + bias)."""
    z = x if bias is None else x + bias
    if p > 0:
        C = x.shape[-1]
        features = torch.arange(C, dtype=torch.int64, device=x.device)
        keep = keep_mask(p, key, rows[:, None, None], positions[None, :, None], features[None, None, :])  # (B, T, C)
        z = z * (keep.to(z.dtype) * (1.0 / (1.0 - p)))
    h = residual + z
    return F.layer_norm(h, (x.shape[-1],), weight, ln_bias, eps), h
# --8<-- [end:reference]


# --8<-- [start:hash]
@jit
def _mix(z):
    """splitmix64's finaliser on uint64 (>> is a logical shift, * wraps modulo 2^64)."""
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return z


@jit
def _keep(key, threshold, rows_ptr, pos_ptr, row, T, cols):
    """Row `row` = b T + t of the kernel: kept where hash(key; rows[b], positions[t], c) >> 11 >= threshold."""
    gamma = 0x9E3779B97F4A7C15
    h = key.to(tl.int64).to(tl.uint64, bitcast=True)  # a small key arrives as int32
    h = _mix(h + (tl.load(rows_ptr + row // T) + 1).to(tl.uint64) * gamma)  # the batch row: one scalar
    h = _mix(h + (tl.load(pos_ptr + row % T) + 1).to(tl.uint64) * gamma)  # the token's position
    bits = _mix(h + (cols + 1).to(tl.uint64) * gamma) >> 11  # (BLOCK,) each feature its own counter
    return bits >= threshold.to(tl.uint64)
# --8<-- [end:hash]


# --8<-- [start:forward]
@jit
def _fwd(x_ptr, bias_ptr, res_ptr, w_ptr, b_ptr, rows_ptr, pos_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr,
         key, threshold, scale, T, N, eps, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N  # N need not be a power of two: lanes past it load 0 and are kept out of the sums
    offs = row.to(tl.int64) * N + cols
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        z = tl.where(_keep(key, threshold, rows_ptr, pos_ptr, row, T, cols), z * scale, 0.0)
    h = (tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32) + z).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offs, h, mask=mask)
    h = h.to(tl.float32)  # normalise the h that is stored
    mean = tl.sum(h, axis=0) / N
    d = tl.where(mask, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (d * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
# --8<-- [end:forward]


@jit
def _bwd_one_row(h_ptr, w, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, rows_ptr, pos_ptr, dres_ptr, dx_ptr, key, threshold,
                 scale, row, T, N, cols, mask, DROPOUT: tl.constexpr):
    """One row's dres and dx, stored; returns (dy, x_hat) for the weight's and bias's sums."""
    offs = tl.cast(row, tl.int64) * N + cols  # (a plain int under the interpreter)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    x_hat = tl.where(mask, (h - tl.load(mean_ptr + row)) * rstd, 0.0)  # recomputed, not stored
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = dy * w
    # LayerNorm's backward, plus the gradient that reaches h along the residual stream
    dh = rstd * (g - tl.sum(g, axis=0) / N - x_hat * (tl.sum(g * x_hat, axis=0) / N))
    dh += tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dres_ptr + offs, dh.to(dres_ptr.dtype.element_ty), mask=mask)
    if DROPOUT:  # the same mask, redrawn from the counter
        dh = tl.where(_keep(key, threshold, rows_ptr, pos_ptr, row, T, cols), dh * scale, 0.0)
    tl.store(dx_ptr + offs, dh.to(dx_ptr.dtype.element_ty), mask=mask)
    return dy, x_hat


@jit
def _bwd(h_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, rows_ptr, pos_ptr, dres_ptr, dx_ptr, dw_part_ptr,
         db_part_ptr, key, threshold, scale, R, T, N, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)  # this program's share of the weight's and bias's gradients,
    db = tl.zeros((BLOCK,), dtype=tl.float32)  # summed over its rows in registers: one (C,) partial each
    for row in range(pid, R, programs):
        dy, x_hat = _bwd_one_row(h_ptr, w, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, rows_ptr, pos_ptr, dres_ptr, dx_ptr,
                                 key, threshold, scale, row, T, N, cols, mask, DROPOUT)
        dw += dy * x_hat
        db += dy
    tl.store(dw_part_ptr + pid.to(tl.int64) * N + cols, dw, mask=mask)
    tl.store(db_part_ptr + pid.to(tl.int64) * N + cols, db, mask=mask)


@jit
def _bwd_row(h_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, rows_ptr, pos_ptr, dres_ptr, dx_ptr,
             key, threshold, scale, T, N, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    """Two-pass backward, pass 1: one program per row (as the forward) for dres and dx only."""
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    _bwd_one_row(h_ptr, w, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, rows_ptr, pos_ptr, dres_ptr, dx_ptr, key, threshold,
                 scale, tl.program_id(0), T, N, cols, mask, DROPOUT)


@jit
def _bwd_dw(h_ptr, dy_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr, R, N,
            ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Two-pass backward, pass 2: program (column tile, row segment) sums dy x_hat and dy over its
    ROWS rows, BM at a time, into one float32 partial per segment."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    dw = tl.zeros((BN,), dtype=tl.float32)
    db = tl.zeros((BN,), dtype=tl.float32)
    for r0 in range(pid_s * ROWS, pid_s * ROWS + ROWS, BM):
        rows = r0 + tl.arange(0, BM)
        rmask = rows < R
        offs = tl.cast(rows, tl.int64)[:, None] * N + cols[None, :]
        m2 = rmask[:, None] & cmask[None, :]
        h = tl.load(h_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        x_hat = tl.where(m2, (h - mean[:, None]) * rstd[:, None], 0.0)
        dw += tl.sum(dy * x_hat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(dw_part_ptr + pid_s.to(tl.int64) * N + cols, dw, mask=cmask)
    tl.store(db_part_ptr + pid_s.to(tl.int64) * N + cols, db, mask=cmask)


# "rows": `_bwd`, P programs walking rows (beat eager on an H100); "two_pass": `_bwd_row` then `_bwd_dw`
# (faster than "rows" in an H200 sweep, both slower than eager there: lesson 11). bwd of
# scripts/gpu_fused_norm.py times both; the tests run both.
BACKWARD = "rows"
DW_TILE = (32, 64, 256)  # pass 2's (BM rows, BN columns, ROWS per segment); ROWS a multiple of BM


def backward_programs(rows: int, device: torch.device) -> int:
    """Backward programs: a few per SM on a GPU (each sums its rows' dW in registers), a handful interpreted."""
    if device.type != "cuda":
        return min(rows, 4)
    return min(rows, PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count)


WARPS: int | None = None  # warps per row's program; None: `_warps`'s rule (scripts/gpu_fused_norm.py sweeps it)
BWD_WARPS: int | None = None  # the backward's warps; None: as the forward's (scripts/gpu_fused_norm.py sweeps it)
PROGRAMS_PER_SM = 4  # backward programs per SM (scripts/gpu_fused_norm.py sweeps it)


def _warps(block: int) -> int:
    """Warps for a row of `block` lanes: about 8 uint64 lanes per thread keeps the hash in registers."""
    return WARPS or max(4, min(16, block // 512))


def _dropout_args(p: float, key: int) -> tuple:
    """(key, threshold, scale) as the kernel takes them: keep where the top 53 bits >= ceil(p 2^53)."""
    signed = (key + 2**63) % 2**64 - 2**63  # the int64 with the key's bits
    return signed, math.ceil(p * 2**BITS), 1.0 / (1.0 - p)


class _FusedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, ln_bias, bias, p, key, rows, positions, eps):
        B, T, C = x.shape
        x2, r2 = x.reshape(B * T, C).contiguous(), residual.reshape(B * T, C).contiguous()  # (R, C)
        y, h = torch.empty_like(x2), torch.empty_like(x2)
        mean = torch.empty(B * T, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        key_, threshold, scale = _dropout_args(p, key)
        block = triton.next_power_of_2(C)
        _fwd[(B * T,)](x2, x2 if bias is None else bias.contiguous(), r2, weight.contiguous(), ln_bias.contiguous(),
                       rows, positions, y, h, mean, rstd, key_, threshold, scale, T, C, eps,
                       HAS_BIAS=bias is not None, DROPOUT=p > 0, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(h, weight, mean, rstd, rows, positions)
        ctx.args = (p, key, None if bias is None else bias.dtype, ln_bias.dtype, B, T, C)
        return y.view(B, T, C), h.view(B, T, C)

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, mean, rstd, rows, positions = ctx.saved_tensors
        p, key, bias_dtype, ln_bias_dtype, B, T, C = ctx.args
        dres, dx = torch.empty_like(h), torch.empty_like(h)
        key_, threshold, scale = _dropout_args(p, key)
        dy2, dh2, block = dy.reshape(B * T, C).contiguous(), dh.reshape(B * T, C).contiguous(), triton.next_power_of_2(C)
        if BACKWARD == "two_pass":
            _bwd_row[(B * T,)](h, weight.contiguous(), dy2, dh2, mean, rstd, rows, positions, dres, dx, key_,
                               threshold, scale, T, C, DROPOUT=p > 0, BLOCK=block, num_warps=BWD_WARPS or _warps(block))
            BM, BN, ROWS = DW_TILE if h.is_cuda else (4, 16, 8)  # the interpreter: small tiles
            segments = triton.cdiv(B * T, ROWS)
            dw_part = torch.empty(segments, C, dtype=torch.float32, device=h.device)
            db_part = torch.empty_like(dw_part)
            _bwd_dw[(triton.cdiv(C, BN), segments)](h, dy2, mean, rstd, dw_part, db_part, B * T, C, ROWS=ROWS, BM=BM,
                                                    BN=BN)
            dw, db = dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(ln_bias_dtype)
            dbias = None if bias_dtype is None else dx.sum(0, dtype=torch.float32).to(bias_dtype)
            return dx.view(B, T, C), dres.view(B, T, C), dw, db, dbias, None, None, None, None, None
        programs = backward_programs(B * T, h.device)
        dw_part = torch.empty(programs, C, dtype=torch.float32, device=h.device)  # (P, C): one row per program
        db_part = torch.empty_like(dw_part)
        _bwd[(programs,)](h, weight.contiguous(), dy2, dh2, mean, rstd, rows, positions,
                          dres, dx, dw_part, db_part, key_, threshold, scale, B * T, T, C, DROPOUT=p > 0,
                          BLOCK=triton.next_power_of_2(C), num_warps=BWD_WARPS or _warps(triton.next_power_of_2(C)))
        dw, db = dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(ln_bias_dtype)
        dbias = None if bias_dtype is None else dx.sum(0, dtype=torch.float32).to(bias_dtype)
        return dx.view(B, T, C), dres.view(B, T, C), dw, db, dbias, None, None, None, None, None


# --8<-- [start:api]
def fused_dropout_residual_layer_norm(x, residual, weight, ln_bias, *, p: float, key: int = 0, rows=None,
                                      positions=None, bias=None, eps: float = 1e-5):
    """(y, h): h = residual + dropout(x + bias), y = LayerNorm(h); x, residual (B, T, C).

    The mask is the counter mask of site `key` at global batch rows `rows` (B,) and token
    positions `positions` (T,) (default 0..B-1, 0..T-1): `counter_site(clock, layer, site, B, T,
    device)` gives the three the model's `residual_dropout` uses."""
    if not 0 <= p < 1:
        raise ValueError(f"fused_dropout_residual_layer_norm: p={p} must be in [0, 1) (p = 1 drops everything "
                         f"and the 1/(1-p) rescale is infinite)")
    if x.dim() != 3 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fused_dropout_residual_layer_norm: x {tuple(x.shape)} {x.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} must be the same (B, T, C) shape and dtype")
    B, T, C = x.shape
    for name, t in (("weight", weight), ("ln_bias", ln_bias), ("bias", bias)):
        if t is not None and t.shape != (C,):
            raise ValueError(f"fused_dropout_residual_layer_norm: {name} has shape {tuple(t.shape)}, not ({C},)")
    rows = torch.arange(B, device=x.device) if rows is None else rows.to(device=x.device, dtype=torch.int64)
    positions = torch.arange(T, device=x.device) if positions is None else \
        positions.to(device=x.device, dtype=torch.int64)
    if rows.shape != (B,) or positions.shape != (T,):
        raise ValueError(f"fused_dropout_residual_layer_norm: rows {tuple(rows.shape)} and positions "
                         f"{tuple(positions.shape)} must be ({B},) and ({T},)")
    if kernel_ok(x):
        return _FusedNorm.apply(x, residual, weight, ln_bias, bias, p, key, rows.contiguous(),
                                positions.contiguous(), eps)
    return fused_norm_reference(x, residual, weight, ln_bias, p, key, rows, positions, bias, eps)
# --8<-- [end:api]
