"""MFU and HFU, and how to average them over training steps without fooling yourself.

    MFU = tokens/s x model FLOPs per token    / (devices x peak FLOP/s)
    HFU = tokens/s x hardware FLOPs per token / (devices x peak FLOP/s)

Model FLOPs are the forward and backward matmuls the model needs (`flops.model_flops_per_token`),
however the step is run; hardware FLOPs add what the implementation chose to compute again
(activation recomputation). MFU compares systems, since recomputing more cannot raise it;
HFU says how busy the chips were. Both definitions: Chowdhery et al., "PaLM" (2022),
appendix B; both are reported by Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (2022).

Over many steps, MFU is total model FLOPs / (total seconds x devices x peak): sum the tokens
and the seconds of every step in the window, then divide once (`WindowedMFU`). nanoGPT's
`running_mfu` instead takes an exponential moving average of single-step MFUs sampled only at
the logged steps (`nanogpt_running_mfu` replays it): steps between logs are never seen, and
an average of rates over-weights the fast steps. Lesson: lessons/06-mfu.md.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

from tinyscale.mfu.flops import hardware_flops_per_token, model_flops_per_token
from tinyscale.models import GPTConfig


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number > 0")


def _devices(num_devices: int) -> None:
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} is invalid: it must be a positive int "
                         "(the devices that shared the tokens/s)")


def _rate(tokens_per_second: float) -> None:
    if not (isinstance(tokens_per_second, (int, float)) and math.isfinite(tokens_per_second)
            and tokens_per_second >= 0):
        raise ValueError(f"tokens_per_second={tokens_per_second!r} is invalid: it must be a finite number >= 0")


# --8<-- [start:mfu]
def mfu(tokens_per_second: float, config: GPTConfig, peak_flops: float, *, seq_len: int | None = None,
        num_devices: int = 1) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the devices' dense peak.

    tokens_per_second: tokens trained per second by all `num_devices` together (the job's
    throughput); pass one device's throughput with num_devices=1 for a per-device MFU.
    peak_flops: one device's peak FLOP/s for the matmul dtype (`peak.peak_flops` or
    `peak.measured_peak`). seq_len: tokens per sequence (default: config.max_seq_len)."""
    _rate(tokens_per_second)
    _positive("peak_flops", peak_flops)
    _devices(num_devices)
    seq_len = config.max_seq_len if seq_len is None else seq_len
    return tokens_per_second * model_flops_per_token(config, seq_len) / (num_devices * peak_flops)


def hfu(tokens_per_second: float, config: GPTConfig, peak_flops: float, *, seq_len: int | None = None,
        num_devices: int = 1, recompute: str = "none", recomputed_layers: int | None = None,
        early_stop: bool = True, explicit_core: bool | None = None, tp: int = 1, cp: int = 1,
        cp_algorithm: str = "ring", cp_sharding: str = "zigzag") -> float:
    """Hardware FLOPs utilization: like `mfu`, counting recomputed FLOPs too (the checkpoint's,
    and the Q K^T a fused attention backward recomputes: `ForwardFlops.backward_rerun`).
    recompute: "none", "selective" (attention core) or "full" (whole blocks); early_stop: the
    checkpoint stops its rerun at the last saved tensor (non-re-entrant; False: re-entrant);
    explicit_core: the attention core runs as matmuls (None: from the config; `forward_flops`);
    tp, cp, cp_algorithm, cp_sharding: the layout, whose padding and attention blocks run too
    (`flops.layout_flops`)."""
    _rate(tokens_per_second)
    _positive("peak_flops", peak_flops)
    _devices(num_devices)
    seq_len = config.max_seq_len if seq_len is None else seq_len
    flops = hardware_flops_per_token(config, seq_len, recompute=recompute, recomputed_layers=recomputed_layers,
                                     early_stop=early_stop, explicit_core=explicit_core, tp=tp, cp=cp,
                                     cp_algorithm=cp_algorithm, cp_sharding=cp_sharding)
    return tokens_per_second * flops / (num_devices * peak_flops)
# --8<-- [end:mfu]


# --8<-- [start:windowed]
class WindowedMFU:
    """MFU (and HFU) over the last `window` steps: summed FLOPs over summed seconds.

        tracker = WindowedMFU(model_flops_per_token(cfg, T), peak_flops=peak_flops("H100 SXM", torch.bfloat16))
        for step ...:
            tracker.update(tokens=B * T, seconds=step_seconds)   # every step, not only logged ones
            if step % log_every == 0: log(tracker.mfu)

    The first `warmup_steps` updates are ignored (compilation, allocator and cache warm-up
    are not the steady state). Time every step with its own clock reading at the step's end
    (on a GPU: after a synchronize, or with CUDA events), so no second of the run is lost.
    """

    def __init__(self, flops_per_token: float, peak_flops: float, *, window: int = 20, num_devices: int = 1,
                 warmup_steps: int = 0, hardware_flops_per_token: float | None = None) -> None:
        _positive("flops_per_token", flops_per_token)
        _positive("peak_flops", peak_flops)
        _devices(num_devices)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window={window!r} is invalid: it must be a positive int (steps averaged over)")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: it must be an int >= 0")
        if hardware_flops_per_token is not None:
            _positive("hardware_flops_per_token", hardware_flops_per_token)
        self.flops_per_token, self.peak_flops, self.num_devices = flops_per_token, peak_flops, num_devices
        self.hardware_flops_per_token = hardware_flops_per_token
        self.warmup_steps, self.steps_seen = warmup_steps, 0
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    def update(self, tokens: int, seconds: float) -> None:
        """Record one step: the tokens it trained (all devices) and its wall-clock seconds."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"tokens={tokens!r} is invalid: it must be an int >= 0")
        _positive("seconds", seconds)
        self.steps_seen += 1
        if self.steps_seen > self.warmup_steps:
            self._steps.append((tokens, seconds))

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens over seconds, both summed over the window; None before the first counted step."""
        if not self._steps:
            return None
        return sum(t for t, _ in self._steps) / sum(s for _, s in self._steps)

    @property
    def mfu(self) -> float | None:
        rate = self.tokens_per_second
        return None if rate is None else rate * self.flops_per_token / (self.num_devices * self.peak_flops)

    @property
    def hfu(self) -> float | None:
        rate, flops = self.tokens_per_second, self.hardware_flops_per_token
        if rate is None or flops is None:
            return None
        return rate * flops / (self.num_devices * self.peak_flops)
# --8<-- [end:windowed]


# --8<-- [start:nanogpt]
def nanogpt_running_mfu(step_seconds: Sequence[float], tokens_per_step: int, flops_per_token: float,
                        peak_flops: float, *, log_interval: int = 10, settle_steps: int = 5) -> list[float]:
    """What nanoGPT's train.py logs as MFU, replayed on a list of step times (the anti-example).

    nanoGPT times each iteration (dt = t1 - t0, t0 = t1), and only when
    `iter_num % log_interval == 0` (and after 5 settling iterations) turns that one dt into an
    MFU and folds it into `running_mfu = 0.9 * running_mfu + 0.1 * mfu`. Returns the value
    logged at each such step (-1.0 until the first sample, as nanoGPT prints it)."""
    _positive("peak_flops", peak_flops)
    _positive("flops_per_token", flops_per_token)
    running, logged = -1.0, []
    for step, dt in enumerate(step_seconds):
        if step % log_interval == 0:
            if step >= settle_steps:
                sample = tokens_per_step * flops_per_token / dt / peak_flops  # this one step's MFU
                running = sample if running == -1.0 else 0.9 * running + 0.1 * sample
            logged.append(running)
    return logged
# --8<-- [end:nanogpt]
