"""Triton kernels, each beside the plain PyTorch it replaces (the same math, for reading).

| file | kernel | replaces |
| --- | --- | --- |
| `flash_attention.py` | FlashAttention-2 forward + backward with lse, causal, GQA, any length | materialised scores |
| `rmsnorm.py` | fused RMSNorm forward + backward | 5 elementwise passes |
| `fused_norm.py` | dropout (counter mask) + residual + LayerNorm, forward + backward (DS-32) | add, dropout, add, layer_norm |
| `adamw.py` | AdamW over one flat buffer (a ZeRO shard's shape); `FusedAdamW` for ZeRO | ~10 kernels per tensor |
| `quantize.py` | int8 quantize / dequantize with per-block scales | abs, amax, div, round, cast |
| `cross_entropy.py` | fused linear + cross-entropy, chunked rows | (N, V) logits, softmax, its gradient |
| `grouped_gemm.py` | one matmul per group of contiguous rows (MoE experts), one launch, + backward | a loop of E matmuls |

Triton is optional (`pip install -e .[triton]`): every function runs its PyTorch reference
when Triton cannot run (no Triton, or a CPU tensor without `TRITON_INTERPRET=1`).
Lesson: lessons/11-kernels.md. Tests: `pytest -k kernels` (the CPU runs them under
Triton's interpreter in float32).
"""

from tinyscale.kernels._triton import HAS_TRITON, use_triton
from tinyscale.kernels.adamw import FusedAdamW, adamw_reference_, fused_adamw_
from tinyscale.kernels.cross_entropy import fused_linear_cross_entropy
from tinyscale.kernels.flash_attention import (
    attention_reference, flash_attention, flash_block, flash_block_backward, kernel_ok,
)
from tinyscale.kernels.fused_norm import fused_dropout_residual_layer_norm, fused_norm_reference
from tinyscale.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from tinyscale.kernels.quantize import dequantize_int8, dequantize_reference, quantize_int8, quantize_reference
from tinyscale.kernels.rmsnorm import rms_norm, rms_norm_reference

__all__ = [
    "HAS_TRITON", "FusedAdamW", "adamw_reference_", "attention_reference", "dequantize_int8", "dequantize_reference",
    "flash_attention", "flash_block", "flash_block_backward", "fused_adamw_", "fused_dropout_residual_layer_norm",
    "fused_norm_reference", "grouped_gemm", "grouped_gemm_reference", "fused_linear_cross_entropy", "kernel_ok", "quantize_int8",
    "quantize_reference", "rms_norm", "rms_norm_reference", "use_triton",
]
