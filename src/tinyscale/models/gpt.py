"""A small Llama-style GPT: the one transformer every tinyscale topic trains.

Pre-norm blocks with RMSNorm, rotary position embeddings (RoPE, "rotate half"), causal
attention with optional grouped-query attention (GQA), a SwiGLU MLP and no biases: Llama 2/3
at laptop size. Submodule names are a contract: tensor parallelism swaps wq/wk/wv/wo and
w_gate/w_up/w_down, pipelining slices `blocks`, ZeRO and FSDP walk named_parameters().

Dropout (GPTConfig.dropout, on the attention probabilities and both residual branches) draws
its masks from torch's stream, or with GPTConfig.dropout_masks="counter" hashes them from each
element's global coordinates (`models/dropout.py`), the same in every layout.

Shape legend: B batch rows, T sequence length, V vocab size, C d_model, H query heads,
K key/value heads (H % K == 0), D head_dim = C // H, F ffn hidden size.
Check it with `pytest tests/models -q`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinyscale.models.config import GPTConfig
from tinyscale.models.dropout import SITE_ATTN, SITE_MLP, DropoutClock, ProbsDropout, residual_dropout


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: norms, RoPE and softmax lose too much in bf16/fp16."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in at least float32."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (seq_len, head_dim), float64 on the CPU. "Rotate half" (Llama's HF
    port): dim i < D/2 pairs with i + D/2; position p turns the pair by p * theta^(-2i/D)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D): dims i and i + D/2 share an angle
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, D) by the tables cos, sin (T, D) of x's positions."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, heads, D/2) each
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, T, heads, D)
    ct = compute_dtype(x.dtype)
    cos, sin = cos[:, None, :].to(ct), sin[:, None, :].to(ct)  # (T, 1, D): broadcast over heads
    return (x.to(ct) * cos + rotated.to(ct) * sin).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str = "sdpa",
                     dropout_p: float = 0.0, dropout_fn=None) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v. q (B, H, T, D); k, v (B, K, T, D) -> (B, H, T, D).

    GQA by repeating each K/V head for its group of H/K query heads (query head h reads K/V head
    h // (H/K)): it materialises full-size K/V, where a fused GQA kernel indexes, but keeps one
    readable path for both impls. dropout_fn, if given, drops the probabilities instead of
    dropout_p (explicit matmuls; tensor parallelism passes its RNG-aware dropout here)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(group, dim=1)  # (B, H, T, D)
    if impl == "sdpa" and dropout_fn is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, T, D) @ (B, H, D, T) -> (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # key j > query i
    scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=compute_dtype(q.dtype)).to(q.dtype)  # (B, H, T, T)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    elif dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v  # (B, H, T, T) @ (B, H, T, D) -> (B, H, T, D)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(bias=cfg.bias, device=device, dtype=dtype)
        self.head_dim, self.impl, self.dropout = cfg.head_dim, cfg.attn_impl, cfg.dropout
        # Counter masks (models/dropout.py): the GPT sets the shared clock and this block's index;
        # tensor parallelism sets head_offset, the global index of this rank's first head.
        self.dropout_masks, self.dropout_clock, self.layer_index, self.head_offset = \
            cfg.dropout_masks, DropoutClock(), 0, 0
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, **kw)  # C -> H*D
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, **kw)  # C -> K*D
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, **kw)  # C -> K*D
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, **kw)  # H*D -> C

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: head counts come from the weights' widths, so a tensor-parallel shard runs this code.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, K, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, K, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        out = self.core(q, k, v)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, H*D) -> (B, T, C)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core, softmax(q k^T) v with dropout: no parameters, the (B, H, T, T)
        activations. Its own method so selective recomputation can checkpoint just this."""
        dropout_p = self.dropout if self.training else 0.0
        probs_dropout = self.probs_dropout(q)
        if probs_dropout is not None:  # (B, H, T, T) probabilities at global positions 0..T-1 (both axes)
            positions = self.dropout_clock.token_positions(q.shape[2], q.device)
            scale = probs_dropout.scale(positions, positions, q.dtype)
            return causal_attention(q, k, v, impl=self.impl, dropout_fn=lambda probs: probs * scale)
        return causal_attention(q, k, v, impl=self.impl, dropout_p=dropout_p)

    def probs_dropout(self, q: torch.Tensor) -> ProbsDropout | None:
        """The counter mask's coordinates for this call's q (B, H, T, D), or None (no counter dropout)."""
        if not self.training or self.dropout == 0 or self.dropout_masks != "counter":
            return None
        return ProbsDropout.at(self.dropout, self.dropout_clock, self.layer_index, q.shape[0], q.shape[1],
                               self.head_offset, q.device)


class SwiGLU(nn.Module):
    """w_down(silu(w_gate x) * w_up x): the gated MLP of PaLM and Llama."""

    def __init__(self, cfg: GPTConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(bias=cfg.bias, device=device, dtype=dtype)
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_dim, **kw)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_dim, **kw)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))  # (B, T, F) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, *, device=None, dtype=None, layer: int = 0) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.dropout, self.dropout_masks = cfg.dropout, cfg.dropout_masks
        # Counter masks: set by the GPT (clock, index) and by sequence parallelism ((rank, ranks):
        # this block's residual stream is that rank's slice of the sequence).
        self.dropout_clock, self.layer_index, self.sequence_shard = DropoutClock(), 0, None
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **kw)
        self.attn = Attention(cfg, **kw)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **kw)
        if cfg.is_moe_layer(layer):  # the MoE topic's layer; imported here: it builds on this module's
            from tinyscale.moe import MoE  # noqa: PLC0415
            self.mlp = MoE(cfg, **kw)
        else:
            self.mlp = SwiGLU(cfg, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.residual_dropout(self.attn(self.attn_norm(x), cos, sin), SITE_ATTN)  # (B, T, C)
        return x + self.residual_dropout(self.mlp(self.mlp_norm(x)), SITE_MLP)  # (B, T, C)

    def residual_dropout(self, h: torch.Tensor, site: int) -> torch.Tensor:
        """Dropout of a residual branch h (B, T, C): torch's stream, or the counter mask of `site`."""
        if self.dropout_masks == "counter" and self.training and self.dropout > 0:
            return residual_dropout(h, self.dropout, self.dropout_clock, self.layer_index, site, self.sequence_shard)
        return F.dropout(h, self.dropout, self.training)


def check_ids(ids: torch.Tensor, cfg: GPTConfig, name: str) -> None:
    """Bad ids make embedding lookups and cross-entropy fail obscurely (or read garbage on a GPU)."""
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be a 2-D (B, T) int64 tensor of token ids, got shape "
                         f"{tuple(ids.shape)} dtype {ids.dtype}: pass ids.long() with a batch dim")
    if ids.shape[1] > cfg.max_seq_len:
        raise ValueError(f"{name} has sequence length T={ids.shape[1]} > max_seq_len={cfg.max_seq_len}: "
                         "crop the input or build the model with a larger GPTConfig.max_seq_len")
    bad = (ids < 0) | (ids >= cfg.vocab_size)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} contains token id {int(ids[where])} at position {where}; valid ids are "
                         f"0..{cfg.vocab_size - 1} (vocab_size={cfg.vocab_size}): fix the data or vocab_size")


class GPT(nn.Module):
    """Decoder-only transformer. forward(idx) -> logits; forward(idx, targets) -> mean loss."""

    def __init__(self, config: GPTConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device=None) -> None:
        super().__init__()
        self.config = config
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.blocks = nn.ModuleList(Block(config, **kw, layer=i) for i in range(config.n_layer))
        # Counter dropout masks (models/dropout.py): one clock shared by every block, which the
        # trainer sets before each micro-batch (`set_dropout_clock`). Its seed is the config's, not
        # the init seed: a model built otherwise and loaded from a checkpoint draws the same masks.
        self.dropout_clock = DropoutClock(seed=config.dropout_seed)
        for i, block in enumerate(self.blocks):
            block.dropout_clock = block.attn.dropout_clock = self.dropout_clock
            block.layer_index = block.attn.layer_index = i  # global: pipeline stages keep it
        self.norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight  # one Parameter, two uses: their grads add up
        # Derived, not learned: non-persistent keeps them out of state_dict (parameters only).
        # At least float32: angles up to max_seq_len radians need the precision.
        for name in ("rope_cos", "rope_sin"):  # (max_seq_len, D), filled by reset_parameters
            table = torch.empty(config.max_seq_len, config.head_dim, device=device,
                                dtype=compute_dtype(dtype))
            self.register_buffer(name, table, persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init, the same on any device and whatever the global RNG state.

        Draws float32 from a CPU generator in named_parameters() order (a tied weight once), so
        float32 and float64 models start equal. wo and w_down get std / sqrt(2 * n_layer) (GPT-2,
        sec. 2.3) so the residual stream does not grow with depth. Rebuilds the RoPE tables too:
        a model built on the meta device works after to_empty()."""
        cfg = self.config
        if all(p.is_meta for p in self.parameters()):  # nothing to fill (and drawing 47B values took minutes)
            return
        gen = torch.Generator(device="cpu").manual_seed(seed)
        norm_weights = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm)}
        for name, param in self.named_parameters():
            if id(param) in norm_weights:
                param.fill_(1.0)
                continue
            if name.endswith(".bias"):  # GPT-2's linear biases start at zero: no draw, the weights stay as without
                param.zero_()
                continue
            std = cfg.init_std
            if name.endswith(("attn.wo.weight", "mlp.w_down.weight", "experts.w_down", "shared.w_down.weight")):
                std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
            param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        check_ids(idx, cfg, "idx")
        B, T = idx.shape
        x = self.embed(idx)  # (B, T, C)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        logits = self.head(self.norm(x))  # (B, T, C) @ (C, V) -> (B, T, V)
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}: "
                             "targets must be idx shifted by one position, same (B, T)")
        check_ids(targets, cfg, "targets")
        # Mean over all B*T positions = mean over rows of per-row means (every row has T
        # positions): that is what lets data parallelism average per-rank losses.
        logits = logits.reshape(B * T, cfg.vocab_size).to(compute_dtype(logits.dtype))  # (B*T, V)
        return self.add_aux_losses(F.cross_entropy(logits, targets.reshape(B * T).long()))

    def add_aux_losses(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` plus the load-balancing and z losses this forward's MoE blocks set (tinyscale.moe):
        they train with the loss. A dense GPT: `loss` itself."""
        aux = [m.aux_loss for m in self.blocks.modules() if getattr(m, "aux_loss", None) is not None]
        return loss + sum(aux) if aux else loss
