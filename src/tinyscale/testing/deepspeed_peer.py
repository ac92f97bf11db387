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
- ``configs``: whether DeepSpeed's own config parser accepts each config (and its message if not).
- ``train``: DeepSpeed's engine on `world_size` gloo ranks training the GPT on given batches.
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


# --- the tasks, run in the child process --------------------------------------------------------


def _single_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # DeepSpeed's scalers ask dist.get_rank() before they log
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")


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
    """Each case: fp16 keys (DeepSpeed's names) and `overflows` (one bool per step)."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    _single_process_group()
    out = []
    for case in cases:
        f = case["fp16"]
        zero = DynamicLossScaler(init_scale=2.0**f["initial_scale_power"], scale_window=f["loss_scale_window"],
                                 min_scale=f["min_loss_scale"], delayed_shift=f["hysteresis"],
                                 consecutive_hysteresis=f["consecutive_hysteresis"])
        # Stage 0's FP16_Optimizer keeps its scale in loss_scale_config and updates it in
        # _update_scale (fused_optimizer.py); its own state is all that method reads.
        stage0 = object.__new__(FP16_Optimizer)
        stage0.verbose = False
        stage0.loss_scale_config = SimpleNamespace(
            dynamic_loss_scale=True, cur_scale=2.0**f["initial_scale_power"], scale_factor=2.0,
            min_loss_scale=f["min_loss_scale"], cur_iter=0, last_overflow_iter=-1,
            scale_window=f["loss_scale_window"])
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
        out.append(result)
    return out


def configs(cases: list[dict]) -> list[dict]:
    """Whether DeepSpeedConfig accepts each config dict (world size 1 for the batch identity)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    _single_process_group()
    out = []
    for raw in cases:
        try:
            DeepSpeedConfig(json.loads(json.dumps(raw)))
            out.append({"accepted": True, "message": ""})
        except Exception as exc:  # noqa: BLE001 - any refusal, whatever DeepSpeed raises
            out.append({"accepted": False, "message": f"{type(exc).__name__}: {exc}"[:300]})
    return out


def main() -> None:
    task = sys.argv[1]
    payload = json.loads(sys.stdin.read())
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints; stdout carries only the answer
        if task == "train":
            from tinyscale.testing.deepspeed_train import train

            answer = train(payload)
        else:
            answer = {"schedules": schedules, "scalers": scalers, "configs": configs}[task](payload)
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
