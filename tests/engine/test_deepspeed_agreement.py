"""tinyscale against DeepSpeed 0.19.8 itself: the same config, the same numbers.

DeepSpeed runs in a process of its own (`tinyscale.testing.deepspeed_peer`), so importing it
never touches this one. Each test sends DeepSpeed the whole batch of cases at once and compares
every value; the four one-process tasks share one DeepSpeed process (`_theirs`: each process
spends ~4 s importing DeepSpeed):

- learning-rate schedulers: 320 parameter sets, every step equal;
- the fp16 loss scaler: 240 overflow scripts through DeepSpeed's ZeRO and stage-0 scalers;
- a growth step's unscale, on DeepSpeed's engine (which is right, shown with a known gradient);
- 49 configs accepted or refused alike, or the difference listed in docs/deepspeed-config.md;
- ZeRO stages 0-3 training the GPT on DeepSpeed's engine and tinyscale's (more under --thorough).

DeepSpeed's shared-memory op (inference only) is skipped: `deepspeed_peer.skip_shm_op`.

    pytest -k deepspeed_agreement            # needs the `peers` extra: pip install -e ".[peers]"
"""

from __future__ import annotations

import functools
import itertools

import pytest

from tinyscale.config import EngineConfig
from tinyscale.optim import lr_at
from tinyscale.testing import deepspeed_peer

pytestmark = pytest.mark.skipif(not deepspeed_peer.available(),
                                reason="DeepSpeed is not installed: pip install -e '.[peers]' (make setup does)")


@functools.cache
def _theirs() -> dict:
    """DeepSpeed's answers for the scheduler, scaler, growth-step and config tests, from one process."""
    return deepspeed_peer.run_many({
        "schedules": _schedule_cases(), "scalers": _scaler_cases(),
        "configs": [{"config": c, "world_size": 2} for c in _config_cases().values()],
        "fp16_growth": {"x": GROWTH_X, "steps": 3, "fp16": GROWTH_FP16, "stages": [0, 1]},  # last: it starts a group
    }, timeout_s=900)


# --- learning-rate schedulers -------------------------------------------------------------------

def _schedule_cases() -> list[dict]:
    """Every scheduler type x warm-up shape x warm-up length (1 and 2 are the clamp's edge,
    None is the default 1000) x the type's own keys (given or left to their defaults) x two
    optimizer lrs: 320 parameter sets, each run 60 steps past its end."""
    cases = []
    for kind, warmup_type, warmup, lr in itertools.product(
            ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"), ("log", "linear"), (None, 1, 2, 37), (3e-4, 0.1)):
        base = {"warmup_type": warmup_type} | ({} if warmup is None else {"warmup_num_steps": warmup})
        w = warmup or 1000
        if kind == "WarmupCosineLR":
            own = [{}, {"warmup_min_ratio": 0.1}, {"cos_min_ratio": 0.2}, {"warmup_min_ratio": 0.3, "cos_min_ratio": 0}]
        else:
            own = [{}, {"warmup_min_lr": 1e-5}, {"warmup_max_lr": 5e-3}, {"warmup_min_lr": 2e-4, "warmup_max_lr": 2e-4}]
        totals = [None] if kind == "WarmupLR" else [w, 2 * w + 11]
        for params, total in itertools.product(own, totals):
            extra = {} if total is None else {"total_num_steps": total}
            cases.append({"type": kind, "lr": lr, "params": base | params | extra, "steps": (total or w) + 60})
    return cases


def _tinyscale_lrs(case: dict) -> list[float]:
    cfg = EngineConfig.load({"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": case["lr"]}},
                             "scheduler": {"type": case["type"], "params": case["params"]}})
    return [lr_at(step, cfg) for step in range(case["steps"])]


def test_deepspeed_agreement_schedulers_give_deepspeeds_lr_at_every_step():
    cases = _schedule_cases()
    theirs = _theirs()["schedules"]
    differ = []
    for case, ds in zip(cases, theirs):
        ours = _tinyscale_lrs(case)
        # equal, not close: lr_at does DeepSpeed's arithmetic in DeepSpeed's order
        bad = [step for step, (a, b) in enumerate(zip(ours, ds)) if a != b]
        if bad:
            differ.append(f"{case['type']} lr {case['lr']} {case['params']}: first at step {bad[0]}, "
                          f"tinyscale {ours[bad[0]]!r} DeepSpeed {ds[bad[0]]!r}")
    assert len(cases) == 320 and not differ, f"{len(differ)} of {len(cases)} differ:\n" + "\n".join(differ[:10])


# --- the fp16 loss scaler -----------------------------------------------------------------------
# DeepSpeed refuses fp16 on this CPU ("Type fp16 is not supported on your device": its CPU
# accelerator allows fp16 only where oneDNN has fp16 kernels), so its engine cannot run an fp16
# step here. What decides the trajectory is its scaler's update rule, and that is plain Python:
# the peer drives DeepSpeed's own DynamicLossScaler (ZeRO stages 1-3) and FP16_Optimizer's
# _update_scale (stage 0) with scripted overflows, as their step() calls them.

def _scaler_cases() -> list[dict]:
    """240 overflow scripts of 60 steps over the fp16 keys: windows 1-5, hysteresis 1-3,
    consecutive or not, overflow rates from rare to most steps, floors reached and not."""
    import random

    rng = random.Random(27)
    cases = []
    for i in range(240):
        power = rng.choice([0, 1, 2, 4, 8, 16])
        f = {"initial_scale_power": power, "loss_scale_window": rng.randint(1, 5), "hysteresis": rng.randint(1, 3),
             "consecutive_hysteresis": rng.random() < 0.5, "min_loss_scale": 2 ** rng.randint(0, power)}
        rate = (0.05, 0.2, 0.4, 0.7)[i % 4]
        cases.append({"fp16": f, "overflows": [rng.random() < rate for _ in range(60)]})
    return cases


def _tinyscale_scales(case: dict, **override) -> dict:
    from tinyscale.precision import DynamicLossScaler

    f = case["fp16"] | override
    scaler = DynamicLossScaler(**f)
    scales, raised_at = [], None
    for step, overflow in enumerate(case["overflows"]):
        scales.append(scaler.scale)
        try:
            scaler.update(overflow)
        except FloatingPointError:
            raised_at = step
            break
    return {"scales": scales, "raised_at": raised_at}


def test_deepspeed_agreement_loss_scaler_follows_deepspeeds_zero_path_and_shows_stage0s_quirk():
    cases = _scaler_cases()
    theirs = _theirs()["scalers"]
    zero_differ = [i for i, (c, ds) in enumerate(zip(cases, theirs)) if _tinyscale_scales(c) != ds["zero"]]
    assert not zero_differ, f"{len(zero_differ)} of {len(cases)} differ from DeepSpeed's ZeRO scaler, e.g. " \
                            f"{cases[zero_differ[0]]} -> {theirs[zero_differ[0]]['zero']}"
    assert sum(ds["zero"]["raised_at"] is not None for ds in theirs) >= 20  # the floor is exercised
    # Stage 0's FP16_Optimizer ignores hysteresis and skips for ever at the floor: it is our
    # rule with hysteresis 1 that never raises. tinyscale keeps one rule at every stage (the
    # config's hysteresis honoured, an overflow at the floor raising), so a DeepSpeed stage-0
    # fp16 run with hysteresis > 1 halves sooner than ours; docs/deepspeed-config.md says so.
    stage0_differ = [i for i, (c, ds) in enumerate(zip(cases, theirs))
                     if _tinyscale_scales(c, hysteresis=1, raise_at_min_scale=False) != ds["stage0"]]
    assert not stage0_differ, f"{len(stage0_differ)} of {len(cases)} differ from DeepSpeed's stage-0 scaler"
    quirk = sum(ds["stage0"] != ds["zero"] for ds in theirs)
    assert quirk >= len(cases) // 2  # the two DeepSpeed paths really disagree, on most scripts


GROWTH_X = [0.125, 0.25, 0.375, 0.5]  # |x| < 1 and exact in fp16: no clipping, no rounding
GROWTH_FP16 = {"initial_scale_power": 4, "loss_scale_window": 1, "hysteresis": 1}


def test_deepspeed_agreement_growth_step_unscales_with_the_scale_that_scaled_the_loss():
    """Which is right on a growth step: DeepSpeed updates the scale before it unscales, so the
    step that doubles S divides gradients made with S by 2S. SGD (lr 1) on w . x from w = 0:
    the true update is -x every step. Window 1 makes every clean step after the first a growth
    step. Found running DeepSpeed: its stage 0 in fp16 does not scale the loss in
    engine.backward at all (only ZeRO optimizers' scale_if_loss does), yet unscales by S."""
    import torch

    from tinyscale.precision import DynamicLossScaler, MixedPrecisionOptimizer

    x, fp16 = GROWTH_X, GROWTH_FP16
    theirs = _theirs()["fp16_growth"]
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    mp = MixedPrecisionOptimizer([w], lambda g: torch.optim.SGD(g, lr=1.0), dtype=torch.float16,
                                 loss_scaler=DynamicLossScaler(**fp16))
    ours, scales = [], []
    for _ in range(3):
        before = w.detach().float().clone()
        scales.append(mp.loss_scale)
        mp.backward((w * torch.tensor(x, dtype=torch.float16)).sum())
        mp.step()
        mp.zero_grad()
        ours.append((w.detach().float() - before).tolist())
    minus_x = [-v for v in x]
    assert scales == [16, 16, 32] and mp.loss_scale == 64  # it grew on steps 1 and 2 (DeepSpeed's rule)...
    assert ours == [minus_x] * 3  # ...and every step applied the true gradient
    assert theirs["1"] == [minus_x] + [[v / 2 for v in minus_x]] * 2  # DeepSpeed ZeRO: growth steps halve it
    # stage 0: gradients never multiplied by S, then divided by the S after this step's update
    assert theirs["0"] == [[v / s for v in minus_x] for s in (16, 32, 64)]


# --- ZeRO stages 0-3 on the GPT -----------------------------------------------------------------
# DeepSpeed reduces only fp16, bf16 and fp32 gradients ("unsupported grad type: torch.float64"),
# so these runs are float32, and one float64 process is the referee.

GPT_SMALL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32,
             "tie_embeddings": False}


def _zero_payload(stages, config: dict, steps: int, model=GPT_SMALL) -> dict:
    from tinyscale.data import synthetic_token_batches

    batches = synthetic_token_batches(num_batches=steps, batch_size=config["train_batch_size"], seq_len=16,
                                      vocab_size=model["vocab_size"], seed=1)
    return {"world_size": 2, "stages": list(stages), "model": model, "seed": 0, "dtype": "float32",
            "batches": [[t.tolist() for t in b] for b in batches], "config": config}


def _reference64(payload: dict) -> tuple[list[float], dict]:
    """The same training in one float64 process (tinyscale.reference.train): the truth."""
    import torch

    import tinyscale as ts
    from tinyscale.models import GPT, GPTConfig

    model = GPT(GPTConfig(**payload["model"]), seed=payload["seed"], dtype=torch.float64)
    config = {k: v for k, v in payload["config"].items() if k != "zero_optimization"}
    if config.get("optimizer", {}).get("params", {}).get("torch_adam"):
        config["optimizer"] = {**config["optimizer"], "params": {
            k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"}}
    batches = [tuple(torch.tensor(t) for t in b) for b in payload["batches"]]
    losses = ts.reference.train(model, batches, config)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _max_rel(params: dict, truth: dict) -> float:
    import torch

    return max(((torch.tensor(params[k], dtype=torch.float64) - t).abs().max() / t.abs().max()).item()
               for k, t in truth.items())


def _check_zero_agreement(payload: dict, param_gap: float = 2e-6) -> dict:
    import math

    theirs = deepspeed_peer.run("train", payload, timeout_s=900)  # the first run builds DeepSpeed's op
    ref_losses, ref_params = _reference64(payload)
    # float32 against float32: each side's gradient is the exact one plus rounding from its own
    # summation order (DeepSpeed sums then divides, tinyscale divides then sums; buckets differ),
    # a few float32 ulps (6e-8 each) per element; a few SGD/Adam steps carry that into the
    # parameters and losses at the same order. 2e-6 is ~30 ulps: far below a real difference
    # (a wrong scale, a missed micro-batch or rank is >= 1e-3 here), far above the rounding.
    FP32_REL = 2e-6
    # against float64 one process: the same rounding, plus float32's own forward/backward
    FP64_REL = 1e-4
    seen = {}
    for stage, runs in theirs.items():
        ds, ours = runs["deepspeed"], runs["tinyscale"]
        for a, b, r in zip(ds["losses"], ours["losses"], ref_losses):
            assert math.isclose(a, b, rel_tol=FP32_REL), (stage, ds["losses"], ours["losses"])
            assert math.isclose(b, r, rel_tol=FP64_REL), (stage, ours["losses"], ref_losses)
        assert _max_rel(ds["parameters"], ref_params) < FP64_REL and _max_rel(ours["parameters"], ref_params) < FP64_REL
        import torch
        gap = max((torch.tensor(ds["parameters"][k]) - torch.tensor(ours["parameters"][k])).abs().max().item()
                  / ref_params[k].abs().max().item() for k in ref_params)
        assert gap < param_gap, (stage, gap, _max_rel(ds["parameters"], ref_params),
                                 _max_rel(ours["parameters"], ref_params))
        seen[stage] = gap
        for side in (ds, ours):  # benchmarks/deepspeed.py's CPU column: every step's, both ranks summed
            assert len(side["cpu_seconds"]) == len(side["seconds"]) == len(payload["batches"])
            assert all(t > 0 for t in side["cpu_seconds"]), side["cpu_seconds"]
    return seen


def test_deepspeed_agreement_zero_stages_train_the_gpt_as_deepspeed_does():
    """SGD with momentum, accumulation 2, GQA, 2 ranks: ZeRO stages 0 and 3 (the unsharded and the
    fully sharded; 1 and 2 with AdamW under --thorough)."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    gaps = _check_zero_agreement(_zero_payload((0, 3), config, steps=3))
    assert set(gaps) == {"0", "3"}


@pytest.mark.thorough
@pytest.mark.parametrize("tied", [False, True])
def test_deepspeed_agreement_zero_stages_with_adamw_clipping_and_decay(tied):
    """AdamW (torch's, torch_adam true, on both sides) with weight decay and clipping on, every
    stage, tied embeddings or not, 4 steps."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.5,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}}}
    model = {**GPT_SMALL, "tie_embeddings": tied}
    # Adam divides by sqrt(v): an element whose gradient is at rounding level (a sum that
    # cancels) gets m / sqrt(v) of either sign, so float32 rounding can move it by up to lr per
    # step in one run and not the other. The parameters are held to each other at the float64
    # referee's bound instead of SGD's ulps; both are also within it of the truth (measured:
    # stage 3's gap 3.4e-6 of the tensor's largest element, stages 0-2 below 2e-6).
    gaps = _check_zero_agreement(_zero_payload((0, 1, 2, 3), config, steps=4, model=model), param_gap=1e-4)
    assert set(gaps) == {"0", "1", "2", "3"}


# --- configs ------------------------------------------------------------------------------------

def _config_cases() -> dict[str, dict]:
    """Every DeepSpeed config file in tests/ and the edge cases the config tests probe, each on
    2 data-parallel ranks: name -> config."""
    import json
    from pathlib import Path

    files = sorted((Path(__file__).parent / "deepspeed_configs").glob("*.json"))
    cases = {f"file:{f.stem}": json.loads(f.read_text()) for f in files}
    base = {"train_batch_size": 8}
    warm = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    edges = {
        # types (tests/engine/test_config_strict.py)
        "stage_true": {"zero_optimization": {"stage": True}},
        "batch_string": {"train_batch_size": "8"},
        "lr_string": {"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}},
        "clipping_true": {"gradient_clipping": True},
        "fp16_enabled_1": {"fp16": {"enabled": 1}},
        "overlap_comm_string": {"zero_optimization": {"overlap_comm": "false"}},
        "batch_integral_float": {"train_batch_size": 8.0},
        "lr_int": {"optimizer": {"type": "AdamW", "params": {"lr": 1}}},
        # batch identity
        "batch_identity_ok": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                              "gradient_accumulation_steps": 2},
        "batch_identity_broken": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                  "gradient_accumulation_steps": 1},
        "micro_only": {"train_batch_size": None, "train_micro_batch_size_per_gpu": 2},
        "no_batch": {"train_batch_size": None},
        # fp16 / bf16
        "fp16_and_bf16": {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16_min_scale_fraction": {"fp16": {"enabled": True, "min_loss_scale": 0.5}},
        "fp16_hysteresis_0": {"fp16": {"enabled": True, "hysteresis": 0}},
        "fp16_window_0": {"fp16": {"enabled": True, "loss_scale_window": 0}},
        "fp16_negative_scale": {"fp16": {"enabled": True, "loss_scale": -1}},
        "fp16_raise_error_at_min_scale": {"fp16": {"enabled": True, "raise_error_at_min_scale": True}},
        "fp16_static": {"fp16": {"enabled": True, "loss_scale": 128}},
        # ZeRO
        "stage_4": {"zero_optimization": {"stage": 4}},
        "offload_optimizer_stage0": {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        "offload_param_stage3": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        "unknown_zero_key": {"zero_optimization": {"stage": 1, "reduce_scater": True}},
        "unknown_top_key": {"steps_per_prnt": 10},
        "negative_clipping": {"gradient_clipping": -1.0},
        # schedulers
        "warmuplr_defaults": {"scheduler": {"type": "WarmupLR"}},
        "warmuplr": {"scheduler": warm},
        "warmup_steps_0": {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
        "warmup_steps_1": {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}},
        "warmup_max_below_min": {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1,
                                                                              "warmup_max_lr": 0.01}}},
        "decay_without_total": {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
        "decay_total_below_warmup": {"scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_num_steps": 10, "total_num_steps": 5}}},
        "cosine_with_max_lr": {"scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": 10, "warmup_max_lr": 0.1}}},
        "cosine": {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10,
                                                                      "warmup_min_ratio": 0.1}}},
        "warmup_type_unknown": {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
        # DeepSpeed's AutoTP degree: tinyscale's parallel.tensor (dp 1 of the 2 ranks: 8 rows per rank)
        "autotp_size_2": {"tensor_parallel": {"autotp_size": 2}},
        # types DeepSpeed builds and tinyscale does not
        "optimizer_lamb": {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}},
        "scheduler_onecycle": {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4,
                                                                            "cycle_max_lr": 1e-3}}},
    }
    for name, extra in edges.items():
        config = {k: v for k, v in {**base, **extra}.items() if v is not None}
        cases[f"edge:{name}"] = config
    return cases


# Where the two differ on purpose; docs/deepspeed-config.md lists each with its reason (checked below).
CONFIG_DIFFERENCES = {
    # DeepSpeed alone refuses "auto": Hugging Face's Trainer fills it in before DeepSpeed reads the file
    "file:hf_trainer_zero2_auto": "tinyscale resolves \"auto\"",
    "file:hf_trainer_zero3_auto": "tinyscale resolves \"auto\"",
    # tinyscale refuses more than DeepSpeed, and says why
    "edge:fp16_hysteresis_0": "hysteresis 0",
    "edge:warmup_max_below_min": "warmup_max_lr below warmup_min_lr",
    "edge:decay_total_below_warmup": "total_num_steps below warmup_num_steps",
    "edge:warmup_type_unknown": "unknown warmup_type",
    "edge:unknown_top_key": "unknown top-level keys",
    "edge:optimizer_lamb": "optimizer.type Lamb",
    "edge:scheduler_onecycle": "scheduler.type OneCycle",
    "edge:offload_optimizer_stage0": "offload_optimizer at stage 0",
    "edge:negative_clipping": "gradient_clipping below 0",
    # strict types: DeepSpeed's pydantic turns true into 1, "1e-3" into 0.001, 1 into true
    "edge:stage_true": "strict types",
    "edge:lr_string": "strict types",
    "edge:clipping_true": "strict types",
    "edge:fp16_enabled_1": "strict types",
    "edge:overlap_comm_string": "strict types",
    # tinyscale's own key
    "edge:fp16_raise_error_at_min_scale": "raise_error_at_min_scale",
}


def _tinyscale_accepts(config: dict, world_size: int) -> tuple[bool, str]:
    from tinyscale import ConfigError

    try:
        EngineConfig.load(config).batch(world_size)
        return True, ""
    except ConfigError as err:
        return False, str(err).splitlines()[-1][:200]


def test_deepspeed_agreement_configs_in_tests_are_accepted_or_refused_alike():
    import re
    from pathlib import Path

    cases = _config_cases()
    theirs = _theirs()["configs"]
    verdicts = {}
    for (name, config), ds in zip(cases.items(), theirs):
        ours, why = _tinyscale_accepts(config, 2)
        verdicts[name] = (ours, ds["accepted"], why or ds["message"])
    differ = {name for name, (ours, ds, _) in verdicts.items() if ours != ds}
    unexplained = {name: verdicts[name] for name in differ - set(CONFIG_DIFFERENCES)}
    assert not unexplained, f"accepted by one and refused by the other, not in CONFIG_DIFFERENCES: {unexplained}"
    stale = set(CONFIG_DIFFERENCES) - differ
    assert not stale, f"listed as differences but treated alike now: {stale}"
    docs = (Path(__file__).resolve().parents[2] / "docs" / "deepspeed-config.md").read_text()
    section = docs[docs.index("## Where DeepSpeed 0.19.8 itself differs"):]
    for name, phrase in CONFIG_DIFFERENCES.items():
        assert phrase in section, f"{name}: docs/deepspeed-config.md does not list '{phrase}'"
    assert len(cases) >= 45 and len(differ) == len(CONFIG_DIFFERENCES)
    assert sum(ours for ours, _, _ in verdicts.values()) >= 20 and re.search("OneCycle", section)
    # A default that differs: DeepSpeed 0.19.8 clips at norm 1.0 when the key is left out, tinyscale not at all
    plain = list(cases).index("edge:warmuplr")
    assert theirs[plain]["gradient_clipping"] == 1.0 and EngineConfig.load(cases["edge:warmuplr"]).gradient_clipping == 0
    assert "defaults to 1.0 in DeepSpeed 0.19.8" in section
