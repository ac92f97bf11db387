"""The memory calculator: per-GPU bytes by category and communication per step, for one layout.

The site's calculator (docs/calculator.md) runs `docs/assets/calculator.js`, a line-by-line
port of `estimate` below; `pytest -k calculator` checks that the two agree on a grid of
inputs (in node, and in the built page in Chromium). Pure arithmetic on top of two topics'
formulas, composed here as `tinyscale estimate` composes them:

    model states   tinyscale.zero.estimate.model_state_bytes (ZeRO's section 5); fp32 under
                   ZeRO >= 1 keeps an fp32 master shard too (measured: dp 3, ZeRO 1)
    activations    tinyscale.checkpointing.formula.block_saved_bytes (our block, per policy)
    dp comm        tinyscale.zero.estimate.comm_bytes_per_rank (ring collectives, section 7)

Tensor, pipeline and context parallelism (lessons 07-09): the standard formulas, each checked
against the engine one axis at a time (tp 3, pp 3, cp 3 on a small GPT:
`pytest tests/memory/test_calculator_measured.py`)
except the activations' growth with pp (its layers and in-flight micro-batches), formula only (`PLANNED`):
    parameters per rank    Psi / (tp pp)            Megatron-LM: each rank holds 1/tp of every
                                                    matrix of its pp stage. Measured: the mean over
                                                    the model-parallel ranks, counting the replicated
                                                    norms and the tied table's copy once
    ZeRO's N_d             dp cp                    cp ranks hold the same parameters, so ZeRO
                                                    shards over them too (measured: cp 3, ZeRO 2)
    activations            ceil(L/pp) x in-flight x A' / (tp cp)   (pp's factors: formula only)
        A' = block_saved_bytes(b, s, policy) + (tp-1) 2 s b h p: sequence parallelism splits
        every activation over tp (Korthikanti et al. 2022, section 4.2.2) but the two norms'
        outputs, which the column-parallel layers save all-gathered (policies none, selective;
        measured: a block's saved tensors under tp 3 + SP; before, A / tp left them out);
        cp splits the tokens, and ring attention changes the block (cp > 1): it keeps k and v
        before the GQA repeat (kv, not h, wide) and its own output in at least float32 beside wo's
        input, as tinyscale.planner.estimate.layer_activation_bytes counts it (called here, with
        sp: per rank; "sdpa", whatever attn_impl says; measured: cp 3 at 6 heads on 3, 4 on 1 and
        4 on 4 K/V heads; before, A / cp, right only at 2 heads per K/V head). With dropout the
        block keeps the two residual masks, p (s/cp) b h each, and ring attention nothing more
        (it redraws its blocks' masks in backward; measured: cp 3, bf16, dropout 0.1).
        Ulysses is not offered: the cp numbers are ring's. Under bf16 / fp16 our block keeps
        each norm's upcast input, 1/rms and the softmax (sdpa: its log-sum-exp) in float32, as
        block_saved_bytes counts them (measured: dp 3, bf16); in-flight micro-batches
        are 1 without pp, min(pp, m) on 1F1B's first stage. Backward of one block brings its
        full activations back (recomputed or fetched from the host): + (A'_none - A') / (tp cp).
    tp comm   per block, per micro-batch: 4 all-reduces of (s/cp) b h elements (6 when "full"
              recomputes the forward), and 2 per micro-batch more (the embedding's output in
              forward, the head's input in backward; 1 under pp: an end stage holds one), ring:
              2 (tp-1)/tp of that each, at activation bytes (measured: tp 3, both of them).
              Not counted: the vocab-parallel loss's 3 float32 numbers per token (12 / (h p) of
              one activation)
    pp comm   the busiest stage, per micro-batch: one activation sent forward and one gradient
              back from a middle stage, one of them from an end stage: min(pp-1, 2) (s/cp) b h p
              (not counted: a status element per message, the tied table's gradient)
    cp comm   ring attention, per layer, per micro-batch: K and V chunks passed cp-1 times
              forward and backward (and again when "full" recomputes), at p; dK, dV passed cp-1
              times in float32 (DKV_BYTES): ((4 [+ 2]) p + 2 x 4) (cp-1) (s/cp) b (kv/tp)
Not counted: the embedding, final norm, logits and loss activations (under cp also the first
block's float32 RoPE rows for the rank, 2 (s/cp) D 4 bytes, and the loss's bool per token and
8 bytes: once per micro-batch, not per block), temporary buffers (gradient buckets, stage 3's
gathered parameters, the scores and masks ring attention materialises for one block at a time
under dropout), allocator fragmentation.

Exact model states per rank, for the layouts the engine runs: not this calculator's Psi/(tp pp)
and Psi/N_d (averages), but `tinyscale.engine.layout_memory.rank_model_state_bytes` (the real
stages, replicated norms, vocab padding, K/V copies, the tied table's copy, ZeRO's padded units,
Adam's step counters), which equals `engine.memory_report` byte for byte in every layout of the
layout matrix (`pytest -k layout_memory`). It is not ported to calculator.js.

From a shell, with the page's inputs as flags (JSON out, bytes):
    python -m tinyscale.calculator --model llama-1b --dp 8 --tp 2 --zero-stage 3 --checkpointing full
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from tinyscale.checkpointing.formula import block_saved_bytes
from tinyscale.models.config import GPTConfig
from tinyscale.planner.estimate import layer_activation_bytes
from tinyscale.zero.estimate import comm_bytes_per_rank, model_state_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPTIMIZERS = ("adamw", "sgd_momentum", "sgd")
POLICIES = ("none", "full", "selective", "offload")
STATES_PER_PARAM = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}  # momentum, variance
DKV_BYTES = 4  # ring attention passes its dK/dV accumulators in at least float32 (context_parallel/ring.py)
PLANNED = ("pp",)  # the activations' pp factors (ceil(L/pp) layers, min(pp, m) in flight): formula only
SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden", "tie_embeddings",
                "dropout", "attn_impl")
DEFAULTS = dict(model="gpt2-124m", dtype="bf16", optimizer="adamw", dp=8, tp=1, pp=1, cp=1,
                zero_stage=1, offload="none", offload_params="none", micro_batch=4, seq_len=1024,
                num_microbatches=1, checkpointing="none")


def model_config(inputs: dict) -> GPTConfig:
    """The GPT the inputs name: a preset, or "custom" with the shape fields given."""
    name = inputs["model"]
    if name == "custom":
        shape = {k: inputs[k] for k in SHAPE_FIELDS if inputs.get(k) is not None}
        return GPTConfig(max_seq_len=max(1, int(inputs["seq_len"])), **shape)
    return GPTConfig.preset(name)


def _int_at_least(inputs: dict, field: str, low: int) -> int:
    value = inputs[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{field}={value!r}: give an int >= {low}")
    return value


def _bytes_per_element(dtype: str, optimizer: str, stage: int) -> dict[str, float]:
    """ZeRO's 2 + 2 + K: mixed precision keeps fp32 master weights (4) in the optimizer's K. So does
    fp32 under ZeRO >= 1: the optimizer steps an fp32 copy of the rank's shard (as DeepSpeed's ZeRO
    does), 4 Psi / N_d more than the paper's 4 + 4 + K (`engine.layout_memory`); DDP (stage 0) none."""
    states = 4 * STATES_PER_PARAM[optimizer]  # fp32 momentum / variance
    if dtype == "fp32":
        master = 4 if stage in (1, 2, 3) else 0
        return dict(param_bytes=4, grad_bytes=4, optimizer_bytes=master + states, master_bytes=master)
    return dict(param_bytes=2, grad_bytes=2, optimizer_bytes=4 + states, master_bytes=4)


def _add(values) -> float:
    """Left to right, as JavaScript adds (Python 3.12's sum() compensates rounding; JS does not)."""
    total = 0.0
    for value in values:
        total += value
    return total


def estimate(inputs: dict) -> dict:
    """Per-GPU bytes (device, host, disk) by category and bytes sent per step, by kind."""
    x = {**DEFAULTS, **inputs}
    for field, allowed in (("dtype", DTYPES), ("optimizer", OPTIMIZERS), ("checkpointing", POLICIES)):
        if x[field] not in allowed:
            raise ValueError(f"{field}={x[field]!r}: use one of {tuple(allowed)}")
    dp, tp, pp, cp = (_int_at_least(x, k, 1) for k in ("dp", "tp", "pp", "cp"))
    b, s, m = (_int_at_least(x, k, 1) for k in ("micro_batch", "seq_len", "num_microbatches"))
    cfg = model_config(x)
    if cfg.n_head % tp or cfg.kv_heads % tp:
        raise ValueError(f"tp={tp}: it must divide n_head={cfg.n_head} and the K/V heads={cfg.kv_heads}")
    if pp > cfg.n_layer:
        raise ValueError(f"pp={pp}: at most n_layer={cfg.n_layer} stages (one layer each)")
    if s % cp:
        raise ValueError(f"cp={cp}: it must divide seq_len={s} (each cp rank takes s/cp tokens)")
    num_params = cfg.num_params()
    per_element = _bytes_per_element(x["dtype"], x["optimizer"], x["zero_stage"])
    states = model_state_bytes(num_params / (tp * pp), dp * cp, x["zero_stage"], offload=x["offload"],
                               offload_params=x["offload_params"], **per_element)
    dtype, policy, p = DTYPES[x["dtype"]], x["checkpointing"], 2 if x["dtype"] != "fp32" else 4
    gathered = 2 * s * b * cfg.d_model * p  # the norms' outputs: saved all-gathered, whole on each tp rank
    split_norms = policy in ("none", "selective")  # the policies that save the norms' outputs
    kept = block_saved_bytes(cfg, b, s, dtype, policy) + (tp - 1) * (gathered if split_norms else 0)
    full = block_saved_bytes(cfg, b, s, dtype, "none") + (tp - 1) * gathered
    layers = math.ceil(cfg.n_layer / pp)
    in_flight = 1 if pp == 1 else min(pp, m)
    if cp == 1:
        activations = (layers * in_flight * kept + (full - kept)) / tp
    else:  # ring attention's block, per rank (k, v unrepeated, its float32 output): the planner's count
        kept, full = (layer_activation_bytes(cfg, b, s, p, k, tp=tp, sp=True, cp=cp) for k in (policy, "none"))
        activations = layers * in_flight * kept + (full - kept)
    places = {}
    for loc in ("device", "host", "disk"):
        row = {k: getattr(getattr(states, loc), k)
               for k in ("parameters", "gradients", "master_weights", "optimizer_states")}
        row["activations"] = activations if loc == "device" else 0.0
        row["total"] = _add(row.values())
        places[loc] = row
    tokens = s / cp * b  # tokens per rank per micro-batch
    recompute = policy == "full"
    comm = {
        "dp": comm_bytes_per_rank(num_params / (tp * pp), x["zero_stage"], dp * cp,
                                  per_element["grad_bytes"], num_microbatches=m),
        "tp": ((6 if recompute else 4) * layers + (2 if pp == 1 else 1)) * 2 * (tp - 1) / tp * tokens * cfg.d_model
        * p * m,
        "pp": 0.0 if pp == 1 else min(pp - 1, 2) * tokens * cfg.d_model * p * m,
        "cp": ((6 if recompute else 4) * p + 2 * DKV_BYTES) * (cp - 1) * tokens * cfg.kv_dim / tp * layers * m,
    }
    comm["total"] = _add(comm.values())
    return {"num_params": num_params, "params_per_rank": num_params / (tp * pp), **places, "comm": comm}


def main(argv: list[str] | None = None) -> int:
    """The page's calculator from a shell: one flag per input, the estimate as JSON."""
    parser = argparse.ArgumentParser(prog="python -m tinyscale.calculator", description=main.__doc__)
    for name, default in DEFAULTS.items():
        kind = int if isinstance(default, int) else str
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    for name in SHAPE_FIELDS:  # custom models only (--model custom)
        kind = {"tie_embeddings": lambda s: s.lower() in ("1", "true", "yes"), "dropout": float,
                "attn_impl": str}.get(name, int)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    inputs = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        print(json.dumps(estimate(inputs), indent=1))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
