"""Variable-length sequences in a pipeline: padding against length bucketing (DT-7).

A pipeline's stages exchange fixed-shape tensors per micro-batch (the executor sends a
shape header whenever the shape changes; lesson 08). How the sequences are grouped into
micro-batches decides how many of the tokens a stage computes are padding:

- `pad_micro_batches`: sequences in arrival order, each micro-batch padded to its longest;
- `bucket_micro_batches`: sequences sorted by length first, so each micro-batch holds
  neighbours in length and little padding (the order of the data changes: that is the cost).

`padded_fraction` is the share of computed tokens that are padding. `stage_times` runs each
micro-batch through the stages of a partitioned GPT in one process (forward and backward,
stage by stage) and times each: a stage's time follows its micro-batch's padded length, so
with padding every stage pays for the longest sequence of each micro-batch. Padding is
correct for a causal model: a padded sequence's logits at its real positions equal its
logits alone, and padded targets are `IGNORE` (cross-entropy's ignore_index).

    python -m tinyscale.pipeline.varlen     # the numbers in lesson 08

Tests: `pytest -k varlen_dt7`.
"""

from __future__ import annotations

import time

import torch

IGNORE = -100  # F.cross_entropy's default ignore_index


# --8<-- [start:group]
def pad_micro_batches(lengths: list[int], size: int) -> list[list[int]]:
    """Indices of the sequences in each micro-batch, in arrival order."""
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def bucket_micro_batches(lengths: list[int], size: int) -> list[list[int]]:
    """Indices of the sequences in each micro-batch, sorted by length (stable)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + size] for i in range(0, len(order), size)]


def padded_fraction(lengths: list[int], groups: list[list[int]]) -> float:
    """Padding tokens over computed tokens, each micro-batch padded to its longest sequence."""
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1 - sum(lengths) / computed
# --8<-- [end:group]


def collate(seqs: list[torch.Tensor], group: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one micro-batch: next-token targets, padded to its longest
    sequence with token 0 as input and IGNORE as target."""
    T = max(len(seqs[i]) for i in group) - 1
    inputs = torch.zeros(len(group), T, dtype=torch.long)
    targets = torch.full((len(group), T), IGNORE, dtype=torch.long)
    for row, i in enumerate(group):
        s = seqs[i]
        inputs[row, :len(s) - 1], targets[row, :len(s) - 1] = s[:-1], s[1:]
    return inputs, targets


def stage_times(model, plan, seqs: list[torch.Tensor], groups: list[list[int]], repeats: int = 3) -> list[list[float]]:
    """Seconds of forward + backward of each stage (columns) for each micro-batch (rows),
    best of `repeats`, in one process: stage s's input is stage s-1's output, detached."""
    from tinyscale.pipeline.executor import GPTStage, gpt_loss

    stages = [GPTStage(model, spec) for spec in plan]
    rows = []
    for group in groups:
        inputs, targets = collate(seqs, group)
        best = [float("inf")] * len(stages)
        for _ in range(repeats):
            x = inputs
            for s, stage in enumerate(stages):
                start = time.perf_counter()
                x_in = x.detach().requires_grad_(x.is_floating_point())
                out = stage(x_in)
                last = s == len(stages) - 1
                (gpt_loss(out, targets) if last else out.sum()).backward()
                best[s] = min(best[s], time.perf_counter() - start)
                x = out.detach()
            model.zero_grad(set_to_none=True)
        rows.append(best)
    return rows


def demo_lengths(n: int = 32, seed: int = 0, short: int = 16, long: int = 256) -> list[int]:
    """A long-tailed length mix: most sequences short, a few long (as chat or code data)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    return [int(short + (long - short) * float(x) ** 4) for x in u]


if __name__ == "__main__":
    from tinyscale.models import GPT, GPTConfig
    from tinyscale.pipeline.partition import partition_gpt

    lengths, size = demo_lengths(), 4
    cfg = GPTConfig(vocab_size=256, max_seq_len=256, n_layer=4, n_head=4, d_model=128, ffn_hidden=512)
    model = GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n + 1,), generator=g) for n in lengths]
    plan = partition_gpt(cfg, 2)
    stage_times(model, plan, seqs, pad_micro_batches(lengths, size), repeats=1)  # warm-up: every shape once
    print(f"{len(lengths)} sequences, lengths {sorted(lengths)}, micro-batch {size}, 2 stages, "
          f"{torch.get_num_threads()} threads")
    for name, groups in [("padding", pad_micro_batches(lengths, size)), ("bucketing", bucket_micro_batches(lengths, size))]:
        times = stage_times(model, plan, seqs, groups, repeats=5)
        padded = [max(lengths[i] for i in gr) for gr in groups]
        print(f"{name}: padded fraction {padded_fraction(lengths, groups):.3f}; padded lengths {padded}; "
              f"stage 0 {sum(t[0] for t in times) * 1e3:.1f} ms, stage 1 {sum(t[1] for t in times) * 1e3:.1f} ms; "
              f"per micro-batch (ms) {[round(t[0] * 1e3, 1) for t in times]} / {[round(t[1] * 1e3, 1) for t in times]}")
