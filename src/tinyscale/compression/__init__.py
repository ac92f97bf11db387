"""Gradient compression: send fewer bytes per step, and keep training as if you had not.

| file | what |
| --- | --- |
| `base.py` | the `Compressor` interface, `compressed_mean` (all-reduce aligned payloads, all-gather the rest) |
| `sparsify.py` | `TopK` (values + indices) and `RandomK` (shared seed: values only) |
| `quantize.py` | `QSGD`: unbiased stochastic 8- and 4-bit quantization with an agreed scale; `BlockInt8` (the fused kernel) |
| `feedback.py` | `ErrorFeedback`: what was not sent is added to the next step's gradient |
| `hooks.py` | `CompressionState` + `compression_hook` for torch's DDP and `BucketedDDP` |
| `powersgd.py` | `PowerSGDState` + `powersgd_hook` (rank-r power iteration, torch's specification) |
| `onebit.py` | `OneBitAdam`: exact warm-up, then frozen variance and 1-bit momentum |

Lesson: lessons/10-compression.md. Tests: `pytest -k compression`.
"""

from tinyscale.compression.base import Compressor, Payload, compressed_mean
from tinyscale.compression.feedback import ErrorFeedback
from tinyscale.compression.hooks import CompressionState, allreduce_hook, compression_hook
from tinyscale.compression.onebit import OneBitAdam, compressed_allreduce, onebit_bytes
from tinyscale.compression.powersgd import PowerSGDState, orthogonalise, powersgd_hook
from tinyscale.compression.quantize import QSGD, BlockInt8, pack_nibbles, unpack_nibbles
from tinyscale.compression.sparsify import RandomK, TopK

__all__ = [
    "QSGD", "BlockInt8", "CompressionState", "Compressor", "ErrorFeedback", "OneBitAdam", "Payload", "PowerSGDState",
    "RandomK", "TopK", "allreduce_hook", "compressed_allreduce", "compressed_mean", "compression_hook",
    "onebit_bytes", "orthogonalise", "pack_nibbles", "powersgd_hook", "unpack_nibbles",
]
