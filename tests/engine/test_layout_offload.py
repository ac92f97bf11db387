"""ZeRO offload in every layout (`pytest -k layout_offload`).

The optimizer states on the host (`offload_optimizer.device: cpu`) or on disk (`nvme`, a
temporary directory), and at stage 3 the parameter shards too (`offload_param`), with pipeline
parallelism (ZeRO 1 over dp: Megatron's distributed optimizer; ZeRO 3 with a unit per stage,
parameters offloaded too; DDP's stage 0 has no shards to offload) and with context parallelism (ZeRO 1-3 over the flattened dp x cp group): every loss and
every tensor of `full_state_dict()` equal (`torch.equal`, float64) the same layout without
offload: the host or disk tier steps the same shard with the same arithmetic. One case per
layout also equals `tinyscale.reference.train` at rtol 1e-10.

The model is the odd GPT of issue 25 (vocab 61, 6 query / 2 K/V heads, tied, sequence 22),
weight decay on, accumulation. The layouts of one world size run in one pooled multi-rank call
(cached); `--thorough` runs every offload variant in every layout.
Run: `pytest tests/engine/test_layout_offload.py [--thorough]`.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ, STEPS = 61, 22, 2
# variant -> (offload_optimizer device, offload_param device); "param-*" at stage 3 only
VARIANTS = {"cpu": ("cpu", "none"), "nvme": ("nvme", "none"), "param-cpu": ("cpu", "cpu"),
            "param-nvme": ("nvme", "nvme")}

# name -> (world, parallel section, zero stage, clip, variants in the default run)
LAYOUTS = {
    "pp2-1f1b-zero1": (2, {"pipeline": 2, "pipeline_schedule": "1f1b"}, 1, 0.0, ("cpu", "nvme")),
    "pp2-interleaved-zero1": (2, {"pipeline": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}, 1,
                              0.0, ()),
    "cp2-ring-zero1": (2, {"context": 2}, 1, 0.05, ("cpu",)),
    "cp2-ulysses-zero2": (2, {"context": 2, "context_algorithm": "ulysses"}, 2, 0.05, ("nvme",)),
    "cp2-ring-zero3": (2, {"context": 2}, 3, 0.05, ("param-nvme",)),
    "dp2-pp2-zb_h1-zero1": (4, {"pipeline": 2, "pipeline_schedule": "zb_h1"}, 1, 0.0, ("cpu",)),
    "dp2-cp2-zero3": (4, {"context": 2}, 3, 0.05, ("param-cpu", "nvme")),
    # ZeRO 3 under a pipeline: one unit per stage, its shard on the host or disk between gathers
    "dp2-pp2-1f1b-zero3": (4, {"pipeline": 2, "pipeline_schedule": "1f1b"}, 3, 0.05, ("param-nvme",)),
    "tp2-cp2-zero2": (4, {"context": 2, "tensor": 2}, 2, 0.05, ()),
}


def variants(layout: str, thorough: bool) -> tuple[str, ...]:
    stage = LAYOUTS[layout][2]
    if thorough:
        return tuple(v for v in VARIANTS if stage == 3 or not v.startswith("param"))
    return LAYOUTS[layout][4]


def gpt(layout: str) -> GPT:
    n_layer = 5 if LAYOUTS[layout][1].get("virtual_stages", 1) > 1 else 3
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=n_layer, n_head=6, n_kv_head=2, d_model=12,
                    ffn_hidden=20, tie_embeddings=True)
    return GPT(cfg, seed=5, dtype=torch.float64)


def rows(layout: str) -> int:
    world, parallel = LAYOUTS[layout][:2]
    return 2 * world // (parallel.get("tensor", 1) * parallel.get("context", 1) * parallel.get("pipeline", 1))


def config(layout: str, variant: str = "none", nvme_path: str | None = None, reference: bool = False) -> dict:
    _, parallel, stage, clip, _ = LAYOUTS[layout]
    zero = {"stage": 0 if reference else stage}
    if variant != "none":
        optimizer_device, param_device = VARIANTS[variant]
        zero["offload_optimizer"] = {"device": optimizer_device, "nvme_path": nvme_path}
        if param_device != "none":
            zero["offload_param"] = {"device": param_device, "nvme_path": nvme_path}
    return {"train_batch_size": rows(layout), "train_micro_batch_size_per_gpu": 1, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
            "zero_optimization": zero, "parallel": {} if reference else parallel}


def batches(layout: str):
    return synthetic_token_batches(num_batches=STEPS, batch_size=rows(layout), seq_len=SEQ, vocab_size=VOCAB, seed=3)


def _train(cases: list[tuple[str, str]], nvme_root: str) -> list:
    """On each rank: each (layout, offload variant) trained by a fresh engine; nvme swaps to a
    directory of this rank's own under `nvme_root` (pytest's temporary directory)."""
    out = []
    for i, (layout, variant) in enumerate(cases):
        nvme_path = os.path.join(nvme_root, f"rank{dist.get_rank()}-case{i}")
        os.makedirs(nvme_path, exist_ok=True)
        engine = ts.initialize(gpt(layout), config(layout, variant, nvme_path))
        losses = [engine.train_batch(b) for b in batches(layout)]
        report = engine.memory_report()  # between steps: where the model states are now
        on_disk = {c: report.bytes(c, "disk") for c in ("parameters", "optimizer_states")}
        out.append((losses, engine.full_state_dict(), on_disk))
    return out


@functools.cache
def results(world: int, thorough: bool, nvme_root: str) -> dict:
    todo = [(n, v) for n, spec in LAYOUTS.items() if spec[0] == world for v in ("none", *variants(n, thorough))
            if thorough or len(variants(n, thorough))]
    per_rank = run_on_ranks(_train, world, todo, nvme_root)
    return {case: [r[i] for r in per_rank] for i, case in enumerate(todo)}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=() if variants(n, False) else pytest.mark.thorough)
                                    for n in LAYOUTS])  # layouts with no default variant: --thorough only
def test_layout_offload_is_bit_identical_to_no_offload(layout, pytestconfig, tmp_path_factory):
    thorough = pytestconfig.getoption("--thorough")
    got = results(LAYOUTS[layout][0], thorough, str(tmp_path_factory.getbasetemp() / "layout_offload"))
    plain = got[(layout, "none")]
    for variant in variants(layout, thorough):
        for rank, ((losses, state, on_disk), (ref_losses, ref_state, _)) in enumerate(
                zip(got[(layout, variant)], plain)):
            assert losses == ref_losses, (layout, variant, rank)
            # the offload really happened (a no-op would pass the equalities): nvme leaves files
            optimizer_device, param_device = VARIANTS[variant]
            assert (on_disk["optimizer_states"] > 0) == (optimizer_device == "nvme"), (layout, variant, rank, on_disk)
            assert (on_disk["parameters"] > 0) == (param_device == "nvme"), (layout, variant, rank, on_disk)
            assert list(state) == list(ref_state)
            different = [k for k in state if not torch.equal(state[k], ref_state[k])]
            assert not different, (layout, variant, rank, different)
    model = gpt(layout)
    expected_losses = ts.reference.train(model, batches(layout), config(layout, reference=True))
    first = variants(layout, thorough)[0]
    for losses, state, _ in got[(layout, first)]:
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, model.state_dict(), what=f"{layout} offload {first} after {STEPS} steps")
