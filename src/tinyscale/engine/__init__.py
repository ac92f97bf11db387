"""The mini-engine: one config, one `Engine`, strategies composed in one place.

    engine = ts.initialize(model, config)
    loss = engine.train_batch(batch)
    engine.save_checkpoint(path, client_state={"data_position": i})   # crash-safe, layout-free
    client_state = engine.load_checkpoint(path)   # CheckpointError if it cannot continue
    engine.plan, placements(engine)               # the layout decided once; where each parameter lives
"""

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.engine.checkpoint import CheckpointError
from tinyscale.engine.engine import Engine, StepFailed, initialize
from tinyscale.engine.memory import MemoryReport
from tinyscale.engine.plan import LayoutPlan, Placement, placements, plan_layout

__all__ = ["CheckpointError", "ConfigError", "Engine", "EngineConfig", "LayoutPlan", "MemoryReport", "Placement",
           "StepFailed", "initialize", "placements", "plan_layout"]
