"""Megatron's `overlap_param_gather` for ZeRO stages 1 and 2: the parameter all-gather hidden
behind the next forward.

    zero = ZeroStage2(model.parameters(), make, overlap_param_gather=True, module=model)

After the optimizer step, stages 1 and 2 all-gather every unit's updated shards into the full
parameters. Blocking, that gather has nothing to overlap with (DDP's whole all-reduce runs
inside backward). With this on, `ShardedOptimizer.step` launches each unit's gather
asynchronously, the unit holding the first layers first (units are cut in backward's order,
so the last unit is the one forward reads first), and returns (optionally in pieces:
`ShardedOptimizer.gather_piece_numel`). The gather writes straight into the parameters
(their unit's flat buffer, `params_flat`). Whoever reads a parameter before the next
forward must wait for it:

- a forward pre-hook on every module below `module` waits for the units of the parameters
  it holds (its own and its submodules'; the root: its own only, or it would wait for all at
  once), so each unit is waited for by the first module that reads it, in training or
  evaluation, with or without grad, even one that reads a child's weight itself, except the
  root: a root forward that reads a child's weight before calling that child reads it
  unwaited, mid-gather (the GPT here reads every weight through the module holding it);
- state-dict and load-state-dict pre-hooks on the same modules wait for them
  (``model.state_dict()``, and so every checkpoint that reads it; ``load_state_dict``, which
  a gather landing after it would undo);
- the stage's next `step()`, `abandon_backward()`, and the master loads of `state_dict.py`
  wait for all of them;
- anything else that reads the parameters (``p.data`` copied or replaced, an EMA over
  ``model.parameters()``, a parameter read by a module that does not own it) must call
  ``zero.wait_params()`` first. That contract is why it is off by default.
"""

from __future__ import annotations

import torch

from tinyscale.zero.optimizer import ShardedOptimizer


# --8<-- [start:hooks]
def install_param_gather_hooks(sharded: ShardedOptimizer, module: torch.nn.Module) -> list:
    """Forward and state-dict pre-hooks on each module of `module` that holds parameters of
    `sharded`, waiting for the gathers of those parameters. Returns the hook handles."""
    where = {id(p): (i, j) for i, unit in enumerate(sharded.units) for j, p in enumerate(unit.params)}
    owned = set()
    handles = []
    for sub in module.modules():
        held = list(sub.parameters(recurse=sub is not module))
        mine = sorted({where[id(p)] for p in held if id(p) in where})
        if not mine:
            continue
        owned.update(id(p) for p in held)

        def wait(*_, mine=tuple(mine)):
            sharded.wait_params(mine)

        handles.append(sub.register_forward_pre_hook(wait))
        handles.append(sub.register_state_dict_pre_hook(wait))
        handles.append(sub.register_load_state_dict_pre_hook(wait))  # a gather landing later would undo the load
    missing = [i for i in where if i not in owned]
    if missing:
        for h in handles:
            h.remove()
        raise ValueError(f"overlap_param_gather: {len(missing)} parameter(s) are not owned by any module of "
                         "`module`: pass the model that holds every parameter given to the stage")
    return handles
# --8<-- [end:hooks]
