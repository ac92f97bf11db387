"""The renderer: the text table by hand, every compute action drawn once in the Gantt chart,
and the command line."""

from __future__ import annotations

from fractions import Fraction

from tinyscale.pipeline.render import gantt, main, text_table
from tinyscale.pipeline.schedules import BW, F, add_communication, afab, interleaved_1f1b, zb_h1
from tinyscale.pipeline.simulator import simulate


def test_pp_simulator_text_table_by_hand():
    """GPipe, p = 2, m = 2, F = 1, BW = 2: a BW spans two slots; backwards in reverse order."""
    sim = simulate(add_communication(afab(2, 2)), {F: 1, BW: 2})
    assert text_table(sim) == (
        "slot   |    0    1    2    3    4    5    6    7    8\n"
        "rank 0 |  0F0  0F1    .    .    . 0BW1    - 0BW0    -\n"
        "rank 1 |    .  1F0  1F1 1BW1    - 1BW0    -    .    .")


def test_pp_simulator_text_table_fractional_times():
    """Chunk costs 1/2 and latency 1/4: the slot is 1/4, so every action starts on a column."""
    half = Fraction(1, 2)
    sim = simulate(add_communication(interleaved_1f1b(2, 4, 2)), {F: half, BW: half}, latency=Fraction(1, 4))
    cells = [row.split("|")[1].split() for row in text_table(sim).splitlines()]  # header, rank 0, 1
    assert [len(c) for c in cells] == [sim.makespan * 4] * 3  # one column per slot on every row
    idle = cells[1].count(".") + cells[2].count(".")
    assert Fraction(idle, 4) == sim.makespan * 2 - sum(sim.busy)  # dots are exactly the bubble


def test_pp_simulator_gantt_draws_every_compute_action(tmp_path):
    sim = simulate(add_communication(zb_h1(3, 4)))
    fig = gantt(sim, tmp_path / "zb.png", title="ZB-H1")
    assert len(fig.axes[0].patches) == 3 * 4 * 3  # stages x micro-batches x (F, B, W)
    assert (tmp_path / "zb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gantt(sim, tmp_path / "zb.svg")
    assert "<svg" in (tmp_path / "zb.svg").read_text()


def test_pp_simulator_command_line(capsys):
    main(["1f1b", "3", "4"])
    out = capsys.readouterr().out
    assert "rank 2 |" in out and "bubble 1/3" in out
