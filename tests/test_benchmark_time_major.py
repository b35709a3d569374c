"""benchmarks/time_major.py's logic on the CPU (the Triton interpreter): every cell checked
against the oracle in both layouts, a wrong cell failing the run, the ratios and targets from
stand-in timers, and the sweep's choice. Only the timer is replaced."""

import importlib
import os
import sys

import pytest

kernels = pytest.importorskip("rl_triton.core.kernels")
pytestmark = pytest.mark.skipif(not (kernels.AVAILABLE and kernels.INTERPRET),
                                reason="the benchmark's CPU path runs the Triton interpreter (TRITON_INTERPRET=1)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
tm = importlib.import_module("time_major")


@pytest.fixture
def regime_on(monkeypatch):
    """The time-major regime at every shape (``main --regime on``; the functions driven directly
    here need it set), with no plan kept from before."""
    from rl_triton.core import plans

    monkeypatch.setattr(kernels, "time_major_regime_wins", tm._always)
    plans.clear()
    yield
    plans.clear()


def test_every_algorithm_is_checked_in_both_layouts(capsys):
    assert tm.main(["--device", "cpu", "--shapes", "6x5", "--algos", "all", "--regime", "on"]) == 0
    out = capsys.readouterr().out
    for algo in tm.ALGOS:
        assert f"| {algo} | 6x5 | walk3 " in out and "checked (" in out  # the two-state scan walks it as 1


@pytest.mark.parametrize("regime", ["off", "default"])
def test_the_regime_switch(capsys, regime):
    """``--regime off`` times the plan of every layout, as does the library's rule (the default)
    at 5 environments; the library's settings are restored after the run."""
    assert tm.main(["--device", "cpu", "--shapes", "6x5", "--algos", "gae", "--regime", regime]) == 0
    out = capsys.readouterr().out
    assert f"time-major regime: {regime}" in out and "| gae | 6x5 | lanes " in out and "walk" not in out
    assert kernels.TIME_MAJOR_REGIME and kernels.time_major_regime_wins(16, 512)
    assert not kernels.time_major_regime_wins(15, 512)


def test_a_wrong_cell_fails_the_run(monkeypatch, capsys):
    real = tm.Cell.batch_major
    monkeypatch.setattr(tm.Cell, "batch_major", lambda self: tuple(y + 1e-3 for y in real(self)))
    assert tm.main(["--device", "cpu", "--shapes", "6x5", "--algos", "gae"]) == 1
    assert "WRONG" in capsys.readouterr().out


def test_the_check_reaches_every_row_block():
    cell = tm.Cell("vtrace", 4, 300, "cpu")
    assert cell.rows == [0, 1, 31, 32, 63, 64, 127, 128, 150, 255, 256, 299]
    outs = list(cell.time_major())
    assert cell.error(outs) < 1e-5
    outs[1] = outs[1].clone()
    outs[1][2, 256] += 1.0  # one value of a later block
    assert cell.error(outs) > 0.1
    assert cell.nbytes == 300 * 4 * 4 * (4 + 2) + 300 * 4  # four float inputs, two outputs, done (bool)


def test_ratios_and_targets_from_timers():
    cell = tm.Cell("gae", 5, 8, "cpu")
    times = iter([30.0, 20.0, 22.0, 20.0, 24.0, 20.0])  # time-major, batch-major per round
    r = tm.measure(cell, lambda fn: next(times), {}, 3, 1e-4)
    assert r["status"] == "ok" and r["tm_us"] == 24.0 and r["bm_us"] == 20.0
    assert r["ratio"] == pytest.approx(1.2)  # the median of 1.5, 1.1, 1.2
    assert tm.verdict(r, 5.0) == "MISS (> 1.15x batch-major)"  # a floor under 10 us sets no target
    assert tm.verdict(dict(r, ratio=1.1), 15.0) == "MISS (> 1.3x floor)"
    assert tm.verdict(dict(r, ratio=1.1, tm_us=19.0), 15.0) == "ok"


def test_sweep_marks_the_fastest_candidate(regime_on):
    """Each candidate is checked, then timed (time-major, batch-major); the fastest is named."""
    cell = tm.Cell("vtrace", 5, 8, "cpu")
    times = iter([10.0, 20.0, 8.0, 12.0])  # the default plan and batch-major, then the candidates
    candidates = [dict(walk=1), dict(walk=0, block_r=4, block_t=8)]
    lines, results = tm.sweep(cell, lambda fn: next(times), candidates, 1e-4, None)
    assert [r["status"] for r in results] == ["ok"] * 3
    assert [r["plan"].split()[0] for r in results] == ["walk3", "walk1", "lanes"]
    assert "(best)" in lines[1] and lines[-1].startswith("best for vtrace 5x8: walk=1 8.00 us")


def test_forced_plans_parse():
    assert tm.parse_plan("walk=0, block_r=128,block_t=8") == dict(walk=0, block_r=128, block_t=8)
    with pytest.raises(ValueError, match="KEY=VAL"):
        tm.parse_plan("walk")
