"""DeepSpeed configs as users write them (issue 17) and DeepSpeed's meaning for the keys tinyscale
honours (issue 19): every key of `tinyscale.deepspeed_keys.KEYS` is honoured, noted or refused
as the table (and docs/deepspeed-config.md) says; "auto" resolves or names what to set; the
configs in tests/engine/deepspeed_configs/ (written in the style of DeepSpeed's docs) load and
train. `pytest -k deepspeed_config`."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pydantic
import pytest
import torch

import tinyscale as ts
from tinyscale import ConfigError, EngineConfig
from tinyscale.config_deepspeed import AUTO
from tinyscale.data import synthetic_regression_batches, synthetic_token_batches
from tinyscale.deepspeed_keys import KEYS, OTHER_TYPES
from tinyscale.engine.engine import check_supported
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.optim import build_optimizer, lr_at

HERE = Path(__file__).parent
CORPUS = sorted((HERE / "deepspeed_configs").glob("*.json"))
DOCS = HERE.parents[1] / "docs" / "deepspeed-config.md"
BASE = {"train_batch_size": 8}


def _put(path: str, value, raw: dict | None = None) -> dict:
    raw = json.loads(json.dumps(raw if raw is not None else BASE))
    *parents, name = path.split(".")
    section = raw
    for part in parents:
        section = section.setdefault(part, {})
    if path.startswith("zero_optimization."):
        raw["zero_optimization"].setdefault("stage", 2)  # allgather_bucket_size is read at stages 1-2
    section[name] = value
    return raw


def _section_of(raw: dict, path: str) -> dict:
    for part in path.split(".")[:-1]:
        raw = raw[part]
    return raw


_CANDIDATES = (True, False, 12345, {"enabled": True}, {"enabled": False}, None, -1, 1, 0, "x")


def _values(key, same: bool) -> list:
    """Sample values the key's table entry treats as `same` (or not)."""
    out = []
    for v in _CANDIDATES:
        raw = _put(key.path, v)
        if key.same(v, _section_of(raw, key.path)) == same:
            out.append(v)
    return out


# --- the table: every DeepSpeed key known, treated as it says

@pytest.mark.parametrize("key", [k for k in KEYS if k.kind != "honoured"], ids=lambda k: k.path)
def test_deepspeed_config_key_is_noted_or_refused_as_the_table_says(key):
    value = _values(key, same=False)[0]
    raw = _put(key.path, value)
    if key.kind == "noted":
        cfg = EngineConfig.load(raw)
        assert len(cfg.notes) == 1 and cfg.notes[0].startswith(f"{key.path} = ") and key.why in cfg.notes[0]
    else:
        with pytest.raises(ConfigError, match=re.escape(f"'{key.path}' = ")) as err:
            EngineConfig.load(raw)
        assert "is refused: " + key.why in str(err.value) and "unknown key" not in str(err.value)


@pytest.mark.parametrize("key", [k for k in KEYS if k.kind != "honoured" and k.same_doc], ids=lambda k: k.path)
def test_deepspeed_config_value_meaning_what_tinyscale_does_is_accepted_silently(key):
    for value in _values(key, same=True):
        assert EngineConfig.load(_put(key.path, value)).notes == ()


def _field(path: str):
    model = EngineConfig
    for part in path.split("."):
        field = model.model_fields[part]  # KeyError: an honoured key that is not a field
        inner = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                 if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
        model = inner[0] if inner else None
    return field


def test_deepspeed_config_honoured_keys_are_fields_and_every_field_is_in_the_table():
    honoured = {k.field or k.path for k in KEYS if k.kind == "honoured"}  # a renamed key: the field it becomes
    for path in honoured:
        _field(path)
    ours = {"parallel", "compression", "monitor", "activation_checkpointing.policy", "activation_checkpointing.every_k",
            "activation_checkpointing.use_reentrant",
            "fp16.raise_error_at_min_scale", "rampup_batch_size"}  # tinyscale's own keys, not DeepSpeed's

    def leaves(model, prefix=""):
        for name, field in model.model_fields.items():
            inner = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                     if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
            if inner and prefix + name not in ours:
                yield from leaves(inner[0], prefix + name + ".")
            else:
                yield prefix + name
    fields = set(leaves(EngineConfig)) - ours
    assert fields - honoured == set(), "fields of EngineConfig missing from deepspeed_keys.KEYS"


def test_deepspeed_config_docs_table_is_the_code_table():
    text = DOCS.read_text()
    rows = dict(re.findall(r"^\| `([\w.]+)` \| (honoured|noted|refused) \|", text, flags=re.M))
    assert rows == {k.path: k.kind for k in KEYS}
    for path, types in OTHER_TYPES.items():
        for name in types:
            assert re.search(rf"`{path}`: .*{name}", text, flags=re.I), (path, name)


def test_deepspeed_config_other_optimizer_and_scheduler_types_are_refused_with_the_reason():
    for path, types in OTHER_TYPES.items():
        for name, why in types.items():
            with pytest.raises(ConfigError, match=re.escape(why)):
                EngineConfig.load(_put(path, name.upper()))


def test_deepspeed_config_autotp_size_is_parallel_tensor():
    # DeepSpeed's AutoTP degree is tinyscale's tensor degree: the same config, so the same engine
    for size, tensor in ((0, 1), (1, 1), (2, 2), (4, 4)):
        cfg = EngineConfig.load({**BASE, "tensor_parallel": {"autotp_size": size}})
        assert cfg == EngineConfig.load({**BASE, "parallel": {"tensor": tensor}}) and cfg.notes == ()
    assert EngineConfig.load({**BASE, "tensor_parallel": {"autotp_size": 2}, "parallel": {"tensor": 2}}).parallel.tensor == 2
    with pytest.raises(ConfigError, match=r"autotp_size' = 2 and parallel.tensor = 4 disagree"):
        EngineConfig.load({**BASE, "tensor_parallel": {"autotp_size": 2}, "parallel": {"tensor": 4}})
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match=r"'tensor_parallel.autotp_size' = .*an integer >= 0"):
            EngineConfig.load({**BASE, "tensor_parallel": {"autotp_size": bad}})
    with pytest.raises(ConfigError, match=r"'tensor_parallel' = \{\"tp_overlap_comm\": true\} is refused"):
        EngineConfig.load({**BASE, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}})


def test_deepspeed_config_typos_are_still_unknown_keys():
    with pytest.raises(ConfigError, match="'zero_optimization.reduce_scater': unknown key; did you mean 'reduce_scatter'"):
        EngineConfig.load({**BASE, "zero_optimization": {"reduce_scater": True}})
    with pytest.raises(ConfigError, match="'steps_per_prnt': unknown key; did you mean 'steps_per_print'"):
        EngineConfig.load({**BASE, "steps_per_prnt": 10})


# --- "auto", as Hugging Face's integration writes it

def test_deepspeed_config_auto_resolves_where_it_can():
    cfg = EngineConfig.load({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": 4}},
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
    })
    assert cfg.batch(dp=3).train_batch_size == 6  # 2 micro x 1 accumulation x 3 ranks
    p = cfg.optimizer.params
    assert (p.betas, p.eps, p.weight_decay) == ((0.9, 0.999), 1e-8, 0.0)
    assert cfg.scheduler.params.warmup_max_lr == 3e-5 and cfg.scheduler.params.warmup_min_lr == 0.0
    assert cfg.gradient_clipping == 1.0 and not cfg.fp16.enabled and not cfg.bf16.enabled
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


@pytest.mark.parametrize("path", [p for p, (action, _) in AUTO.items() if action == "refuse"]
                         + ["zero_optimization.stage"])
def test_deepspeed_config_auto_that_cannot_resolve_names_what_to_set(path):
    raw = _put(path, "auto", {**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 1, "total_num_steps": 10}}})
    with pytest.raises(ConfigError, match=re.escape(f"'{path}': \"auto\" cannot be resolved here")) as err:
        EngineConfig.load(raw)
    assert "set " in str(err.value)


# --- keys accepted before, now with DeepSpeed's meaning (issue 19)

def _schedule(kind, lr=1.0, **params):
    return EngineConfig.load({**BASE, "optimizer": {"params": {"lr": lr}},
                              "scheduler": {"type": kind, "params": params}})


def test_deepspeed_config_warmuplr_defaults_are_deepspeeds():
    # log warm-up over 1000 steps from 0 to the optimizer's lr (DeepSpeed 0.19.8's WarmupLR takes
    # warmup_max_lr=None to mean the optimizer's lr; 0.001 here was 3.3x too high for lr 3e-4)
    cfg = _schedule("WarmupLR", lr=3e-4)
    assert lr_at(0, cfg) == 0.0 and lr_at(1001, cfg) == lr_at(5000, cfg) == 3e-4
    assert lr_at(10, cfg) == pytest.approx(3e-4 * math.log(10) / math.log(1000), rel=1e-12)
    linear = _schedule("WarmupLR", lr=3e-4, warmup_type="linear")
    assert lr_at(501, linear) == pytest.approx(1.5e-4, rel=1e-12)
    assert _schedule("WarmupDecayLR", lr=3e-4, total_num_steps=2000).scheduler.params.warmup_max_lr == 0.001
    with pytest.raises(ConfigError, match="warmup_num_steps"):  # DeepSpeed's constructors raise on 0
        _schedule("WarmupLR", warmup_num_steps=0)


def test_deepspeed_config_warmupdecaylr_decays_to_warmup_min_lr():
    cfg = _schedule("WarmupDecayLR", warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=2,
                    total_num_steps=6, warmup_type="linear")
    assert [lr_at(s, cfg) for s in range(9)] == pytest.approx([0.1, 0.1, 0.55, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])


def test_deepspeed_config_warmupcosinelr_takes_ratios_of_the_optimizer_lr():
    cfg = _schedule("WarmupCosineLR", lr=2.0, warmup_min_ratio=0.2, warmup_num_steps=4, total_num_steps=14,
                    warmup_type="linear")
    # step 0 is 0 whatever warmup_min_ratio says (DeepSpeed's get_lr before its first step)
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx([0.0, 0.4, 0.8, 1.2, 1.6])
    assert lr_at(14, cfg) == pytest.approx(2.0 * 0.0001)  # DeepSpeed's default cos_min_ratio
    assert lr_at(9, cfg) == pytest.approx(2.0 * (0.0001 + 0.9999 * 0.5))
    with pytest.raises(ConfigError, match="warmup_max_lr do not belong to WarmupCosineLR"):
        _schedule("WarmupCosineLR", warmup_max_lr=1.0, total_num_steps=10)
    with pytest.raises(ConfigError, match="cos_min_ratio do not belong to WarmupLR"):
        _schedule("WarmupLR", cos_min_ratio=0.1)


def _gpt():  # fp16/bf16 need a model whose inputs are not floats of another dtype: token ids
    return GPT(GPTConfig(vocab_size=256, max_seq_len=16, n_layer=2, n_head=5, d_model=20, ffn_hidden=36),
               seed=0, dtype=torch.float32)


def _engine(config: dict, model=None):
    return ts.initialize(model or TinyMLP(seed=0), {"train_batch_size": 4, **config})


@pytest.mark.parametrize("consecutive", [True, False])
def test_deepspeed_config_fp16_consecutive_hysteresis_reaches_the_scaler(consecutive):
    engine = _engine({"fp16": {"enabled": True, "hysteresis": 2, "consecutive_hysteresis": consecutive}})
    scaler, start = engine.loss_scaler, engine.loss_scaler.scale
    for overflow in (True, False, True):  # one spare overflow, a clean step, another overflow
        scaler.update(overflow)
    assert scaler.scale == (start if consecutive else start / 2)  # the clean step restored the spare


@pytest.mark.parametrize("raise_error", [True, False])
def test_deepspeed_config_fp16_raise_error_at_min_scale(raise_error):
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 0, "hysteresis": 1,
                               "raise_error_at_min_scale": raise_error}})
    if raise_error:
        with pytest.raises(FloatingPointError, match="minimum loss scale"):
            engine.loss_scaler.update(True)
    else:
        assert engine.loss_scaler.update(True) and engine.loss_scaler.scale == 1.0  # skip, stay at the floor


def test_deepspeed_config_adam_decouples_weight_decay_unless_adam_w_mode_is_false():
    params = [torch.nn.Parameter(torch.ones(2))]

    def built(**extra):
        return build_optimizer(params, EngineConfig.load(
            {**BASE, "optimizer": {"type": "Adam", "params": {"weight_decay": 0.1, **extra}}}).optimizer)
    assert type(built()) is torch.optim.AdamW and type(built(adam_w_mode=False)) is torch.optim.Adam
    with pytest.raises(ConfigError, match="adam_w_mode applies to type Adam only"):
        EngineConfig.load({**BASE, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": True}}})


def test_deepspeed_config_pin_memory_is_noted_once_at_start_up(caplog):
    with caplog.at_level(logging.INFO):
        engine = _engine({"zero_optimization": {"stage": 2, "contiguous_gradients": False,
                                                "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
        for batch in synthetic_regression_batches(num_batches=3, batch_size=4, dim=8, seed=0):
            engine.train_batch(batch)
    notes = [r.getMessage() for r in caplog.records if r.name == "tinyscale.config"]
    assert len(notes) == 1 and "pin_memory = True: no effect without a GPU" in notes[0]
    assert "contiguous_gradients = false" in notes[0]


def test_deepspeed_config_reduce_bucket_size_at_stage3_is_noted():
    engine = _engine({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}})
    assert any("reduce_bucket_size: no effect at stage 3" in n for n in engine.config_notes)
    assert not _engine({"zero_optimization": {"stage": 3}}).config_notes


def test_deepspeed_config_steps_per_print_logs_every_n_steps(caplog):
    with caplog.at_level(logging.INFO, logger="tinyscale.engine"):
        engine = _engine({"steps_per_print": 2, "fp16": {"enabled": True}}, _gpt())
        for batch in synthetic_token_batches(num_batches=5, batch_size=4, seq_len=16, seed=0):
            engine.train_batch(batch)
    lines = [r.getMessage() for r in caplog.records if r.name == "tinyscale.engine"]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"] and "loss scale" in lines[0]


@pytest.mark.parametrize("key, value", [("pipeline_schedule", "afab"), ("virtual_stages", 2)])
def test_deepspeed_config_parallel_pipeline_keys_without_a_pipeline_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"parallel\.{key}=.* needs parallel\.pipeline > 1"):
        check_supported(EngineConfig.load({**BASE, "parallel": {key: value}}))


# --- the corpus: configs in DeepSpeed's documentation style load and train

def test_deepspeed_config_corpus_has_every_kind():
    text = " ".join(p.read_text() for p in CORPUS)
    assert len(CORPUS) >= 10
    for needle in ('"stage": 0', '"stage": 1', '"stage": 2', '"stage": 3', '"fp16"', '"bf16"', '"cpu"', '"nvme"',
                   '"scheduler"', '"activation_checkpointing"', '"auto"'):
        assert needle in text, needle


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_deepspeed_config_corpus_loads_and_trains(path, tmp_path, caplog, monkeypatch):
    raw = json.loads(path.read_text().replace("/local_nvme", str(tmp_path)))
    monkeypatch.chdir(tmp_path)  # a monitor's relative output_path (csv_monitor: "logs/") lands here
    cfg = EngineConfig.load(raw)
    with caplog.at_level(logging.WARNING, logger="tinyscale.config"):
        engine = ts.initialize(_gpt(), cfg)
    logged = [r.getMessage() for r in caplog.records if r.name == "tinyscale.config"]
    assert all(note in logged[0] for note in engine.config_notes) if engine.config_notes else not logged
    rows = engine.batch.train_batch_size
    for batch in synthetic_token_batches(num_batches=2, batch_size=rows, seq_len=16, seed=0):
        assert math.isfinite(engine.train_batch(batch))
    if raw.get("csv_monitor", {}).get("enabled"):  # honoured: DeepSpeed's file layout
        section = raw["csv_monitor"]
        assert (tmp_path / section["output_path"] / section["job_name"] / "Train_Samples_train_loss.csv").is_file()


# --- zero_optimization.reduce_scatter: false all-reduces, same training, twice the bytes

def _reduce_scatter_run(stage, reduce_scatter):
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "reduce_scatter": reduce_scatter}}
    engine = ts.initialize(TinyMLP(seed=0), config)
    engine.comm_ledger.clear()
    for batch in synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0):
        engine.train_batch(batch)
    ledger = engine.comm_ledger
    return (engine.full_state_dict(), ledger.calls("reduce_scatter"), ledger.bus_bytes("reduce_scatter"),
            ledger.bus_bytes("all_reduce"))


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_config_reduce_scatter_false_all_reduces_with_twice_the_bytes(stage):
    from tinyscale.testing import assert_state_dicts_close, run_on_ranks

    reference = TinyMLP(seed=0)
    ts.reference.train(reference, synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0),
                       {"train_batch_size": 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2,
                                                                                          "weight_decay": 0.1}}})
    scattered = run_on_ranks(_reduce_scatter_run, 3, stage, True)
    reduced = run_on_ranks(_reduce_scatter_run, 3, stage, False)
    for (_, rs_calls, rs_bytes, ar_bytes), (state, no_rs_calls, _, ar_bytes_without) in zip(scattered, reduced):
        assert rs_calls > 2 and no_rs_calls == 0
        # a ring all-reduce sends 2(N-1)/N of the buffer, a reduce-scatter (N-1)/N: the
        # gradients' all-reduces cost exactly twice; rel 1e-12: sums of the same float terms
        assert ar_bytes_without - ar_bytes == pytest.approx(2 * rs_bytes, rel=1e-12)
        assert_state_dicts_close(state, reference.state_dict())  # float64, rtol 1e-10


def test_deepspeed_config_reduce_scatter_false_is_noted_at_stage3():
    engine = _engine({"zero_optimization": {"stage": 3, "reduce_scatter": False}})
    assert any("reduce_scatter = false: no effect at stage 3" in n for n in engine.config_notes)


# --- zero_optimization.stage3_param_persistence_threshold: small parameters stay whole

def _persistence_run(threshold):
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1,  # 3 ranks: 2 micro-batches
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
    engine = ts.initialize(TinyMLP(seed=0), config)  # one unit (the root): fc_in, shared, out_bias
    engine.comm_ledger.clear()
    for batch in synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0):
        engine.train_batch(batch)
    ledger = engine.comm_ledger
    return (engine.full_state_dict(), ledger.calls("all_gather"), ledger.bytes("all_gather"),
            engine.memory_report().bytes("parameters"))


def test_deepspeed_config_persistence_threshold_saves_gathers_for_parameter_bytes():
    from tinyscale.testing import assert_state_dicts_close, run_on_ranks

    reference = TinyMLP(seed=0)
    ts.reference.train(reference, synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0),
                       {"train_batch_size": 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2,
                                                                                          "weight_decay": 0.1}}})
    n, steps, micro, frozen = 3, 2, 2, 8 * 272  # ranks, steps, micro-batches per step, frozen layer bytes
    weights, biases = 128 + 256, 16 + 16 + 8  # fc_in.weight, shared.weight; fc_in.bias, shared.bias, out_bias
    pad = lambda numel: math.ceil(numel / n) * n  # noqa: E731  a flat unit is padded to N equal shards
    # threshold 0: every parameter sharded; the root unit is gathered in forward and in backward
    # threshold 17: the biases (16, 16, 8 elements) stay whole; one all-gather per step updates them
    # threshold 1000: everything stays whole: no gather in forward or backward, one per step
    expected = {0: (2 * micro * steps, 8 * 2 * micro * steps * pad(weights + biases), 8 * pad(weights + biases) // n),
                17: (2 * micro * steps + steps, 8 * (2 * micro * steps * pad(weights) + steps * pad(biases)),
                     8 * (pad(weights) // n + biases)),
                1000: (steps, 8 * steps * pad(weights + biases), 8 * (weights + biases))}
    for threshold, (calls, nbytes, params_bytes) in expected.items():
        for state, got_calls, got_bytes, got_params in run_on_ranks(_persistence_run, n, threshold):
            assert (got_calls, got_bytes, got_params - frozen) == (calls, nbytes, params_bytes), threshold
            assert_state_dicts_close(state, reference.state_dict())  # float64, rtol 1e-10


def test_deepspeed_config_persistence_threshold_is_noted_below_stage3():
    engine = _engine({"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 100}})
    assert any("persistence_threshold: no effect at stages 0-2" in n for n in engine.config_notes)


# --- zero_optimization.allgather_bucket_size: the post-step all-gathers in pieces (stages 1-2)

def _allgather_run(stage, allgather):
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}
    if allgather is not None:  # else DeepSpeed's default, 5e8: one all-gather per unit here
        config["zero_optimization"]["allgather_bucket_size"] = allgather
    engine = ts.initialize(TinyMLP(seed=0), config)
    engine.comm_ledger.clear()
    for batch in synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0):
        engine.train_batch(batch)
    rows = [r for r in engine.comm_ledger.rows if r.op == "all_gather"]
    return (engine.full_state_dict(), [u.shard_numel for u in engine.zero.sharded.units], len(rows),
            sum(r.bytes for r in rows), max(r.bytes for r in rows))


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_config_allgather_bucket_size_cuts_the_parameter_gathers(stage):
    from tinyscale.testing import assert_state_dicts_close, run_on_ranks

    reference = TinyMLP(seed=0)
    ts.reference.train(reference, synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0),
                       {"train_batch_size": 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2,
                                                                                          "weight_decay": 0.1}}})
    n, steps = 3, 2
    whole = run_on_ranks(_allgather_run, n, stage, None)  # the default: one all-gather per unit
    for bucket in (100, 30, 4):  # pieces of 33, 10 and 1 element per rank
        piece = max(1, bucket // n)
        for (_, shards, calls, nbytes, _), (state, _, got_calls, got_bytes, largest) in zip(
                whole, run_on_ranks(_allgather_run, n, stage, bucket)):
            assert calls == steps * len(shards)
            assert got_calls == steps * sum(math.ceil(s / piece) for s in shards), bucket
            assert got_bytes == nbytes and largest == 8 * n * piece <= 8 * bucket  # same bytes, in pieces
            assert_state_dicts_close(state, reference.state_dict())  # float64, rtol 1e-10


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_config_allgather_bucket_size_is_noted_at_stages_0_and_3(stage):
    engine = _engine({"zero_optimization": {"stage": stage, "allgather_bucket_size": 1000}})
    assert any("allgather_bucket_size: no effect at stages 0 and 3" in n for n in engine.config_notes)


# --- communication_data_type: gradients reduced in that dtype (ZeRO stages 1-3)

_SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _comm_dtype_run(stage, dtype):
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "optimizer": _SGD,
              "zero_optimization": {"stage": stage}, "communication_data_type": dtype}
    engine = ts.initialize(TinyMLP(seed=0), config)
    engine.comm_ledger.clear()
    for batch in synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0):
        engine.train_batch(batch)
    if stage == 0:  # the buckets' all-reduces (not the loss's): rows of a bucket's element count
        numels = {b.buffer.numel() for b in engine.ddp.buckets}
        grads = [r for r in engine.comm_ledger.rows
                 if r.op == "all_reduce" and r.bytes // getattr(torch, r.dtype).itemsize in numels]
    else:
        grads = [r for r in engine.comm_ledger.rows if r.op == "reduce_scatter"]
    return engine.full_state_dict(), sum(r.bytes for r in grads), {r.dtype for r in grads}


def _comm_dtype_reduce_scatters(stage):
    engine = ts.initialize(TinyMLP(seed=0), {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1,
                                             "optimizer": _SGD, "zero_optimization": {"stage": stage},
                                             "communication_data_type": "bf16"})
    engine.comm_ledger.clear()
    engine.train_batch(synthetic_regression_batches(num_batches=1, batch_size=6, dim=8, seed=0)[0])
    sent = [r for r in engine.comm_ledger.rows if r.op == "reduce_scatter"]
    return (sum(r.bytes for r in sent), {r.dtype for r in sent}, engine.batch.gradient_accumulation_steps,
            sum(u.padded_numel for u in engine.zero.sharded.units))


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_config_communication_data_type_zero2_reduces_every_micro_batch_as_deepspeed(stage):
    # DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py, reduce_ready_partitions_and_remove_grads):
    # stage 2 (partition_gradients) reduces each micro-batch's gradients as backward makes them,
    # stage 1 only at the accumulation boundary; once per step at stage 2 is its opt-in
    # engine.coalesce_grad_reduction(), which this engine does not offer. Bytes: one bf16
    # reduce-scatter of the padded flat gradient per reduction.
    from tinyscale.testing import run_on_ranks

    for sent, dtypes, accumulation, padded in run_on_ranks(_comm_dtype_reduce_scatters, 3, stage):
        assert accumulation == 2 and dtypes == {"bfloat16"}
        assert sent == (accumulation if stage == 2 else 1) * padded * 2


def _sgd_with_row_gradient_sums():
    """One process, SGD on the mean loss; also, per parameter element, the sum over steps and
    rows of |that row's contribution to the gradient| (what rounding a reduction scales with)."""
    model, rows = TinyMLP(seed=0), 6
    abs_sums = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for x, y in synthetic_regression_batches(num_batches=2, batch_size=rows, dim=8, seed=0):
        model.zero_grad()
        for i in range(rows):
            before = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            (model(x[i:i + 1], y[i:i + 1]) / rows).backward()  # the mean loss, one row at a time
            for n, p in model.named_parameters():
                if p.grad is not None:
                    abs_sums[n] += (p.grad - before[n]).abs()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
    return model.state_dict(), abs_sums


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_communication_data_type_halves_bytes_and_rounds_the_sum(stage):
    from tinyscale.testing import run_on_ranks

    n = 3
    reference, abs_sums = _sgd_with_row_gradient_sums()
    runs = {dtype: run_on_ranks(_comm_dtype_run, n, stage, dtype) for dtype in (None, "fp32", "bf16", "fp16")}
    for rank in range(n):
        (_, b64, t64), (_, b32, t32), (_, bbf, tbf), (_, bhalf, thalf) = (runs[d][rank] for d in runs)
        assert (t64, t32, tbf, thalf) == ({"float64"}, {"float32"}, {"bfloat16"}, {"float16"})
        assert b64 == 2 * b32 and b32 == 2 * bbf == 2 * bhalf  # bytes halve per halving of the dtype
        for dtype, unit_roundoff in (("fp32", 2.0 ** -24), ("bf16", 2.0 ** -8)):
            state = runs[dtype][rank][0]
            # Why this bound: each rank's term t_r (its rows' gradient / N) is rounded once to the
            # dtype (error <= u |t_r|) and the N terms are summed in it (<= (N-1) u sum |t_r|):
            # per reduction <= N u sum_r |t_r| <= N u sum over rows |row gradient|, elementwise.
            # SGD moves a parameter by lr x gradient, so after the steps its error is at most
            # lr N u (sum over steps and rows of |row gradient|); x2 for the second-order effect
            # of step 1's error on step 2's gradient. fp16 is left out: its subnormals below
            # 6e-5 round absolutely, not relatively; its bytes are checked above.
            diffs = {k: (state[k] - reference[k]).abs() for k in abs_sums}
            for k, d in diffs.items():
                assert (d <= 2 * 0.1 * n * unit_roundoff * abs_sums[k]).all(), (dtype, k)
            assert max(d.max().item() for d in diffs.values()) > 1e-15  # the rounding is real: not float64

