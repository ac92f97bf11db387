"""`python -m tinyscale.memory`: record one training step of the tiny GPT, replay it through
best-fit allocators of growing capacity, and print peak and fragmentation."""

from __future__ import annotations

import torch

from tinyscale.data import sample_batches, stdlib_corpus
from tinyscale.memory import record_trace, replay
from tinyscale.models import GPT, GPTConfig


def main() -> None:
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (x, y), = sample_batches(stdlib_corpus("train").tokens, num_batches=1, batch_size=8,
                             seq_len=cfg.max_seq_len, seed=0)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the first step creates AdamW's states; trace a steady-state step
    events = record_trace(step)
    allocs = sum(1 for e in events if e[0] == "alloc")
    first = replay(events, capacity=1 << 40)
    print(f"one step of the tiny GPT (float32, batch 8): {allocs} storages created, "
          f"peak live {first['peak_requested']:,} bytes, {first['peak_allocated']:,} with 512-byte rounding")
    for factor in (1.0, 1.05, 1.25):
        cap = int(first["peak_allocated"] * factor) // 512 * 512
        r = replay(events, capacity=cap)
        print(f"capacity {factor:.2f} x peak ({cap:,} B): worst fragmentation {r['max_fragmentation']:.1%}, "
              f"{'out of memory: ' + r['out_of_memory'] if r['out_of_memory'] else 'fits'}")
    r = replay(events, capacity=first["peak_allocated"], defragment=True)
    print(f"capacity 1.00 x peak, compacting when a request finds no block: "
          f"{'out of memory: ' + r['out_of_memory'] if r['out_of_memory'] else 'fits'}, "
          f"{r['compactions']} compaction(s), {r['bytes_moved']:,} bytes moved")


if __name__ == "__main__":
    main()
