"""Draw a simulated pipeline schedule: a text table and a matplotlib Gantt chart.

The table has one row per rank and one column per time slot (the largest duration that
divides every start and end, so unit costs give one column per action). A compute action
prints its name (`0F3`) in its first slot and `-` in the slots it continues over; `.` is
idle (the bubble). Communication takes no slot: the simulator gives it no duration.

Try it: `python -m tinyscale.pipeline.render 1f1b 4 8` (schedule, stages, micro-batches,
[virtual stages]); add `--out schedule.svg` for the Gantt chart. Used by lesson 08.
"""

from __future__ import annotations

import argparse
import math
from fractions import Fraction
from numbers import Rational

from tinyscale.pipeline.schedules import (
    B, BW, F, W, add_communication, afab, interleaved_1f1b, one_f_one_b, zb_h1,
)
from tinyscale.pipeline.simulator import Simulation, simulate

COLORS = {F: "#4c72b0", B: "#dd8452", W: "#55a868", BW: "#c44e52"}


def _slot(sim: Simulation):
    """The largest time step dividing every start and end: exact for rational times."""
    times = [t for line in sim.timelines for ta in line if ta.action.is_compute for t in (ta.start, ta.end)]
    if all(isinstance(t, Rational) for t in times):
        fracs = [Fraction(t) for t in times if t]
        denominator = math.lcm(*(f.denominator for f in fracs)) if fracs else 1
        numerator = math.gcd(*(int(f * denominator) for f in fracs)) if fracs else 1
        return Fraction(numerator, denominator)
    durations = [ta.end - ta.start for line in sim.timelines for ta in line if ta.end > ta.start]
    return min(durations, default=1)


def text_table(sim: Simulation) -> str:
    """One row per rank, one column per time slot; `.` marks the bubble."""
    slot = _slot(sim)
    columns = round(sim.makespan / slot)
    rows = []
    for line in sim.timelines:
        cells = ["."] * columns
        for ta in line:
            if not ta.action.is_compute:
                continue
            first, last = round(ta.start / slot), round(ta.end / slot)
            cells[first] = str(ta.action)
            for c in range(first + 1, last):
                cells[c] = "-"
        rows.append(cells)
    width = max((len(c) for cells in rows for c in cells), default=1)
    header = "slot   | " + " ".join(str(c).rjust(width) for c in range(columns))
    body = [f"rank {r:<2}| " + " ".join(c.rjust(width) for c in cells) for r, cells in enumerate(rows)]
    return "\n".join([header, *body])


def gantt(sim: Simulation, path: str | None = None, *, title: str | None = None):
    """A Gantt chart: a row per rank (rank 0 on top), a box per compute action labelled with
    its micro-batch, coloured by kind, paler for later chunks. Saved to `path` if given
    (the format from its extension: .png, .svg, .pdf). Returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_ranks = sim.num_ranks
    fig, ax = plt.subplots(figsize=(max(6.0, float(sim.makespan) * 0.35), 0.6 * num_ranks + 1.2))
    for ta in (ta for line in sim.timelines for ta in line if ta.action.is_compute):
        chunk = ta.action.chunk(num_ranks)
        y = num_ranks - 1 - ta.rank
        width = float(ta.end - ta.start)
        ax.barh(y, width, left=float(ta.start), height=0.8, color=COLORS[ta.action.kind],
                alpha=1.0 / (1 + 0.6 * chunk), edgecolor="black", linewidth=0.5)
        ax.text(float(ta.start) + width / 2, y, str(ta.action.microbatch), ha="center", va="center",
                fontsize=7, color="white")
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in reversed(range(num_ranks))])
    ax.set_xlim(0, float(sim.makespan))
    ax.set_xlabel("time")
    kinds = sorted({ta.action.kind for line in sim.timelines for ta in line if ta.action.is_compute},
                   key=list(COLORS).index)
    handles = [Patch(color=COLORS[k], label=k) for k in kinds]
    if any(ta.action.chunk(num_ranks) for line in sim.timelines for ta in line):
        handles.append(Patch(facecolor="white", edgecolor="black", label="paler: later chunk"))
    ax.legend(handles=handles, loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    bubble = float(sim.bubble_fraction)
    ax.set_title(f"{title + ': ' if title else ''}bubble {bubble:.1%}, makespan {float(sim.makespan):g}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig


GENERATORS = {
    "afab": lambda p, m, v: afab(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": lambda p, m, v: zb_h1(p, m),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Simulate a pipeline schedule and draw it.")
    parser.add_argument("schedule", choices=sorted(GENERATORS))
    parser.add_argument("stages", type=int)
    parser.add_argument("microbatches", type=int)
    parser.add_argument("virtual_stages", type=int, nargs="?", default=1)
    parser.add_argument("--out", help="also write a Gantt chart here (.png or .svg)")
    args = parser.parse_args(argv)
    sim = simulate(add_communication(GENERATORS[args.schedule](args.stages, args.microbatches,
                                                               args.virtual_stages)))
    print(text_table(sim))
    print(f"bubble {sim.bubble_fraction} = {float(sim.bubble_fraction):.3f}, makespan {sim.makespan}, "
          f"peak in-flight per stage {sim.peak_in_flight}")
    if args.out:
        gantt(sim, args.out, title=args.schedule)


if __name__ == "__main__":
    main()
