"""benchmarks/run.py's cell logic (the oracle check, the ratios, the summaries) for every
estimator of the GPU grid, driven here on CPU tensors with stand-in timers, so that a benchmark
that drops or misjudges an estimator fails CI. The timers are the only part replaced: the
implementations, the oracle and the check are the benchmark's own."""

import importlib
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
run = importlib.import_module("run")
peers = importlib.import_module("peers")

SHAPE = (6, 40)
# stand-in full calls (us per round) by implementation: rl_triton 10, the per-step loop 30
FULL = {"rl_triton": [10.0, 12.0, 10.0], "per-step torch loop": [30.0, 24.0, 40.0]}


def fake_full_calls(impls):
    return {name: list(FULL.get(name, [50.0, 50.0, 50.0])) for name in impls}


def fake_device(fn, full_us):
    return full_us / 10


def cell(algo, impls=None, **kw):
    problem = peers.Problem(algo, *SHAPE, device="cpu")
    if impls is None:
        impls = {"rl_triton": run._direct_call(problem.problem), **problem.peers(compiled=False)}
    lines, results = run.time_cell((algo, "float32", *SHAPE), impls, problem.expected(rows=4),
                                   run.TOLERANCE[torch.float32], problem.nbytes_with, 2.0,
                                   full_calls=fake_full_calls, device=fake_device, **kw)
    return problem, lines, results


@pytest.mark.parametrize("algo", run.ALGOS + run.TRACE_ALGOS)
def test_every_estimator_is_checked_timed_and_summarised(algo):
    problem, lines, results = cell(algo)
    ours = next(r for r in results if r["impl"] == "rl_triton")
    assert ours["status"] == "ok", lines
    assert ours["err"] < 1e-5 and ours["full_ratio"] == 1.0
    assert ours["dev"] == pytest.approx(1.0)  # median full call 10 us / 10
    loop = next(r for r in results if r["impl"] == "per-step torch loop")
    assert loop["status"] == "ok"
    assert loop["full_ratio"] == pytest.approx(np.median([3.0, 2.0, 4.0]))  # within each round
    n_out = len(problem.call())
    assert ours["floor"] == pytest.approx(problem.nbytes_with(n_out) / 2e6)
    assert run.failures(results) == []
    summary = run.summary(results, empty_full=5.0)
    row = next(line for line in summary if line.startswith(f"| {algo} |"))
    assert "3.00x (per-step torch loop)" in row and "2.00x" in row  # full call; ours / empty
    ranges = run.peer_ranges(results)
    assert any(line.startswith("| per-step torch loop | 1 | 3.00-3.00x | 0 |") for line in ranges), ranges


def test_the_floor_counts_each_per_step_input_once():
    """Float inputs at the data's size and flags at theirs: Retrace's tree-backup trace reads the
    rewards, q-values, log_pi and the next expected q (log_mu: none), and two bool flags."""
    problem = peers.Problem("retrace:tree_backup", *SHAPE, device="cpu")
    assert problem.problem.kwargs["trace"] == "tree_backup" and problem.problem.args[3] is None
    assert problem.nbytes_with(1) == SHAPE[0] * SHAPE[1] * (5 * 4 + 2)
    gae = peers.Problem("gae", *SHAPE, device="cpu")
    assert gae.nbytes == SHAPE[0] * SHAPE[1] * (4 * 4 + 1)  # rewards, values, done; two outputs


@pytest.mark.parametrize("algo", ["discounted_return", "gae"])
def test_a_failed_or_wrong_rl_triton_fails_the_run(algo):
    problem = peers.Problem(algo, *SHAPE, device="cpu")
    good = run._direct_call(problem.problem)

    def broken():
        raise RuntimeError("no kernel")

    def off():
        out = good()
        return out + 1e-2 if isinstance(out, torch.Tensor) else tuple(o + 1e-2 for o in out)

    def nan():
        out = problem.call()
        out[0][0, 3] = float("nan")
        return out

    for bad, status in ((broken, "failed: RuntimeError"), (off, "wrong"), (nan, "wrong")):
        _, lines, results = cell(algo, {"rl_triton": bad, "per-step torch loop": lambda: problem.call("torch")})
        assert run.failures(results) == [f"{algo} float32 {SHAPE[0]}x{SHAPE[1]}: {status}"], lines
        loop = next(r for r in results if r["impl"] == "per-step torch loop")
        assert loop["status"] == "ok" and loop["full_ratio"] is None  # no ratio to a failed rl_triton
        row = next(line for line in run.summary(results, 5.0) if line.startswith(f"| {algo} |"))
        assert status.upper() in row


def test_a_peer_writing_fewer_outputs_is_compared_on_its_own_floor():
    problem = peers.Problem("gae", *SHAPE, device="cpu")
    call = run._direct_call(problem.problem)
    impls = {"rl_triton": call, "advantages only": lambda: call()[:1]}
    _, _, results = cell("gae", impls)
    ours, peer = results
    assert peer["floor"] == pytest.approx(problem.nbytes_with(1) / 2e6) and peer["floor"] < ours["floor"]
    # device 5 us against 1 us: 5x on time, less on the share of each one's floor
    assert run._share_ratio(ours, peer) == pytest.approx(5.0 * ours["floor"] / peer["floor"])


def test_max_error_takes_one_tensor_and_keeps_nan():
    problem = peers.Problem("discounted_return", *SHAPE, device="cpu")
    expected = problem.expected(rows=4)
    y = problem.call()[0]
    assert peers.max_error(y, expected) < 1e-5
    assert peers.max_error((y,), expected) < 1e-5
    y[1, 2] = float("nan")
    assert np.isnan(peers.max_error(y, expected))
    with pytest.raises(ValueError, match="outputs"):
        peers.max_error((y, y), expected)
    with pytest.raises(ValueError, match="shape"):
        peers.max_error(y[:, :-1], expected)
