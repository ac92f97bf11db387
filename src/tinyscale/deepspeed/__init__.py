"""DeepSpeed's training-loop API over tinyscale's engine: a DeepSpeed script runs with one import changed.

    import tinyscale.deepspeed as deepspeed                # instead of: import deepspeed
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()                             # --deepspeed --deepspeed_config ds.json
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    for inputs, labels in loader:
        loss = criterion(engine(inputs), labels)
        engine.backward(loss)
        engine.step()                                      # steps at each accumulation boundary
    engine.save_checkpoint("ckpt", tag="final", client_state={"epoch": 1})
    path, client_state = engine.load_checkpoint("ckpt")    # the tag in ckpt/latest

Served, and what each argument of `initialize` may be (the full table: docs/deepspeed-config.md):

- ``config`` / ``config_params`` / ``args.deepspeed_config``: a DeepSpeed JSON config, path or
  dict (`tinyscale.config.EngineConfig`: every key honoured, noted or refused with the reason);
- ``model``: any module; ``model_parameters``: its trainable parameters, or groups of them
  (dicts with overrides such as "weight_decay", not "lr"): matched to the module by name;
- ``optimizer``: none (the config's section), a torch optimizer class or callable ``groups ->
  optimizer``, or a torch optimizer instance that has not stepped (rebuilt over the engine's
  parameters with its own hyperparameters, since ZeRO and mixed precision step other tensors);
- ``training_data``: a map-style dataset, loaded as DeepSpeed loads it: torch's
  `DistributedSampler` over the data-parallel ranks (shuffle, seed 0), micro-batches of
  ``train_micro_batch_size_per_gpu`` rows, ``collate_fn``;
- ``dist_init_required``: any value (the process group is joined if it is not).

Refused by name: ``lr_scheduler`` (the config's ``scheduler`` section sets every step's lr:
the engine writes it before each step), ``mpu`` (the degrees live in the config's
``parallel`` section, which builds the mesh), ``parallel.context`` > 1 (a module's forward
returns its sequence shard's loss, which a script would take for the batch's: use
`tinyscale.initialize` and train_batch). The engine's own refusals: `engine.REFUSED`.
Tests: ``pytest -k deepspeed_api``; the tutorial-shaped script: examples/deepspeed_tutorial.py.
"""

from __future__ import annotations

import argparse
import inspect
import os

import torch
import torch.distributed as dist

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.deepspeed.engine import REFUSED, DeepSpeedEngine
from tinyscale.dist import runtime
from tinyscale.engine.engine import Engine

__all__ = ["REFUSED", "DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's arguments: ``--deepspeed`` (a flag) and ``--deepspeed_config PATH``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (always on here)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout=None, init_method=None, dist_init_required=None, config=None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Join the job a launcher started (torchrun or DeepSpeed's: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT in the environment); in a plain process, do nothing (one rank)."""
    if dist.is_initialized() or "RANK" not in os.environ:
        return
    backend = dist_backend or "auto"
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"init_distributed(dist_backend={dist_backend!r}): tinyscale uses 'nccl' (GPUs) or 'gloo'")
    runtime.init(backend=backend, timeout_s=timeout.total_seconds() if timeout is not None else 600.0)


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """(engine, optimizer, training_dataloader, lr_scheduler), as DeepSpeed returns them; see the module docstring."""
    refused = {"lr_scheduler": (lr_scheduler, "set the config's scheduler section: the engine writes every "
                                "step's lr from it"),
               "mpu": (mpu, "set the degrees in the config's parallel section (tensor, pipeline, context)"),
               "mesh_param": (mesh_param, "set the degrees in the config's parallel section")}
    for name, (value, fix) in refused.items():
        if value is not None:
            raise ValueError(f"initialize({name}=...) is refused by tinyscale: {fix}")
    if model is None:
        raise ValueError("initialize: model is required")
    config = _config_source(args, config, config_params)
    init_distributed(dist_init_required=dist_init_required)
    loaded = EngineConfig.load(config)
    if loaded.parallel.context > 1:
        raise ConfigError("config field 'parallel.context' > 1 is refused by tinyscale.deepspeed: a module's "
                          "forward returns the loss of this rank's sequence shard, which the script would take "
                          "for the batch's; use tinyscale.initialize and engine.train_batch(batch)")
    param_groups = _param_groups(model, model_parameters, optimizer)
    factory = _optimizer_factory(optimizer)
    engine = Engine(model, loaded, param_groups=param_groups, optimizer=factory)
    local_rank = int(os.environ.get("LOCAL_RANK", getattr(args, "local_rank", 0) or 0))
    wrapped = DeepSpeedEngine(engine, local_rank=local_rank)
    loader = None
    if training_data is not None:
        from tinyscale.deepspeed.data import deepspeed_loader
        loader = deepspeed_loader(training_data, engine.batch.micro_batch_size, engine.dp_size, engine.dp_rank,
                                  collate_fn)
    return wrapped, wrapped.optimizer, loader, None


def _config_source(args, config, config_params):
    given = {"config": config, "config_params": config_params,
             "args.deepspeed_config": getattr(args, "deepspeed_config", None)}
    set_ = [k for k, v in given.items() if v is not None]
    if len(set_) > 1:
        raise ValueError(f"initialize: the config is given twice ({' and '.join(set_)}); pass one")
    if not set_:
        raise ValueError("initialize: no config: pass config= (a path or dict) or --deepspeed_config PATH")
    return given[set_[0]]


def _param_groups(model: torch.nn.Module, model_parameters, optimizer):
    """model_parameters (and a torch optimizer instance's groups) -> a callable building the
    same groups by parameter name, after the engine has placed the parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("initialize(optimizer=...): the optimizer has already stepped; its state cannot be "
                             "moved to the engine's parameters: pass a fresh one, or its class")
        if model_parameters is not None:
            raise ValueError("initialize: pass the optimizer's parameters once, in the optimizer or in "
                             "model_parameters, not both")
        model_parameters = optimizer.param_groups
    if model_parameters is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    groups = list(model_parameters)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    named = []
    for group in groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(f"initialize(model_parameters=...): {len(unknown)} tensor(s) are not parameters of "
                             "the model; pass model.parameters() or groups of them")
        named.append({**{k: v for k, v in group.items() if k != "params"},
                      "params": [names[id(p)] for p in group["params"]]})
    listed = {n for g in named for n in g["params"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if trainable - listed:
        raise ValueError(f"initialize(model_parameters=...) leaves out trainable parameters "
                         f"{sorted(trainable - listed)[:5]}: freeze them (requires_grad=False) or list them")
    if isinstance(optimizer, torch.optim.Optimizer):  # the instance's defaults are its own, not overrides
        named = [{k: v for k, v in g.items() if k not in optimizer.defaults or v != optimizer.defaults[k]}
                 for g in named]
    if len(named) == 1 and set(named[0]) == {"params"}:
        return None  # one group of every trainable parameter: the engine's default

    def build(placed: torch.nn.Module) -> list[dict]:
        by_name = dict(placed.named_parameters())
        return [{**g, "params": [by_name[n] for n in g["params"] if n in by_name and by_name[n].requires_grad]}
                for g in named]  # a pipeline rank holds its stages' parameters only
    return build


def _optimizer_factory(optimizer):
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer  # the config's, or a class / callable tinyscale.initialize takes
    kind = type(optimizer)
    takes = inspect.signature(kind.__init__).parameters  # defaults may hold more (AdamW: decoupled_weight_decay)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in takes}
    return lambda groups: kind(groups, **defaults)
