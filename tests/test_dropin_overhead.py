"""benchmarks/dropin_overhead.py's logic on the CPU: every row builds, runs and agrees with its
framework's call (the rows whose framework is missing report a skip), and a row that errs or
disagrees fails the run with a non-zero exit. The timer is the only part replaced (by a
stand-in with fixed times); the rows, the check and the table are the benchmark's own."""

import importlib
import os
import sys

import types

import numpy as np
import pytest
import torch

from rl_triton.testing import frameworks, sim_frameworks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
bench = importlib.import_module("dropin_overhead")


def fixed_timer(impls, rounds, batch_s):
    """Calls each implementation once (so a row that breaks when repeated still fails) and
    reports the framework at 40 us and the drop-in at 10 us in every round."""
    for fn in impls.values():
        fn()
    return {"theirs": [40e-6] * rounds, "ours": [10e-6] * rounds}


def table(names, T=5, N=6):
    lines = []
    ok = bench.run(names, T, N, rounds=3, timer=fixed_timer, out=lines.append)
    return ok, "\n".join(lines).splitlines()[2:]


def _rl_games_main(rewards, values, dones, last_values, last_dones, gamma, tau):
    """rl_games main's compute_gae signature over rl-games 1.6.5's loop (the GPU peer's math)."""
    agent = types.SimpleNamespace(horizon_length=rewards.shape[0], gamma=gamma, tau=tau)
    return sim_frameworks.rl_games_discount_values(agent, last_dones, last_values, dones, values, rewards)


@pytest.mark.parametrize("name", list(bench.ROWS))
def test_every_row_runs_and_agrees_with_its_framework(name, monkeypatch):
    # the GPU peers' rows, driven on the CPU by their frameworks' loops in the peers' signatures
    monkeypatch.setitem(bench.PEERS, "rl_games", _rl_games_main)
    monkeypatch.setitem(bench.PEERS, "pufferlib", frameworks.pufferlib_advantage)
    ok, rows = table([name])
    assert ok, rows
    assert len(rows) == 1 and rows[0].startswith(f"| {name} | {bench.ROWS[name][0]} |")
    if "skipped: not installed" in rows[0]:
        return
    assert "FAILS" not in rows[0] and "error" not in rows[0]
    assert "| 40.0 (40.0-40.0) | 10.0 (10.0-10.0) | 0.25x (0.25-0.25) |" in rows[0]
    first, second = rows[0].split(" | ")[6:8]  # the drop-in's first and second call, real times
    assert all(float(cell.split(" ")[0]) > 0 for cell in (first, second)), rows[0]


def test_the_first_call_of_a_signature_is_timed_with_the_plans_cleared(monkeypatch):
    """``first_calls`` (benchmarks/common.py) clears the library's plans before each round's pair
    of calls, so its first call takes the full path and leaves a plan, and its second runs that
    plan."""
    from rl_triton.core import plans

    seen = []
    r, v = torch.randn(4, 9), torch.randn(4, 9)

    def call():
        import rl_triton

        seen.append(len([p for p in plans._plans.values() if p is not plans._NO_PLAN]))
        return rl_triton.gae(r, v, backend="cpu")

    times = bench.first_calls(call, 3, "cpu")
    assert seen == [0, 1] * 3
    assert [len(t) for t in times.values()] == [3, 3] and all(t > 0 for ts in times.values() for t in ts)


def _broken(T, N):
    def fails():
        raise RuntimeError("no kernel")
    return bench.Row(lambda: (torch.zeros(T, N),), fails, "stand-in")


def _off(T, N):
    x = torch.randn(T, N)
    return bench.Row(lambda: (x,), lambda: (x + 1e-2,), "stand-in")


def _nan(T, N):
    x = torch.randn(T, N)
    y = x.clone()
    y[0, 0] = float("nan")
    return bench.Row(lambda: (x,), lambda: (y,), "stand-in")


@pytest.mark.parametrize("builder, mark", [(_broken, "error: RuntimeError: no kernel"), (_off, "1.0e-02 FAILS"),
                                           (_nan, "nan FAILS")])
def test_a_row_that_errs_or_disagrees_fails_the_run(monkeypatch, capsys, builder, mark):
    monkeypatch.setitem(bench.ROWS, "bad", ("stand-in call", builder))
    ok, rows = table(["cleanrl", "bad"])
    assert not ok
    assert "FAILS" not in rows[0] and mark in rows[1]
    assert bench.main(["--only", "bad", "--shape", "4x3", "--rounds", "2"], timer=fixed_timer) == 1
    assert "FAILED" in capsys.readouterr().out
    assert bench.main(["--only", "cleanrl", "--shape", "4x3", "--rounds", "2"], timer=fixed_timer) == 0


def test_unknown_rows_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--only", "no_such_framework"])


def test_largest_difference():
    a = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    assert bench.largest_difference((a, a.numpy()), (a + 0.5, a.numpy())) == pytest.approx(0.5)
    assert np.isnan(bench.largest_difference((a,), (a.nan_to_num(),)))  # a NaN on one side only
    assert np.isnan(bench.largest_difference((a,), (a[0],)))  # another shape
    assert np.isnan(bench.largest_difference((a, a), (a,)))  # another number of outputs
