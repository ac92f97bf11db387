"""DeepSpeed's side of the agreement tests: run DeepSpeed 0.19.8 itself, in a process of its own.

`pytest -k deepspeed_agreement` and ``benchmarks/deepspeed.py`` call `run(task, payload)`, which
starts ``python -m tinyscale.testing.deepspeed_peer TASK`` with ``DS_ACCELERATOR=cpu``, sends the
payload as JSON on stdin and reads the answer as JSON from stdout. Importing deepspeed patches
torch and logging process-wide, so it never happens in the caller's process (nor in the test
harness's pooled ranks). Tasks:

- ``schedules``: each case's DeepSpeed scheduler, built as its engine builds it from the config's
  ``scheduler`` section (``lr_schedules.<type>(optimizer, **params)``), stepped after each
  optimizer step as its engine steps it; the learning rate of every step.
- ``scalers``: each overflow sequence through DeepSpeed's two dynamic loss scalers: the ZeRO
  optimizers' ``DynamicLossScaler.update_scale`` and stage 0's ``FP16_Optimizer._update_scale``;
  the scale in force at every step, or the step at which it raised.
- ``fp16_growth``: DeepSpeed's engine in fp16 (its CPU check switched off) applying a known
  gradient: the update of every step, at ZeRO stages 0 and 1.
- ``configs``: whether DeepSpeed's own config parser accepts each config (and its message if not).
- ``train``: DeepSpeed's engine on `world_size` gloo ranks training the GPT on given batches.

`run_many({task: payload, ...})` runs several of the one-process tasks (all but ``train``) in one
process, in the order given: each process spends ~4 s importing DeepSpeed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 300


def available() -> bool:
    """Whether deepspeed is installed (the ``peers`` extra), without importing it here."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def run(task: str, payload, timeout_s: float = TIMEOUT_S):
    """The answer of `task` for `payload`, computed by DeepSpeed in a fresh process."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    done = subprocess.run([sys.executable, "-m", "tinyscale.testing.deepspeed_peer", task],
                          input=json.dumps(payload), capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"deepspeed_peer {task} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_many(tasks: dict, timeout_s: float = TIMEOUT_S) -> dict:
    """{task: answer} for {task: payload}, all computed in one DeepSpeed process, in order."""
    if "train" in tasks or "many" in tasks:
        raise ValueError("run_many: 'train' starts ranks of its own and 'many' nests; call run() for them")
    answers = run("many", [[task, payload] for task, payload in tasks.items()], timeout_s=timeout_s)
    return dict(zip(tasks, answers))


# --- the tasks, run in the child process --------------------------------------------------------


def schedules(cases: list[dict]) -> list[list[float]]:
    import torch
    from deepspeed.runtime import lr_schedules

    out = []
    for case in cases:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=case["lr"])
        sched = getattr(lr_schedules, case["type"])(opt, **case["params"])
        lrs = []
        for _ in range(case["steps"]):
            lrs.append(opt.param_groups[0]["lr"])  # what this optimizer step uses
            sched.step()  # the engine steps it after each applied optimizer step
        out.append(lrs)
    return out


def scalers(cases: list[dict]) -> list[dict]:
    """Each case: an ``fp16`` section (DeepSpeed's keys) and `overflows` (one bool per step).
    Both scalers are built from the section as DeepSpeed's engine builds them: the ZeRO
    optimizers' through ``CreateLossScaler``, stage 0's FP16_Optimizer through ``LossScaleConfig``
    (FP16_UnfusedOptimizer's ``_update_scale`` is the same code)."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    # update_scale asks deepspeed.comm for the rank only to decide who logs; rank 0 here (no
    # process group needed).
    # Put back afterwards: a later task in the same process (run_many) may use a real group.
    real_dist, loss_scaler.dist = loss_scaler.dist, SimpleNamespace(get_rank=lambda: 0)
    try:
        return [_scale_both(case, loss_scaler, FP16_Optimizer, DeepSpeedFP16Config) for case in cases]
    finally:
        loss_scaler.dist = real_dist


def _scale_both(case: dict, loss_scaler, FP16_Optimizer, DeepSpeedFP16Config) -> dict:
    """One overflow script through both of DeepSpeed's scalers: the scale at each step, or where it raised."""
    import torch

    args = DeepSpeedFP16Config(enabled=True, **case["fp16"]).dynamic_loss_scale_args()
    zero = loss_scaler.CreateLossScaler(dtype=torch.float16, static_loss_scale=0, dynamic_scaling=True,
                                        dynamic_loss_args=args)
    stage0 = object.__new__(FP16_Optimizer)  # _update_scale reads only these two attributes
    stage0.verbose = False
    stage0.loss_scale_config = loss_scaler.LossScaleConfig(torch.float16, True, 0, args)
    result = {}
    for name, scale_of, update in (
            ("zero", lambda: zero.cur_scale, zero.update_scale),
            ("stage0", lambda: stage0.loss_scale_config.cur_scale, stage0._update_scale)):
        scales, raised_at = [], None
        for step, overflow in enumerate(case["overflows"]):
            scales.append(float(scale_of()))  # the scale this step's loss is multiplied by
            try:
                update(overflow)
            except Exception:  # DeepSpeed raises a bare Exception at the minimum scale
                raised_at = step
                break
        result[name] = {"scales": scales, "raised_at": raised_at}
    return result


def skip_shm_op() -> None:
    """Make deepspeed.init_distributed skip its shared-memory op (`deepspeed.comm.torch.build_shm_op`).

    The op serves `inference_all_reduce` only (AutoTP inference layers), which falls back to
    torch's all_reduce without it; training's collectives go to torch.distributed either way. Loading
    it cost ~3.3 s per process even when cached (a ninja check; minutes to build the first time)."""
    import deepspeed.comm.torch as ds_torch

    ds_torch.build_shm_op = lambda: None


def _process_group_of_one() -> None:
    """A gloo group of one rank, through deepspeed.init_distributed (its shared-memory op skipped)."""
    import socket

    import deepspeed

    skip_shm_op()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")


def fp16_growth(payload: dict) -> dict:
    """DeepSpeed's engine, fp16, SGD (lr 1) on w . x with w = 0: the update of every step, at
    each ZeRO stage asked for. DeepSpeed's CPU accelerator says fp16 is unsupported on this CPU
    (no oneDNN fp16), so the check is switched off here: fp16 arithmetic itself runs on any CPU."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True
    _process_group_of_one()
    x = torch.tensor([payload["x"]], dtype=torch.float16)
    out = {}
    for stage in payload["stages"]:
        model = torch.nn.Linear(len(payload["x"]), 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        config = {"train_batch_size": 1, "gradient_clipping": 0.0, "fp16": {"enabled": True, **payload["fp16"]},
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=config)
        rows = []
        for _ in range(payload["steps"]):
            before = engine.module.weight.detach().float().clone()
            engine.backward(engine(x).float().sum())
            engine.step()
            rows.append((engine.module.weight.detach().float() - before)[0].tolist())
        out[str(stage)] = rows
    return out


def configs(cases: list[dict]) -> list[dict]:
    """Whether DeepSpeed accepts each case's ``config`` on ``world_size`` data-parallel ranks:
    its config parser (``DeepSpeedConfig``, told the data-parallel size), then
    its scheduler built from the ``scheduler`` section as its engine builds it."""
    from types import SimpleNamespace

    import torch
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import lr_schedules

    real_dist, out = ds_config.dist, []
    for case in cases:
        raw = json.loads(json.dumps(case["config"]))
        dp = case.get("world_size", 1)
        # DeepSpeedConfig reads the rank and world size from deepspeed.comm (world 1 without a
        # process group): answer as rank 0 of `dp` ranks, so the batch identity is checked at dp.
        ds_config.dist = SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda *a, dp=dp: dp)
        try:
            parsed = ds_config.DeepSpeedConfig(raw)
            sched = raw.get("scheduler")
            if sched:
                opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))],
                                      lr=raw.get("optimizer", {}).get("params", {}).get("lr", 1e-3))
                getattr(lr_schedules, sched["type"])(opt, **sched.get("params", {}))
            out.append({"accepted": True, "message": "", "gradient_clipping": parsed.gradient_clipping})
        except Exception as exc:  # noqa: BLE001 - any refusal, whatever DeepSpeed raises
            out.append({"accepted": False, "message": f"{type(exc).__name__}: {exc}"[:300]})
    ds_config.dist = real_dist  # a later task in the same process (run_many) may use a real group
    return out


def main() -> None:
    task = sys.argv[1]
    payload = json.loads(sys.stdin.read())
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints; stdout carries only the answer
        tasks = {"schedules": schedules, "scalers": scalers, "configs": configs, "fp16_growth": fp16_growth}
        if task == "train":
            from tinyscale.testing.deepspeed_train import train

            answer = train(payload)
        elif task == "many":
            answer = [tasks[name](one) for name, one in payload]
        else:
            answer = tasks[task](payload)
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
