"""AutoTP (DS-8, module injection): `parallel.tensor` for models tinyscale did not write.

- the plan found in a transformers Llama's module tree (q/k/v, gate/up colwise; o, down rowwise;
  the embedding and the tied head split by vocab rows), with no processes;
- every layer it cannot place is refused by name, before any process group (ConfigError):
  unplaced modules, dropout, head counts tp does not split (fused or not), tp_plan typos;
- trained through the engine at tp 2, ZeRO 0-3, equal to one process in float64 (rtol 1e-10):
  Llama with a tied embedding and one K/V head copied onto both ranks (GQA, K < t), a vocab (61)
  that tp does not divide, clipping that binds, weight decay, accumulation 2 (`-k hf_llama`);
  Qwen2 with q/k/v biases (copied with their K/V head) and a padding token; GPT-2, whose Conv1D
  layers store their weights (in, out) and whose c_attn fuses q, k and v; a model of our own
  placed by `parallel.tp_plan`, with a frozen bias; dp 2 x tp 2 at ZeRO 1 and 3 (K/V heads split;
  with --thorough);
- a checkpoint saved by one process resumes at tp 2, continuing as the reference.
Run: `pytest tests/tensor_parallel/test_autotp.py` (keys autotp, hf_llama).
"""
from __future__ import annotations

import functools

import pytest
import torch

import tinyscale as ts
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.plan import placements, plan_layout
from tinyscale.models import GPT, GPTConfig
from tinyscale.tensor_parallel import find_plan
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tests.tensor_parallel.hf_models import READOUT_PLAN, VOCAB, Readout, gpt2, llama, qwen2

ROWS, SEQ, PAD = 4, 8, 0


OPTIMIZERS = {  # SGD too: Adam's update hides a uniform gradient-scale bug (a clipping norm counted twice)
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
}


def run_config(tp: int = 1, dp: int = 1, stage: int = 0, optimizer: str = "sgd", **parallel) -> dict:
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // (2 * dp),  # accumulation 2
            "optimizer": OPTIMIZERS[optimizer],
            "gradient_clipping": 0.05,  # binds at every step (the norms are ~1): a norm counted wrong shows
            "zero_optimization": {"stage": stage}, "parallel": {"tensor": tp, **parallel}}


def batches(steps: int = 2):
    out = synthetic_token_batches(num_batches=steps, batch_size=ROWS, seq_len=SEQ, vocab_size=VOCAB, seed=3)
    for idx, _ in out:
        idx[:, 0] = PAD  # Qwen2's padding token is read: its embedding row must get no gradient
    return out


BUILDERS = {"llama": llama, "llama_kv2": lambda: llama(tied=False, kv_heads=2), "qwen2_kv1": lambda: qwen2(kv_heads=1),
            "gpt2": gpt2, "readout": Readout}
PLANS = {"readout": READOUT_PLAN}


@functools.lru_cache(maxsize=None)
def reference(name: str, optimizer: str):
    model = BUILDERS[name]()
    losses = ts.reference.train(model, batches(), run_config(optimizer=optimizer))
    return losses, model.state_dict()


def _train_body(runs: list[tuple[str, dict]]):
    out = []
    for name, config in runs:
        engine = ts.initialize(BUILDERS[name](), config)
        losses = [engine.train_batch(b) for b in batches()]
        local = sum(engine._tp_shapes[n].numel() for n, _ in engine.model.named_parameters())
        counted = {name: place.counted_elements for name, place in placements(engine).items()}
        out.append((losses, engine.full_state_dict(), local, counted))
    return out


def _check(per_rank, runs):
    for k, (name, config) in enumerate(runs):
        expected_losses, expected = reference(name, "sgd" if config["optimizer"]["type"] == "SGD" else "adamw")
        full = sum(p.numel() for p in BUILDERS[name]().parameters())
        for rank_results in per_rank:
            losses, state, local, _ = rank_results[k]
            what = f"{name}, {config['parallel']}, zero {config['zero_optimization']['stage']}"
            assert_losses_close(losses, expected_losses)
            assert list(state) == list(expected), what  # the original keys, in order
            assert_state_dicts_close(state, expected, what=what)
            assert local < full, what  # this rank holds shards, not the whole model
        # The placements count every element of every trained tensor once over the world (the
        # clipping norm reads them): shards, fused chunks, K/V head copies, a tied table.
        counted = {name: sum(r[k][3][name] for r in per_rank) for name in per_rank[0][k][3]}
        assert counted == {name: expected[name].numel() for name in counted}, what


def test_autotp_hf_llama_trains_like_single_process():
    runs = [("llama", run_config(tp=2, stage=stage, optimizer=opt))
            for stage, opt in ((0, "sgd"), (1, "adamw"), (2, "sgd"), (3, "adamw"))]
    _check(run_on_ranks(_train_body, 2, runs), runs)


def test_autotp_qwen2_gpt2_and_tp_plan_train_like_single_process():
    runs = [("qwen2_kv1", run_config(tp=2, stage=0)), ("qwen2_kv1", run_config(tp=2, stage=3, optimizer="adamw")),
            ("gpt2", run_config(tp=2, stage=0)), ("gpt2", run_config(tp=2, stage=3, optimizer="adamw")),
            ("readout", run_config(tp=2, stage=0, tp_plan=READOUT_PLAN)),
            ("readout", run_config(tp=2, stage=2, optimizer="adamw", tp_plan=READOUT_PLAN))]
    _check(run_on_ranks(_train_body, 2, runs), runs)


def _resume_body(path: str):
    engine = ts.initialize(BUILDERS["qwen2_kv1"](), run_config(tp=2, stage=1, optimizer="adamw"))
    engine.load_checkpoint(path)
    return engine.train_batch(batches()[1]), engine.full_state_dict()


def test_autotp_checkpoint_from_one_process_resumes_at_tp2(tmp_path):
    """A checkpoint holds the original tensors: one process's, loaded at tp 2 (ZeRO 1, Adam's
    moments cut to shards, a K/V head and its bias copied onto both ranks), continues as the reference."""
    engine = ts.initialize(BUILDERS["qwen2_kv1"](), run_config(optimizer="adamw"))
    first = engine.train_batch(batches()[0])
    engine.save_checkpoint(str(tmp_path))
    expected_losses, expected = reference("qwen2_kv1", "adamw")
    for second, state in run_on_ranks(_resume_body, 2, str(tmp_path)):
        assert_losses_close([first, second], expected_losses)
        assert_state_dicts_close(state, expected, what="resumed at tp 2")


@pytest.mark.thorough  # a pool of 4 ranks, each importing transformers: ~20 s on 2 cores
def test_autotp_hf_llama_dp2_tp2_trains_like_single_process():
    runs = [("llama_kv2", run_config(tp=2, dp=2, stage=1)),
            ("llama_kv2", run_config(tp=2, dp=2, stage=3, optimizer="adamw"))]
    _check(run_on_ranks(_train_body, 4, runs), runs)


def test_autotp_finds_the_hf_llama_plan_in_its_module_tree():
    plan = find_plan(llama(layers=1), 2)
    layer = "lm.model.layers.0"
    assert plan == {"lm.model.embed_tokens": "vocab",
                    **{f"{layer}.self_attn.{p}_proj": "colwise" for p in "qkv"}, f"{layer}.self_attn.o_proj": "rowwise",
                    f"{layer}.mlp.gate_proj": "colwise", f"{layer}.mlp.up_proj": "colwise",
                    f"{layer}.mlp.down_proj": "rowwise", "lm.lm_head": "colwise_gather_output"}


def _refusal(model, tp: int = 2, world: int = 2, **parallel) -> str:
    config = EngineConfig.load(run_config(tp=tp, **parallel))
    with pytest.raises(ConfigError) as info:
        plan_layout(config, model, world)
    return str(info.value)


def test_autotp_refuses_unplaced_modules_by_name():
    message = _refusal(Readout())
    assert "AutoTP cannot place 4 module(s): table (Embedding), block.fc1 (Linear), block.fc2 (Linear), " \
           "readout (Linear)" in message and "parallel.tp_plan" in message


def test_autotp_refuses_fused_qkv_heads_tp_does_not_split():
    plan = find_plan(gpt2(), 2)
    assert plan["lm.transformer.h.0.attn.c_attn"] == "colwise" and plan["lm.transformer.wpe"] == "replicate"
    message = _refusal(gpt2(), tp=3, world=3)
    assert "lm.transformer.h.0.attn.c_attn: q, k and v fused, with 4 query and 4 K/V heads" in message


@pytest.mark.parametrize("case, expected", [
    ("heads", "4 query heads (config.num_attention_heads) are not divisible by tp=3"),
    ("kv_heads", "3 K/V heads (config.num_key_value_heads) neither divisible by tp=2"),
    ("dropout", "dropout lm.model.layers.0.self_attn.attention_dropout=0.1"),
    ("typo", "parallel.tp_plan patterns ['*.q_prj'] match no weighted module"),
    ("tied", "share a weight but are placed ['vocab', 'replicate']"),
    ("sequence_parallel", "parallel.sequence_parallel with a CausalLMLoss"),
    ("region", "lm.model.layers.0.mlp.down_proj: rowwise with no colwise layer beside it"),
    ("wrong_style", "lm.model.layers.0.self_attn.q_proj: style 'vocab' (from '*.q_proj') needs a layer of type "
                    "Embedding; it is a Linear"),
    ("no_config", "lm.model.layers.0.self_attn.q_proj: inside an attention module (head_dim=4), but the model "
                  "has no config with num_attention_heads"),
])
def test_autotp_refuses_what_it_cannot_split(case, expected):
    model, kw = llama(layers=1), {}
    if case == "heads":
        kw = {"tp": 3, "world": 3}
    elif case == "kv_heads":
        t = pytest.importorskip("transformers")
        model.lm = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=24, num_attention_heads=6,
                                                    num_key_value_heads=3, num_hidden_layers=1,
                                                    intermediate_size=8))
    elif case == "dropout":
        for m in model.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.1
    elif case == "typo":
        kw = {"tp_plan": {"*.q_prj": "colwise"}}
    elif case == "tied":
        kw = {"tp_plan": {"*lm_head": "replicate"}}
    elif case == "sequence_parallel":
        kw = {"sequence_parallel": True}
    elif case == "wrong_style":
        kw = {"tp_plan": {"*.q_proj": "vocab"}}
    elif case == "no_config":  # the heads' count is nowhere to be read
        for m in model.modules():
            if hasattr(m, "config"):
                object.__setattr__(m, "config", None)
    elif case == "region":
        kw = {"tp_plan": {"*.gate_proj": "replicate", "*.up_proj": "replicate"}}
    assert expected in _refusal(model, **kw)


def test_autotp_tp_plan_refused_where_it_does_nothing():
    gpt = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=8, n_layer=1, n_head=2, d_model=8), dtype=torch.float64)
    assert "remove tp_plan" in _refusal(gpt, tp_plan={"blocks.*": "replicate"})
    with pytest.raises(ConfigError, match="parallel.tp_plan needs parallel.tensor > 1"):
        ts.initialize(Readout(), run_config(tp=1, tp_plan=READOUT_PLAN))
