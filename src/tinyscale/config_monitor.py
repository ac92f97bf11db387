"""The monitoring sections: DeepSpeed's ``tensorboard`` and ``csv_monitor``, and tinyscale's ``monitor``.

    "tensorboard": {"enabled": true, "output_path": "runs/", "job_name": "gpt"},  # DeepSpeed's keys
    "csv_monitor": {"enabled": true, "output_path": "runs/", "job_name": "gpt"},
    "monitor": {"straggler_margin": 0.2, "loss_spike_window": 20, "loss_spike_factor": 3.0}

Files go to ``output_path/job_name/`` as in DeepSpeed (an empty output_path: the working
directory). What is written, and the health and straggler signals: `tinyscale.engine.monitor`.
"""

from __future__ import annotations

from pydantic import Field

from tinyscale.config_input import Bool, Float, PositiveInt, Section


class MonitorOutput(Section):
    """One of DeepSpeed's monitor sections (its keys and defaults)."""

    enabled: Bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class HealthConfig(Section):
    """tinyscale's own: when the straggler and loss-spike warnings fire (rank 0, logger tinyscale.monitor)."""

    # a rank whose busy time (its step minus time inside collectives) exceeds the median's by this fraction
    straggler_margin: Float = Field(0.2, gt=0)
    # a loss above the mean of the last `loss_spike_window` steps by `loss_spike_factor` standard deviations
    loss_spike_window: PositiveInt = 20
    loss_spike_factor: Float = Field(3.0, gt=0)
