"""Graph replay of repeated calls (rl_triton/core/graphs.py), checked without a GPU: the capture
is a stand-in that records what it captured and replays by launching the captured call again,
and CPU plans stand in for CUDA ones. What this checks is the bookkeeping: which calls are
captured and replayed (keys: the signature and every tensor's data pointer), the preconditions
a replay reruns, eviction, the switch, and the fallbacks; every result against the float64
oracle. That a captured graph recomputes the call is checked on a GPU
(benchmarks/gpu_check.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.core import graphs, plans
from rl_triton.testing import oracle


@pytest.fixture
def replays(monkeypatch):
    """Replays switched on for CPU plans whose outputs go to ``out=``; yields the record of
    captures ("capture") and replays ("replay")."""
    record = []

    def capture(launch, device):
        record.append("capture")
        if launch() is None:
            return None

        def replay():
            record.append("replay")
            launch()

        return replay

    monkeypatch.setenv("RL_TRITON_GRAPHS", "1")
    monkeypatch.setattr(graphs, "eligible", graphs.outputs_given)
    monkeypatch.setattr(graphs, "launch_ok", lambda device: True)
    monkeypatch.setattr(graphs, "capturing", lambda: False)
    monkeypatch.setattr(graphs, "capture", capture)
    plans.clear()
    yield record
    plans.clear()


def _problem(seed, R=3, T=17):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, T, generator=g, dtype=torch.float64), torch.randn(R, T, generator=g, dtype=torch.float64), \
        torch.rand(R, T, generator=g) < 0.2


def _expected(r, v, d, gamma=0.9, lmbda=0.8):
    nv = torch.cat([v[:, 1:], torch.zeros(v.shape[0], 1, dtype=v.dtype)], 1)
    return oracle.gae(r.numpy(), v.numpy(), nv.numpy(), d.numpy(), d.numpy(), np.full(r.shape, gamma),
                      np.full(r.shape, lmbda))


def _call(r, v, d, out, gamma=0.9):
    return rl_triton.gae(r, v, done=d, gamma=gamma, lmbda=0.8, backend="cpu", out=out)


def _assert_oracle(got, r, v, d, gamma=0.9):
    for g, w in zip(got, _expected(r, v, d, gamma)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12)


def test_the_third_call_with_the_same_tensors_replays_and_reads_their_new_values(replays):
    r, v, d = _problem(0)
    out = (torch.empty_like(r), torch.empty_like(r))
    for i in range(5):
        r.copy_(_problem(10 + i)[0])  # new values in the same memory
        got = _call(r, v, d, out)
        assert got[0] is out[0] and got[1] is out[1]
        _assert_oracle(got, r, v, d)
    # 1: the full path (the plan), 2: the plan's hit (first occurrence of the pointers),
    # 3: captured and replayed once, 4 and 5: replays
    assert replays == ["capture", "replay", "replay", "replay"]


def test_other_tensors_are_another_graph(replays):
    r, v, d = _problem(1)
    outs = [(torch.empty_like(r), torch.empty_like(r)) for _ in range(2)]
    for i in range(3):
        for out in outs:
            _assert_oracle(_call(r, v, d, out), r, v, d)
    assert replays.count("capture") == 2  # one graph per output pair, each captured on its second call
    moved = r.clone()  # the same values at another address: a new key, first occurrence
    _assert_oracle(_call(moved, v, d, outs[0]), moved, v, d)
    assert replays.count("capture") == 2


def test_calls_without_out_are_never_captured(replays):
    r, v, d = _problem(2)
    for _ in range(4):
        _assert_oracle(_call(r, v, d, None), r, v, d)
    assert replays == []


@pytest.mark.parametrize("setting", ["0", "off", "false", " No "])
def test_the_environment_variable_switches_replays_off(replays, monkeypatch, setting):
    monkeypatch.setenv("RL_TRITON_GRAPHS", setting)
    _repeat_without_a_graph(replays, 3)


@pytest.mark.parametrize("setting", [None, "1", "on"])
def test_replays_are_on_by_default(replays, monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("RL_TRITON_GRAPHS")
    else:
        monkeypatch.setenv("RL_TRITON_GRAPHS", setting)
    r, v, d = _problem(3)
    out = (torch.empty_like(r), torch.empty_like(r))
    for _ in range(4):
        _assert_oracle(_call(r, v, d, out), r, v, d)
    assert replays == ["capture", "replay", "replay"]  # the third call captures, the fourth replays too


def test_nothing_is_captured_while_the_callers_stream_captures(replays, monkeypatch):
    monkeypatch.setattr(graphs, "capturing", lambda: True)
    _repeat_without_a_graph(replays, 4)


def _repeat_without_a_graph(replays, seed):
    r, v, d = _problem(seed)
    out = (torch.empty_like(r), torch.empty_like(r))
    for _ in range(4):
        _assert_oracle(_call(r, v, d, out), r, v, d)
    assert replays == []


def test_the_least_recently_replayed_graph_is_evicted(replays, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    r, v, d = _problem(5)
    outs = [(torch.empty_like(r), torch.empty_like(r)) for _ in range(3)]
    _call(r, v, d, outs[0])  # the full path: the plan, no graph entry
    for out in outs:  # first occurrences: three entries, the first evicted by the third
        _call(r, v, d, out)
    assert len(graphs._graphs) == 2
    _assert_oracle(_call(r, v, d, outs[0]), r, v, d)  # a first occurrence again (evicted)
    assert replays == []
    _assert_oracle(_call(r, v, d, outs[2]), r, v, d)  # still kept: captured
    assert replays == ["capture", "replay"]


def test_a_failed_capture_leaves_the_calls_on_the_plans_path(replays, monkeypatch):
    captures = []
    monkeypatch.setattr(graphs, "capture", lambda launch, device: captures.append(1))
    r, v, d = _problem(6)
    out = (torch.empty_like(r), torch.empty_like(r))
    for i in range(5):
        r.copy_(_problem(20 + i)[0])
        _assert_oracle(_call(r, v, d, out), r, v, d)
    assert captures == [1]  # tried once, never again


def test_a_number_read_from_a_tensor_is_checked_before_a_replay(replays):
    r, v, d = _problem(7)
    out = (torch.empty_like(r), torch.empty_like(r))
    gamma = torch.tensor(0.9, dtype=torch.float64)
    for _ in range(3):
        _call(r, v, d, out, gamma=gamma)
    assert replays == ["capture", "replay"]
    gamma.fill_(0.5)  # the graph holds 0.9: the call takes the full path
    _assert_oracle(_call(r, v, d, out, gamma=gamma), r, v, d, gamma=0.5)
    assert replays == ["capture", "replay"]


def test_value_checks_run_before_a_replay(replays):
    r, v, d = _problem(8)
    out = (torch.empty_like(r), torch.empty_like(r))
    flags = d.to(torch.float64)
    for _ in range(3):
        rl_triton.gae(r, v, done=flags, gamma=0.9, lmbda=0.8, backend="cpu", out=out)
    assert replays == ["capture", "replay"]
    flags[0, 0] = 0.5
    with pytest.raises(ValueError, match="done must hold only 0 and 1"):
        rl_triton.gae(r, v, done=flags, gamma=0.9, lmbda=0.8, backend="cpu", out=out)
    assert replays == ["capture", "replay"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [64, 20000])  # one pass, and segments with a workspace
def test_a_real_graph_recomputes_the_call_on_a_gpu(monkeypatch, T):
    """On a GPU: the graph captured on the second call recomputes the call from the tensors'
    current values on every replay, as the plain launch does."""
    monkeypatch.setenv("RL_TRITON_GRAPHS", "1")
    captured = []
    capture = graphs.capture
    monkeypatch.setattr(graphs, "capture", lambda launch, device: captured.append(1) or capture(launch, device))
    plans.clear()
    r, v, d = (x.cuda() for x in _problem(30, R=4, T=T))
    out = (torch.empty_like(r), torch.empty_like(r))
    for i in range(5):
        r.copy_(_problem(40 + i, R=4, T=T)[0])
        got = rl_triton.gae(r, v, done=d, gamma=0.9, lmbda=0.8, out=out)
        for g, w in zip(got, _expected(r.cpu(), v.cpu(), d.cpu())):
            np.testing.assert_allclose(g.cpu().numpy(), w, rtol=1e-10, atol=1e-10)
    assert captured == [1] and len(graphs._graphs) == 1
    plans.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_call_inside_the_callers_own_graph_launches_into_it(monkeypatch):
    """On a GPU, replays on by default: a call made while the caller's stream captures goes into
    the caller's graph as a plain launch (no replay of the library's graph inside it), and the
    caller's replays recompute it from the tensors' current values."""
    monkeypatch.delenv("RL_TRITON_GRAPHS", raising=False)
    plans.clear()
    r, v, d = (x.cuda() for x in _problem(50, R=4, T=64))
    out = (torch.empty_like(r), torch.empty_like(r))
    for _ in range(3):  # the plan, its hit path, the library's capture
        rl_triton.gae(r, v, done=d, gamma=0.9, lmbda=0.8, out=out)
    assert len(graphs._graphs) == 1
    theirs = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(theirs, stream=side):
        rl_triton.gae(r, v, done=d, gamma=0.9, lmbda=0.8, out=out)
    torch.cuda.current_stream().wait_stream(side)
    for i in range(2):
        r.copy_(_problem(60 + i, R=4, T=64)[0].cuda())
        out[0].zero_()
        theirs.replay()
        torch.cuda.synchronize()
        for g, w in zip(out, _expected(r.cpu(), v.cpu(), d.cpu())):
            np.testing.assert_allclose(g.cpu().numpy(), w, rtol=1e-10, atol=1e-10)
    plans.clear()
