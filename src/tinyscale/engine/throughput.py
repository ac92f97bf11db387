"""Tokens per second, MFU and HFU of the engine's steps (`tinyscale.mfu` applied to the engine).

    engine = ts.initialize(model, config, peak_flops=measured_peak("cpu"))
    engine.train_batch(batch); engine.last_step   # {"tokens", "seconds", "tokens_per_s", "mfu", "hfu"}

MFU needs the model's FLOPs per token and one device's peak FLOP/s. FLOPs: exact for the
tinyscale GPT (`tinyscale.mfu.model_flops_per_token`, from its config and the batch's
sequence length); other models get tokens/s only. Peak: `peak_flops=` if given, else the
vendor table for a CUDA device (`tinyscale.mfu.peak_flops`), else none (a CPU has no vendor
peak: the CLI measures one with `measured_peak`). HFU adds what the activation-checkpointing
policy recomputes, as its checkpoint reruns it (`early_stop_of`: whole regions re-entrantly, all
but a region's unsaved last matmul with early stop; `explicit_core_of`: whether the attention
core's P v is such a matmul), and what the layout runs besides (`tinyscale.mfu.layout_flops`:
tp's padded vocabulary rows, cp's padded positions and attention blocks, a fused attention
backward's Q K^T). Both are over a window of steps
(`WindowedMFU`: tokens and seconds summed, not an average of per-step ratios), so they are right
whenever they are read.
"""

from __future__ import annotations

import torch

from tinyscale.config import EngineConfig
from tinyscale.mfu import WindowedMFU, hardware_flops_per_token, model_flops_per_token, peak_flops
from tinyscale.models import GPT, GPTConfig


def recompute_of(config: EngineConfig, n_layer: int) -> tuple[str, int | None]:
    """(recompute, recomputed_layers) for `tinyscale.mfu.hfu`, from the checkpointing policy."""
    ac = config.activation_checkpointing
    if ac.policy == "full":
        return "full", None
    if ac.policy == "every_k":
        return "full", n_layer // ac.every_k  # blocks k, 2k, ...: how many, not which, matters
    if ac.policy == "selective":
        return "selective", None
    return "none", None  # "offload" moves activations, it recomputes nothing


def early_stop_of(config: EngineConfig, model_config: GPTConfig | None = None, *, tp: int) -> bool:
    """`early_stop` for `tinyscale.mfu.hfu`: ours non-re-entrant stops its rerun early, the
    re-entrant one does not; in a compiled block both are torch's checkpoint, whose backward graph
    reruns what an early stop reruns with "aot_eager", and the whole region with the "eager"
    backend (measured: `pytest -k "hfu_matches or torch_compile_checkpointing"`), except where
    the rerun was measured to stop early there too (selective reruns Q K^T only), as torch's
    eager checkpoint does: with dropout (`model_config`) and counter masks, which key each mask
    by a Python int read from a tensor (a graph break in the region), and with dropout under
    tensor parallelism, whose blocks Dynamo breaks at their collectives (the region then runs
    as torch's eager checkpoint; without dropout the core is SDPA, rerun whole either way).
    "inductor" partitions the same tagged graph, so it is counted as
    "aot_eager" (not measured: its generated kernels run outside the dispatcher, where no FLOP
    counter sees them). `tp`: the tensor-parallel degree, the plan's (`engine.plan.tp`: the
    config's layout is not read after `plan_layout`)."""
    if config.compile.enabled:
        breaks = model_config is not None and model_config.dropout > 0 and (
            model_config.dropout_masks == "counter" or tp > 1)
        return config.compile.backend != "eager" or breaks
    return not config.activation_checkpointing.use_reentrant


def explicit_core_of(config: EngineConfig, model_config: GPTConfig, *, tp: int,
                     device: str | torch.device | None = None) -> bool | None:
    """`explicit_core` for `tinyscale.mfu.hfu`: True under tensor parallelism with dropout (its
    attention core drops each rank's heads through a function, tensor_parallel/random.py, so it
    runs as matmuls, and an early stop skips its P v, whatever attn_impl says), and on a CPU
    `device` with dropout (the CPU's fused SDPA kernel takes no dropout: SDPA runs its math
    path, matmuls whose backward keeps P); else None, the config's own answer. `tp` as in
    `early_stop_of`."""
    on_cpu = device is not None and torch.device(device).type == "cpu"
    return True if model_config.dropout > 0 and (tp > 1 or on_cpu) else None


class Throughput:
    """One rank's view of the job's throughput: every rank trains the same global batch in
    the same wall time, so tokens are the global batch's and the devices are all ranks'."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device, *,
                 peak: float | None = None, num_devices: int = 1, window: int = 20, tp: int = 1, cp: int = 1,
                 cp_algorithm: str = "ring", cp_sharding: str = "zigzag"):
        if peak is None and device.type == "cuda":
            try:
                dtype = next(model.parameters()).dtype
                if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
                    dtype = "tf32"  # fp32 matmuls run on tensor cores: tf32's peak is the ceiling
                peak = peak_flops(device, dtype)
            except ValueError:
                peak = None  # a GPU the table does not know: tokens/s only
        if peak is not None and not peak > 0:
            raise ValueError(f"peak_flops={peak!r} must be a positive number of FLOP/s (e.g. measured_peak())")
        self.model, self.config, self.peak, self.num_devices, self.window = model, config, peak, num_devices, window
        self.device = device
        self.tp = tp  # the plan's tensor-parallel degree
        self._cp = {"cp": cp, "cp_algorithm": cp_algorithm, "cp_sharding": cp_sharding}  # the plan's cp
        self.tracker: WindowedMFU | None = None
        self._seq_len: int | None = None

    def record(self, batch: tuple[torch.Tensor, ...], seconds: float) -> dict:
        """This step's tokens and time, and the windowed tokens/s, MFU and HFU."""
        gpt = self.model.config if isinstance(self.model, GPT) else None
        tokens = batch[0].numel() if gpt is not None else batch[0].shape[0]  # tokens, or rows
        if self.tracker is None or (gpt is not None and batch[0].shape[1] != self._seq_len):
            # A new sequence length changes FLOPs per token: start a new window.
            flops = hflops = 1.0
            if gpt is not None:
                self._seq_len = batch[0].shape[1]
                recompute, layers = recompute_of(self.config, gpt.n_layer)
                flops = model_flops_per_token(gpt, self._seq_len)
                core = explicit_core_of(self.config, gpt, tp=self.tp, device=self.device)
                hflops = hardware_flops_per_token(gpt, self._seq_len, recompute=recompute, recomputed_layers=layers,
                                                  early_stop=early_stop_of(self.config, gpt, tp=self.tp),
                                                  explicit_core=core,
                                                  tp=self.tp, **self._cp)
            self.tracker = WindowedMFU(flops, self.peak or 1.0, window=self.window, num_devices=self.num_devices,
                                       hardware_flops_per_token=hflops)
        self.tracker.update(tokens=int(tokens), seconds=seconds)
        known = gpt is not None and self.peak is not None
        return {"tokens": int(tokens), "seconds": seconds, "tokens_per_s": self.tracker.tokens_per_second,
                "mfu": self.tracker.mfu if known else None, "hfu": self.tracker.hfu if known else None}
