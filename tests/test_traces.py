"""The trace families of ``retrace(trace=...)`` (docs/semantics.md, section 6.5): each against the
float64 oracle's own coefficient (rl_triton/testing/oracle.py, ``trace_coefficient``) on every
backend, with every flag form, packed sequences, sharded windows, ``out=`` and autograd; and the
argument errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.core import launch
from rl_triton.testing import oracle

from conftest import TRITON_INTERPRET_AT_STARTUP

TRACES = ["retrace", "importance", "tree_backup", "q_lambda", "peng"]
BACKENDS = (["cpu"] if launch.resolve_backend(None, torch.device("cpu")) == "cpu" else []) + ["torch"] + (
    ["triton"] if TRITON_INTERPRET_AT_STARTUP else [])
READS = {"retrace": ("log_pi", "log_mu"), "importance": ("log_pi", "log_mu"), "tree_backup": ("log_pi",),
         "q_lambda": ("greedy",), "peng": ()}


def _problem(seed, R=3, T=37, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def x(lo=-1.0, hi=1.0):
        return (lo + (hi - lo) * torch.rand(R, T, generator=g, dtype=torch.float64)).to(dtype)

    return dict(rewards=x(), q_values=x(), next_expected_q=x(), log_pi=x(-2.0, 0.0), log_mu=x(-2.0, 0.0),
                greedy=torch.rand(R, T, generator=g) < 0.7, done=torch.rand(R, T, generator=g) < 0.1,
                terminated=torch.rand(R, T, generator=g) < 0.05, truncated=torch.rand(R, T, generator=g) < 0.05)


def _inputs(p, trace):
    """The trace's own inputs from a problem (the others None)."""
    return dict(log_pi=p["log_pi"] if "log_pi" in READS[trace] else None,
                log_mu=p["log_mu"] if "log_mu" in READS[trace] else None,
                greedy=p["greedy"] if "greedy" in READS[trace] else None)


def _call(p, trace, flags, **kw):
    own = _inputs(p, trace)
    return rl_triton.retrace(p["rewards"], p["q_values"], own["log_pi"], own["log_mu"], trace=trace,
                             greedy=own["greedy"], next_expected_q=p["next_expected_q"],
                             **{f: p[f] for f in flags}, gamma=0.9, lmbda=0.8, **kw)


def _expected(p, trace, flags, c_bar=1.0):
    term = p["terminated"] if "terminated" in flags else p["done"]
    done = p["done"] if "done" in flags else p["terminated"] | p["truncated"]
    shape = p["rewards"].shape
    own = _inputs(p, trace)
    return oracle.retrace(p["rewards"].double().numpy(), p["q_values"].double().numpy(),
                          None if own["log_pi"] is None else own["log_pi"].double().numpy(),
                          None if own["log_mu"] is None else own["log_mu"].double().numpy(),
                          term.numpy(), done.numpy(), np.full(shape, 0.9), np.full(shape, 0.8), c_bar,
                          next_expected_q=p["next_expected_q"].double().numpy(), trace=trace,
                          greedy=None if own["greedy"] is None else own["greedy"].numpy())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("flags", [("done",), ("terminated", "truncated")])
@pytest.mark.parametrize("trace", TRACES)
def test_every_trace_matches_the_oracle(trace, flags, dtype, tol, backend):
    p = _problem(hash((trace, flags)) % 1000, dtype=dtype)
    got = _call(p, trace, flags, backend=backend)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.double().numpy(), _expected(p, trace, flags), rtol=tol, atol=tol)


def test_the_traces_differ_where_their_coefficients_do():
    """The oracle's families are not one another: on one problem every pair of traces gives
    different targets (so the test above tells a wrong mapping apart)."""
    p = _problem(5)
    results = {t: _expected(p, t, ("done",)) for t in TRACES}
    for a in TRACES:
        for b in TRACES:
            if a < b:
                assert not np.allclose(results[a], results[b]), (a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrace_is_the_default_and_c_bar_clips_it(backend):
    p = _problem(6)
    plain = rl_triton.retrace(p["rewards"], p["q_values"], p["log_pi"], p["log_mu"],
                              next_expected_q=p["next_expected_q"], done=p["done"], gamma=0.9, lmbda=0.8,
                              backend=backend)
    assert torch.equal(plain, _call(p, "retrace", ("done",), backend=backend))
    clipped = _call(p, "retrace", ("done",), backend=backend, c_bar=0.5)
    np.testing.assert_allclose(clipped.numpy(), _expected(p, "retrace", ("done",), c_bar=0.5), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("trace", TRACES)
def test_out_and_time_major_layout(trace):
    p = _problem(7)
    expected = _expected(p, trace, ("done",))
    tm = {k: v.t().contiguous() for k, v in p.items()}
    out = torch.empty_like(tm["rewards"])
    got = _call(tm, trace, ("done",), time_dim=0, out=out)
    assert got is out
    np.testing.assert_allclose(got.t().numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("trace", TRACES)
def test_packed_sequences_are_the_calls_of_each_sequence(trace):
    p = _problem(8, R=1, T=30)
    cuts = [0, 7, 8, 21, 30]
    packed = {k: v[0] for k, v in p.items()}
    got = _call(packed, trace, ("done",), cu_seqlens=torch.tensor(cuts), max_seqlen=13)
    for lo, hi in zip(cuts, cuts[1:]):
        piece = {k: v[:, lo:hi] for k, v in p.items()}
        np.testing.assert_allclose(got[lo:hi].numpy(), _expected(piece, trace, ("done",))[0], rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("trace", ["tree_backup", "q_lambda", "peng", "importance"])
def test_gradients_of_the_composed_path(trace):
    p = _problem(9, R=2, T=9)
    p["log_pi"] = p["log_pi"].clone().requires_grad_(trace in ("tree_backup", "importance"))
    r, q = p["rewards"].clone().requires_grad_(), p["q_values"].clone().requires_grad_()
    own = _inputs(p, trace)

    def f(r, q, *log_pi):
        return rl_triton.retrace(r, q, log_pi[0] if log_pi else None, own["log_mu"], trace=trace,
                                 greedy=own["greedy"], next_expected_q=p["next_expected_q"], done=p["done"],
                                 gamma=0.9, lmbda=0.8)

    args = (r, q) + ((p["log_pi"],) if p["log_pi"].requires_grad else ())
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("trace,given,message", [
    ("nope", {}, "trace must be one of"),
    ("tree_backup", {"log_pi": None}, "trace='tree_backup' needs log_pi"),
    ("tree_backup", {"log_mu": True}, "trace='tree_backup' reads no log_mu"),
    ("peng", {"log_pi": True}, "trace='peng' reads no log_pi"),
    ("q_lambda", {"greedy": None}, "trace='q_lambda' needs greedy"),
    ("retrace", {"greedy": True}, "trace='retrace' reads no greedy"),
    ("importance", {"c_bar": 2.0}, "trace='importance' reads no c_bar"),
])
def test_a_trace_names_the_inputs_it_reads(trace, given, message):
    p = _problem(10)
    own = {"log_pi": p["log_pi"], "log_mu": p["log_mu"] if trace != "tree_backup" else None,
           "greedy": p["greedy"] if trace == "q_lambda" else None, "c_bar": None}
    if trace in ("peng", "q_lambda"):
        own.update(log_pi=None, log_mu=None)
    for name, value in given.items():
        own[name] = p[name] if value is True else value
    with pytest.raises(ValueError, match=message):
        rl_triton.retrace(p["rewards"], p["q_values"], own["log_pi"], own["log_mu"], trace=trace,
                          greedy=own["greedy"], c_bar=own["c_bar"], next_expected_q=p["next_expected_q"])


def test_greedy_must_broadcast_to_the_rewards():
    p = _problem(11)
    with pytest.raises(ValueError, match="greedy has shape"):
        rl_triton.retrace(p["rewards"], p["q_values"], trace="q_lambda", greedy=p["greedy"][:, :5],
                          next_expected_q=p["next_expected_q"])


def _sharded_worker(rank, world, group):
    p = _problem(12, T=23)
    lo, hi = [(0, 9), (9, 23)][rank]
    for trace in TRACES:
        for backend in ["cpu", "torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else []):
            chunk = {k: v[:, lo:hi] for k, v in p.items()}
            got = _call(chunk, trace, ("done",), backend=backend, group=group)
            expected = _expected(p, trace, ("done",))[:, lo:hi]
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12, err_msg=f"{trace} {backend}")


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_sharded_windows_match_the_unsharded_call():
    from test_distributed import _spawn

    _spawn(_sharded_worker, 2)
