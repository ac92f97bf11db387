"""DeepSpeed's training-loop API (`tinyscale.deepspeed`, ``pytest -k deepspeed_api``).

The forward/backward/step loop, fed the micro-batches `train_batch` cuts from each global
batch, equals `train_batch` bit for bit (`torch.equal`, float64) at ZeRO stages 0-3 and under
tensor parallelism, on the odd GPT (tied embeddings, GQA, vocab 61, clipping that binds, weight
decay, 2 micro-batches of accumulation, counter dropout; under tp 2 also stream dropout's exact masks). With a pipeline,
`train_batch(data_iter=...)` equals the engine's `train_batch` on the gathered global batch.
What is not served is refused by name. The tutorial-shaped script against DeepSpeed itself:
tests/engine/test_deepspeed_api_script.py.
"""

from __future__ import annotations

import pytest
import torch

import tinyscale as ts
import tinyscale.deepspeed as deepspeed
from tinyscale.config import ConfigError
from tinyscale.data import local_micro_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import run_on_ranks

VOCAB, SEQ, MICRO, ACCUM = 61, 10, 2, 2


def gpt(masks: str = "counter") -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=3, n_head=6, n_kv_head=2, d_model=12,
                    ffn_hidden=20, tie_embeddings=True, dropout=0.1, dropout_masks=masks)
    return GPT(cfg, seed=7, dtype=torch.float64)


def config(stage: int, dp: int, **parallel) -> dict:
    return {"train_batch_size": MICRO * ACCUM * dp, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.3,  # this model's gradient norm is ~1-2: every step clips
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage}, "parallel": parallel}


def _loop_and_train_batch(stage: int, dp: int, parallel: dict, steps: int = 2):
    masks = parallel.pop("masks", "counter")
    cfg = config(stage, dp, **parallel)
    batches = synthetic_token_batches(num_batches=steps, batch_size=MICRO * ACCUM * dp, seq_len=SEQ,
                                      vocab_size=VOCAB, seed=3)
    torch.manual_seed(0)  # stream dropout: each engine's shared stream is seeded from the global generator
    engine = ts.initialize(gpt(masks), cfg)
    expected = [engine.train_batch(b) for b in batches]
    expected_state = engine.full_state_dict()
    torch.manual_seed(0)
    ds, _, _, _ = deepspeed.initialize(model=gpt(masks), config=cfg)
    assert ds.engine.dp_size == dp
    losses, boundaries = [], []
    for b in batches:
        for chunk in local_micro_batches(b, dp_rank=ds.engine.dp_rank, dp_size=dp, micro_batch_size=MICRO):
            boundaries.append(ds.is_gradient_accumulation_boundary())
            loss = ds(*chunk)
            ds.backward(loss)
            ds.step()
        losses.append(ds.engine.last_step["loss"])
    state = ds.engine.full_state_dict()
    lr = [g["lr"] for g in engine._torch_optimizer().param_groups]
    return (expected, losses, boundaries, ds.global_steps, (ds.get_lr(), lr),
            all(torch.equal(expected_state[k], state[k]) for k in expected_state))


@pytest.mark.parametrize("stage,dp,parallel", [(0, 2, {}), (1, 2, {}), (2, 2, {}), (3, 2, {}),
                                               (1, 1, {"tensor": 2}), (2, 2, {"tensor": 2, "masks": "stream"})],
                         ids=["zero0-dp2", "zero1-dp2", "zero2-dp2", "zero3-dp2", "zero1-tp2", "zero2-dp2-tp2-stream"])
def test_deepspeed_api_loop_equals_train_batch_bit_for_bit(stage, dp, parallel):
    world = dp * parallel.get("tensor", 1)
    for expected, losses, boundaries, steps, lr, same in run_on_ranks(_loop_and_train_batch, world, stage, dp,
                                                                      dict(parallel)):
        assert losses == expected  # exact floats, not close: the same operations in the same order
        assert same, "parameters differ from train_batch's"
        assert boundaries == [False, True] * 2 and steps == 2
        assert lr[0] == lr[1] and len(lr[0]) == 1  # get_lr(): the schedule's lr of the last step


def _pipeline_data_iter():
    cfg = {**config(1, 2, pipeline=2), "gradient_clipping": 0.0}
    batches = synthetic_token_batches(num_batches=2, batch_size=MICRO * ACCUM * 2, seq_len=SEQ, vocab_size=VOCAB,
                                      seed=3)
    engine = ts.initialize(gpt(), cfg)
    expected = [engine.train_batch(b) for b in batches]
    ds, _, _, _ = deepspeed.initialize(model=gpt(), config=cfg)
    micro = iter([c for b in batches
                  for c in local_micro_batches(b, dp_rank=ds.engine.dp_rank, dp_size=2, micro_batch_size=MICRO)])
    losses = [ds.train_batch(data_iter=micro).item() for _ in batches]
    refused = None
    try:
        ds(*batches[0])
    except RuntimeError as err:
        refused = str(err)
    a, b = engine.full_state_dict(), ds.engine.full_state_dict()
    return expected, losses, all(torch.equal(a[k], b[k]) for k in a), refused


def test_deepspeed_api_pipeline_train_batch_data_iter_equals_train_batch():
    for expected, losses, same, refused in run_on_ranks(_pipeline_data_iter, 4):
        assert losses == expected and same
        assert "train_batch(data_iter=...)" in refused


def test_deepspeed_api_refuses_what_it_cannot_serve_by_name():
    cfg = config(0, 1)
    with pytest.raises(ValueError, match="lr_scheduler=.*scheduler section"):
        deepspeed.initialize(model=gpt(), config=cfg, lr_scheduler=object())
    with pytest.raises(ValueError, match="mpu=.*parallel section"):
        deepspeed.initialize(model=gpt(), config=cfg, mpu=object())
    with pytest.raises(ConfigError, match="parallel.context"):
        deepspeed.initialize(model=gpt(), config={**cfg, "parallel": {"context": 2}})
    with pytest.raises(ValueError, match="config is given twice"):
        deepspeed.initialize(model=gpt(), config=cfg, config_params=cfg)
    ds, *_ = deepspeed.initialize(model=gpt(), config=cfg)
    with pytest.raises(NotImplementedError, match="eval_batch"):
        ds.eval_batch(iter([]))
    with pytest.raises(ValueError, match="load_module_only"):
        ds.load_checkpoint("nowhere", load_module_only=True)
    loss = ds(*synthetic_token_batches(num_batches=1, batch_size=MICRO, seq_len=SEQ, vocab_size=VOCAB, seed=0)[0])
    with pytest.raises(ValueError, match="scale_wrt_gas"):
        ds.backward(loss, scale_wrt_gas=False)
    with pytest.raises(RuntimeError, match="save after the boundary"):
        ds.save_checkpoint("nowhere")


def test_deepspeed_api_optimizer_instance_and_parameter_groups_train_like_the_config(tmp_path):
    """A torch optimizer built by the script (groups: no weight decay on biases) trains as the
    same groups given to tinyscale.initialize; the engine rebuilds it over its own parameters."""
    batches = [tuple(t.double() for t in b) for b in _regression(2)]
    model = TinyMLP(seed=0)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and "bias" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and "bias" in n]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2,
                            weight_decay=0.1)
    ds, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config={"train_batch_size": 4})
    for b in batches:
        ds.backward(ds(*b))
        ds.step()
    ref = TinyMLP(seed=0)

    def groups(m):
        named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        return [{"params": [p for n, p in named if "bias" not in n]},
                {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}]
    ts.reference.train(ref, batches, {"train_batch_size": 4}, param_groups=groups,
                       optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1))
    state = ds.engine.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def _regression(n):
    from tinyscale.data import synthetic_regression_batches
    return synthetic_regression_batches(num_batches=n, batch_size=4, dim=8, seed=0)
