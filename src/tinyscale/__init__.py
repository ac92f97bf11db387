"""tinyscale: how large models are trained across many GPUs, one small topic at a time.

    import tinyscale as ts
    ts.dist.launch(fn, world_size)               # ranks on this machine
    engine = ts.initialize(model, config)        # inside each rank
    ts.reference.train(model, batches, config)   # the single-process truth
"""

from tinyscale import data, dist, models, reference
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.engine import Engine, MemoryReport, initialize

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "MemoryReport",
    "data",
    "dist",
    "initialize",
    "models",
    "reference",
]
