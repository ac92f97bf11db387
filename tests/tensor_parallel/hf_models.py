"""Tiny transformers models with random weights (nothing downloaded), in float64, for AutoTP's tests.

transformers is the `[hf]` extra (`make setup` installs it); `hf()` skips a test without it.
Dropout is 0 and attention is "eager" (plain matmuls, the same as one process's in float64).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tinyscale.models import CausalLMLoss

VOCAB = 61  # prime: the vocab shards are padded at every tp


def hf():
    return pytest.importorskip("transformers")


def llama(tied: bool = True, kv_heads: int = 1, layers: int = 2, seed: int = 0) -> CausalLMLoss:
    """Llama: 4 query heads, `kv_heads` K/V heads (1: copied onto every rank at tp 2 and 4), SwiGLU."""
    t = hf()
    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=16,
                        tie_word_embeddings=tied, attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    return CausalLMLoss(t.LlamaForCausalLM(cfg).double())


def qwen2(kv_heads: int = 2, seed: int = 1) -> CausalLMLoss:
    """Qwen2: biases on q, k and v, an untied head, and a padding token (its embedding row gets no gradient)."""
    t = hf()
    cfg = t.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=16,
                        tie_word_embeddings=False, pad_token_id=0, attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    model = CausalLMLoss(t.Qwen2ForCausalLM(cfg).double())
    with torch.no_grad():  # transformers zeroes biases at init: nonzero ones show a bias split wrong
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def gpt2(seed: int = 3) -> CausalLMLoss:
    """GPT-2: transformers' Conv1D layers (weights stored (in, out)), q, k and v fused in c_attn,
    biases everywhere, LayerNorm, learned positions, embedding tied to the head."""
    t = hf()
    cfg = t.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=16, n_inner=24,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                       attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    model = CausalLMLoss(t.GPT2LMHeadModel(cfg).double())
    with torch.no_grad():  # transformers zeroes biases at init: nonzero ones show a bias split wrong
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


class Readout(nn.Module):
    """A model no default name fits: an embedding, an MLP block named fc1/fc2, a readout; its
    `tp_plan` is READOUT_PLAN. fc1's bias is frozen."""

    def __init__(self, vocab: int = VOCAB, dim: int = 12, hidden: int = 20, seed: int = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.table = nn.Embedding(vocab, dim, dtype=torch.float64)
        self.block = nn.ModuleDict({"fc1": nn.Linear(dim, hidden, dtype=torch.float64),
                                    "fc2": nn.Linear(hidden, dim, dtype=torch.float64)})
        self.readout = nn.Linear(dim, vocab, dtype=torch.float64)
        self.block["fc1"].bias.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.table(idx)  # (B, T, C)
        x = x + self.block["fc2"](torch.tanh(self.block["fc1"](x)))  # (B, T, C)
        logits = self.readout(x)  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


READOUT_PLAN = {"table": "vocab", "block.fc1": "colwise", "block.fc2": "rowwise", "readout": "replicate"}
