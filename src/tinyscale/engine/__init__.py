"""The mini-engine: one config, one `Engine`, strategies composed in one place.

    engine = ts.initialize(model, config)
    loss = engine.train_batch(batch)
"""

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.engine.engine import Engine, StepFailed, initialize
from tinyscale.engine.memory import MemoryReport

__all__ = ["ConfigError", "Engine", "EngineConfig", "MemoryReport", "StepFailed", "initialize"]
