"""Our pipeline executor's schedules against PyTorch's torch.distributed.pipelining, same run.

    python benchmarks/pipeline.py [--microbatches 8] [--layers 4] [--steps 80] [--json PATH]

Two CPU ranks (gloo), one GPT (float32) cut into the same stages by
`tinyscale.pipeline.partition_gpt`, the same batch of m micro-batches, timed six ways:

    ours afab / 1f1b / zb_h1      tinyscale.pipeline.PipelineExecutor on that schedule
    ours interleaved_1f1b         the same with 2 chunks per rank (4 stages)
    torch GPipe / torch 1F1B      ScheduleGPipe / Schedule1F1B on PipelineStage(GPTStage)

Steps run round-robin (so load changes hit all variants alike), the first one of each dropped as
warm-up. Ours / torch is the median over rounds of the round's own ratio (our step over torch's
in the same round: a load change between rounds cancels), with its quartiles and a 95 %
bootstrap interval of that median (`tinyscale.bench.ratio_interval(per_round=True)`), on
the rounds where our executor runs as users run it; every `INSTRUMENT`-th round it runs with
each action timed instead (a few microseconds per action), and only those rounds give the
bubble: measured from each compute action's start and end (a clock the ranks share) beside the
simulator's, and the closed form (which assumes equal stages and free messages). The simulator
replays each timed step on that step's own costs: each compute action's measured time, each
send and receive's measured hold of its rank (a send its share of the time until its run of
messages reaches a receive, a receive its time less its wait for the data), each message
arriving the per-message latency after its send (a ping-pong of one activation-sized message in
the same processes, half the median round trip). Its bubble is set beside that step's measured
one. (One cost per (stage, kind) instead, the medians over steps, leaves out how the actions'
times vary: in a balanced pipeline each wait follows the slower of two ranks, which the
typical costs do not show; lessons/08 measures it.) Timing: tinyscale.bench; the step timer and
the replay: tinyscale.pipeline.replay. `--json PATH` writes pp_1f1b_vs_torch,
pp_afab_vs_torch (the median paired ratios; their quartiles and interval under `ratio_stats`)
and pp_1f1b_bubble_gap_points (measured minus simulated bubble, in points, the median over the
timed steps; `gap_points_typical_costs` beside it from one cost per (stage, kind)), and
`receive_waits_ms`: for our AFAB and 1F1B, each rank's time waiting for data in its receives per
timed step, the first receive's (the pipeline filling) and the rest's (where 1F1B's ranks wait on
each other in the steady state and AFAB's do not: what AFAB saves, lessons/08). Each of ours runs
beside the torch schedule it is compared with in a round; 80 rounds take about 45 s on 2
nearly idle cores.
Lesson: lessons/08-pipeline-parallel.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.pipeline.replay import StepTimer, message_latency
from tinyscale.pipeline.replay import bubbles as replay_bubbles
from tinyscale.pipeline.schedules import RECV_B, RECV_F, SEND_B, SEND_F
from tinyscale.bench import add_json_argument, ratio_interval, round_robin, slowest, write_json
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline import (
    GPTStage, PipelineExecutor, add_communication, afab, gpt_loss, interleaved_1f1b,
    one_f_one_b, partition_gpt, stages_on_rank, zb_h1,
)

OURS = {"afab": (lambda p, m: afab(p, m), 1), "1f1b": (lambda p, m: one_f_one_b(p, m), 1),
        "zb_h1": (lambda p, m: zb_h1(p, m), 1), "interleaved_1f1b": (lambda p, m: interleaved_1f1b(p, m, 2), 2)}
TORCH = {"torch GPipe": ("ScheduleGPipe", "afab"), "torch 1F1B": ("Schedule1F1B", "1f1b")}
INSTRUMENT = 4  # every 4th round times our executor's actions (for the bubble), the others not (for the ratio)
CLOSED = {"afab": lambda p, m: (p - 1) / (m + p - 1), "1f1b": lambda p, m: (p - 1) / (m + p - 1),
          "zb_h1": lambda p, m: (p - 1) / (3 * m + p - 1), "interleaved_1f1b": lambda p, m: (p - 1) / (2 * m + p - 1)}


def _bench_rank(m: int, n_layer: int, steps: int) -> dict:
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    p, rank = dist.get_world_size(), dist.get_rank()
    cfg = GPTConfig(vocab_size=128, max_seq_len=32, n_layer=n_layer, n_head=4, d_model=128, ffn_hidden=384)
    (inputs, targets), = synthetic_token_batches(num_batches=1, batch_size=2 * m, seq_len=32, vocab_size=128, seed=1)
    runs, timers = {}, {}
    for name, (make, v) in OURS.items():
        model = GPT(cfg, seed=0, dtype=torch.float32)
        stages = {s.stage: GPTStage(model, s) for s in stages_on_rank(partition_gpt(cfg, p, virtual_stages=v), rank)}
        executor = PipelineExecutor(add_communication(make(p, m)), rank, stages, loss_fn=gpt_loss)
        timers[name] = StepTimer(executor)  # each compute action and message hold, on instrumented rounds
        runs[name] = (model, lambda ex=executor: ex.run(inputs.chunk(m), targets.chunk(m)))
    for name, (cls, _) in TORCH.items():
        model = GPT(cfg, seed=0, dtype=torch.float32)
        spec, = stages_on_rank(partition_gpt(cfg, p), rank)
        stage = pipelining.PipelineStage(GPTStage(model, spec), rank, p, torch.device("cpu"))
        schedule = getattr(pipelining, cls)(stage, m, loss_fn=gpt_loss)
        kwargs = {"target": targets, "losses": []} if rank == p - 1 else {}
        runs[name] = (model, lambda s=schedule, kw=kwargs: s.step(inputs, **kw) if rank == 0 else s.step(**kw))
    actions, messages, waits = {}, {}, {}

    def step(name, i):
        model, run = runs[name]
        model.zero_grad()
        timing = name in timers and is_instrumented(i)
        with timers[name].timing() if timing else contextlib.nullcontext():
            run()
        dist.barrier()  # the step ends when both ranks are done
        if timing:
            actions.setdefault(name, []).append(timers[name].computes)
            messages.setdefault(name, []).append(timers[name].holds)
            waits.setdefault(name, []).append([t for _, t in timers[name].waits])

    # each of ours beside the torch schedule it is compared with, so a pair's two steps see the same
    # load; the 1F1B pair trades places every other round, so each follows torch GPipe as often
    # (what ran just before a step changes its time: lesson 02)
    order = ["afab", "torch GPipe", "1f1b", "torch 1F1B", "zb_h1", "interleaved_1f1b"]
    times = round_robin({name: lambda i, name=name: step(name, i) for name in order}, steps, warmup=1,
                        before=dist.barrier, alternate=("1f1b", "torch 1F1B"))
    return {"times": times, "actions": actions, "messages": messages, "waits": waits,
            "latency": message_latency(2 * cfg.max_seq_len * cfg.d_model + 1)}


def is_instrumented(i: int) -> bool:
    """Round i (0: warm-up, never) times our executor's actions."""
    return i > 0 and i % INSTRUMENT == 0


def paired_ratio(ours: list[float], theirs: list[float], rounds: list[int]) -> dict:
    """ours[i] / theirs[i] over `rounds`: the median, its quartiles, and the 95 % interval of the
    median (`ratio_interval(per_round=True)`: the rounds resampled, as ddp.py's)."""
    a, b = [ours[i] for i in rounds], [theirs[i] for i in rounds]
    r = sorted(x / y for x, y in zip(a, b))
    q1, _, q3 = statistics.quantiles(r, n=4) if len(r) > 1 else (r[0], r[0], r[0])
    return {"median": statistics.median(r), "q1": q1, "q3": q3, "ci95": list(ratio_interval(a, b, per_round=True)),
            "n": len(r)}


def bubbles(per_rank: list[dict], name: str, m: int, latency: float = 0.0) -> dict:
    """Schedule `name`'s bubble in each timed step, measured, replayed on the step's own costs
    and on one cost per (stage, kind): `tinyscale.pipeline.replay.bubbles`."""
    steps = [([r["actions"][name][k] for r in per_rank], [r["messages"][name][k] for r in per_rank])
             for k in range(len(per_rank[0]["actions"][name]))]
    return replay_bubbles(add_communication(OURS[name][0](len(per_rank), m)), steps, latency)


def receive_waits(per_rank: list[dict], name: str) -> list[tuple[float, float]]:
    """Per rank, schedule `name`'s time waiting for data in its receives (seconds, the median
    over the timed steps): the first receive's wait (the pipeline filling) and the sum of the
    others' (the steady state and the drain: where 1F1B's ranks wait on each other, lessons/08)."""
    steps = [r["waits"][name] for r in per_rank]  # per rank: each timed step's waits, in schedule order
    return [(statistics.median(w[0] for w in rank), statistics.median(sum(w[1:]) for w in rank)) for rank in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=80,
                        help=f"timed rounds after one warm-up (every {INSTRUMENT}th times our actions for the bubble)")
    add_json_argument(parser)
    args = parser.parse_args()
    if args.steps < 2 * INSTRUMENT:
        parser.error(f"--steps must be at least {2 * INSTRUMENT}: every {INSTRUMENT}th round times the actions")
    m, p = args.microbatches, 2
    start = time.perf_counter()
    per_rank = ts.dist.launch(_bench_rank, p, m, args.layers, args.steps, timeout_s=300)
    per_round = {name: slowest([r["times"][name] for r in per_rank]) for name in per_rank[0]["times"]}
    plain = [i for i in range(args.steps) if not is_instrumented(i + 1)]  # times[i] is round i + 1
    times = {name: statistics.median(per_round[name][i] for i in plain) for name in per_round}
    stats = {ours: paired_ratio(per_round[ours], per_round[theirs], plain) for theirs, (_, ours) in TORCH.items()}
    latency = statistics.median(r["latency"] for r in per_rank)
    bub = {name: bubbles(per_rank, name, m, latency) for name in OURS}
    held = bub["1f1b"]["holds"]
    sends = [t for (_, kind), t in held.items() if kind in (SEND_F, SEND_B)]
    recvs = [t for (_, kind), t in held.items() if kind in (RECV_F, RECV_B)]
    table = Table(title=f"pipeline step on {p} CPU ranks, m = {m}, {args.layers} layers, float32 "
                        f"(median of {len(plain)} rounds; bubbles from {args.steps - len(plain)} more)")
    for col in ("variant", "step ms", "ours / torch (quartiles)", "bubble measured", "simulated: steps replayed",
                "gap (points)", "simulated: one cost per (stage, kind)", "the same, free messages", "closed form"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    torch_of = {ours: name for name, (_, ours) in TORCH.items()}
    for name, b in bub.items():
        st = stats.get(name)
        ratio = f"{st['median']:.3f} ({st['q1']:.2f}-{st['q3']:.2f})" if st is not None else ""
        table.add_row(f"ours {name}", f"{times[name] * 1e3:.1f}", ratio, f"{b['measured']:.1%}", f"{b['replayed']:.1%}",
                      f"{b['gap']:.1f}", f"{b['typical']:.1%}", f"{b['free']:.1%}", f"{CLOSED[name](p, m):.1%}")
    for name in TORCH:
        table.add_row(name, f"{times[name] * 1e3:.1f}", "", "", "", "", "", "", "")
    Console(width=130).print(table)
    print(f"simulated with messages: {latency * 1e6:.0f} us latency; each step replayed on its own costs and holds, "
          f"or one cost per (stage, kind) with the mean holds (1F1B: {' '.join(f'{t * 1e6:.0f}' for t in sends)} "
          f"us per send, {' '.join(f'{t * 1e6:.0f}' for t in recvs)} us per receive)")
    waited = {name: receive_waits(per_rank, name) for name in ("afab", "1f1b")}
    for name, ranks in waited.items():
        print(f"ours {name}, receives' waits for data per step: " + ", ".join(
            f"rank {r} first {first * 1e3:.2f} ms, the rest {rest * 1e3:.2f} ms"
            for r, (first, rest) in enumerate(ranks)))
    for name, st in stats.items():
        print(f"ours {name} / {torch_of[name]}: median of {st['n']} paired rounds {st['median']:.3f}, "
              f"quartiles {st['q1']:.3f} .. {st['q3']:.3f}, "
              f"95 % CI of the median {st['ci95'][0]:.3f} .. {st['ci95'][1]:.3f}")
    print(f"wall time {time.perf_counter() - start:.0f} s")
    write_json(args.json, {"pp_1f1b_vs_torch": stats["1f1b"]["median"],
                           "pp_afab_vs_torch": stats["afab"]["median"],
                           "pp_1f1b_bubble_gap_points": bub["1f1b"]["gap"]},
               ratio_stats={f"pp_{name}_vs_torch": st for name, st in stats.items()},
               latency_s=latency, send_s=statistics.median(sends), recv_s=statistics.median(recvs),
               bubble_1f1b={key: bub["1f1b"][key] for key in ("measured", "replayed", "typical", "free")},
               gap_points_typical_costs=100 * (bub["1f1b"]["measured"] - bub["1f1b"]["typical"]),
               receive_waits_ms={name: [[round(t * 1e3, 2) for t in rank] for rank in ranks]
                                 for name, ranks in waited.items()},
               holds_1f1b_us={f"{s}{kind}": round(t * 1e6) for (s, kind), t in held.items()},
               microbatches=m, steps=args.steps)


if __name__ == "__main__":
    main()
