"""The mini-engine: one config, one `Engine`, strategies composed in one place.

    engine = ts.initialize(model, config)
    loss = engine.train_batch(batch)
    engine.save_checkpoint(path, client_state={"data_position": i})   # crash-safe, layout-free
    client_state = engine.load_checkpoint(path)   # CheckpointError if it cannot continue
"""

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.engine.checkpoint import CheckpointError
from tinyscale.engine.engine import Engine, StepFailed, initialize
from tinyscale.engine.memory import MemoryReport

__all__ = ["CheckpointError", "ConfigError", "Engine", "EngineConfig", "MemoryReport", "StepFailed", "initialize"]
