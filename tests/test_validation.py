"""Input validation: clear TypeError / ValueError naming the argument, raised before any
kernel runs, with nothing written to the caller's tensors; edge shapes (T = 0, T = 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_triton.testing import make, oracle

F64 = torch.float64
N, T = 3, 5


def _t(*shape, seed=0, dtype=F64, low=-1.0, high=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)


def _flags(seed=0, p=0.3, shape=(N, T)):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) < p


def base_inputs(name, dtype=F64, shape=(N, T), time_dim=-1):
    """(args, kwargs) of a valid call to function `name`: the catalog's plain variant (no
    flags, every hyperparameter left to its default)."""
    problem = make(name, shape, "plain", dtype=dtype, time_dim=time_dim)
    return problem.args, problem.kwargs


ALL = ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace", "eligibility_trace",
       "episodic_cumsum", "affine_scan"]
FIRST_ARG = {"gae": "rewards", "td_lambda_return": "rewards", "discounted_return": "rewards",
             "vtrace": "rewards", "retrace": "rewards", "eligibility_trace": "x",
             "episodic_cumsum": "x", "affine_scan": "alpha"}
SECOND_ARG = {"gae": "values", "td_lambda_return": "next_values", "vtrace": "values",
              "retrace": "q_values", "affine_scan": "beta"}
WITH_GAMMA = ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace",
              "eligibility_trace"]
WITH_LMBDA = ["gae", "td_lambda_return", "vtrace", "retrace", "eligibility_trace"]
WITH_DONE = ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace",
             "eligibility_trace", "episodic_cumsum"]
WITH_TERM = ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace"]


class Guard:
    """Snapshot every tensor passed and check none was written to."""

    def __init__(self, args, kwargs):
        tensors = [a for a in list(args) + list(kwargs.values())
                   if isinstance(a, torch.Tensor) and a.device.type != "meta"]
        self.items = [(t, t.clone()) for t in tensors]

    def check(self):
        for t, snap in self.items:
            assert torch.equal(t, snap) or (t.isnan() == snap.isnan()).all(), \
                "a caller tensor was written to on error"


def expect_error(rt, name, args, kwargs, exc, match, backend):
    guard = Guard(args, kwargs)
    with pytest.raises(exc, match=match):
        getattr(rt, name)(*args, **kwargs, backend=backend)
    guard.check()


# ----------------------------------------------------------------------------------------
# types and dtypes
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [[[1.0, 2.0]], np.zeros((2, 3)), 1.0, None])
def test_non_tensor_first_arg(name, bad, cpu_backend, rt):
    args, kw = base_inputs(name)
    args = (bad,) + args[1:]
    expect_error(rt, name, args, kw, TypeError, FIRST_ARG[name], cpu_backend)


@pytest.mark.parametrize("name", list(SECOND_ARG))
def test_non_tensor_second_arg(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    args = (args[0], args[1].tolist()) + args[2:]
    expect_error(rt, name, args, kw, TypeError, SECOND_ARG[name], cpu_backend)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_first_arg(name, int_dtype, cpu_backend, rt):
    args, kw = base_inputs(name)
    args = (args[0].round().to(int_dtype),) + args[1:]
    expect_error(rt, name, args, kw, TypeError, FIRST_ARG[name], cpu_backend)


@pytest.mark.parametrize("name", list(SECOND_ARG))
def test_integer_values(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    args = (args[0], args[1].round().to(torch.int64)) + args[2:]
    expect_error(rt, name, args, kw, TypeError, SECOND_ARG[name], cpu_backend)


@pytest.mark.parametrize("name", list(SECOND_ARG))
@pytest.mark.parametrize("pair", [(torch.float32, F64), (F64, torch.float32),
                                  (torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
def test_mismatched_float_dtypes(name, pair, cpu_backend, rt):
    a, b = pair
    args, kw = base_inputs(name, dtype=a)
    args = (args[0], args[1].to(b)) + args[2:]
    expect_error(rt, name, args, kw, TypeError, SECOND_ARG[name], cpu_backend)


@pytest.mark.parametrize("kwarg,name", [
    ("next_values", "gae"), ("bootstrap_value", "gae"), ("next_values", "vtrace"),
    ("next_expected_q", "retrace"), ("initial", "eligibility_trace"),
    ("initial", "episodic_cumsum"), ("initial", "affine_scan"),
    ("bootstrap_value", "discounted_return"), ("next_values", "discounted_return"),
])
def test_mismatched_dtype_keyword_tensor(kwarg, name, cpu_backend, rt):
    args, kw = base_inputs(name, dtype=torch.float32)
    shape = (N,) if kwarg in ("bootstrap_value", "initial") else (N, T)
    kw[kwarg] = _t(*shape, seed=9, dtype=F64)
    expect_error(rt, name, args, kw, TypeError, kwarg, cpu_backend)


@pytest.mark.parametrize("name", ["vtrace", "retrace"])
@pytest.mark.parametrize("which", [2, 3])
def test_mismatched_dtype_log_probs(name, which, cpu_backend, rt):
    args = list(base_inputs(name, dtype=torch.float32)[0])
    kw = base_inputs(name, dtype=torch.float32)[1]
    args[which] = args[which].double()
    expect_error(rt, name, tuple(args), kw, TypeError, ["log_pi", "log_mu"][which - 2], cpu_backend)


def test_gamma_tensor_may_have_other_float_dtype(cpu_backend, rt):
    """gamma/lmbda tensors may have any float dtype (docs/semantics.md section 1)."""
    r, v = _t(N, T, seed=1, dtype=torch.float32), _t(N, T, seed=2, dtype=torch.float32)
    a = rt.gae(r, v, gamma=torch.full((N, T), 0.5, dtype=F64),
               lmbda=torch.tensor(0.5, dtype=torch.bfloat16), backend=cpu_backend)[0]
    b = rt.gae(r, v, gamma=0.5, lmbda=0.5, backend=cpu_backend)[0]
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", WITH_GAMMA)
def test_integer_gamma_tensor_rejected(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["gamma"] = torch.ones(N, T, dtype=torch.int64)
    expect_error(rt, name, args, kw, (TypeError, ValueError), "gamma", cpu_backend)


# ----------------------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SECOND_ARG))
@pytest.mark.parametrize("bad_shape", [(N, T + 1), (N + 1, T), (T,), (2, N, T)])
def test_mismatched_shapes(name, bad_shape, cpu_backend, rt):
    args, kw = base_inputs(name)
    if name == "affine_scan" and bad_shape == (2, N, T):
        pytest.skip("alpha and beta broadcast to one shape (docs/semantics.md section 5)")
    if bad_shape == (T,):
        # a [T] tensor broadcasts to [N, T]: use a wrong T instead
        bad_shape = (T + 2,)
    args = (args[0], _t(*bad_shape, seed=7)) + args[2:]
    expect_error(rt, name, args, kw, ValueError, SECOND_ARG[name], cpu_backend)


@pytest.mark.parametrize("name", WITH_DONE)
def test_flag_shape_mismatch(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["done"] = _flags(shape=(N, T + 1))
    expect_error(rt, name, args, kw, ValueError, "done", cpu_backend)


@pytest.mark.parametrize("name", WITH_TERM)
def test_terminated_shape_mismatch(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    if name in ("gae", "vtrace", "discounted_return"):
        kw["next_values"] = _t(N, T, seed=8)
    kw["terminated"] = _flags(shape=(N + 1, T))
    expect_error(rt, name, args, kw, ValueError, "terminated", cpu_backend)


@pytest.mark.parametrize("name,kwarg", [("gae", "bootstrap_value"), ("vtrace", "bootstrap_value"),
                                        ("discounted_return", "bootstrap_value"),
                                        ("eligibility_trace", "initial"),
                                        ("episodic_cumsum", "initial"), ("affine_scan", "initial")])
def test_per_row_shape_mismatch(name, kwarg, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw[kwarg] = _t(N + 1, seed=3)
    expect_error(rt, name, args, kw, ValueError, kwarg, cpu_backend)
    # the time dim may not be kept either: [N, T] is not "shape without the time dim"
    kw[kwarg] = _t(N, T, seed=3)
    expect_error(rt, name, args, kw, ValueError, kwarg, cpu_backend)


@pytest.mark.parametrize("name,kwarg", [("gae", "bootstrap_value"), ("vtrace", "bootstrap_value"),
                                        ("discounted_return", "bootstrap_value"),
                                        ("eligibility_trace", "initial"),
                                        ("episodic_cumsum", "initial"), ("affine_scan", "initial")])
def test_per_row_input_of_time_major_data_gets_a_hint(name, kwarg, cpu_backend, rt):
    """[T, N] data passed with the default time_dim=-1: a per-row input of N values (what
    time_dim=0 would take) gets a hint in the error; the same input with time_dim=0 is fine."""
    args, kw = base_inputs(name, shape=(T, N))
    kw[kwarg] = _t(N, seed=3)
    expect_error(rt, name, args, kw, ValueError, r"\(time-major data\? pass time_dim=0\)", cpu_backend)
    getattr(rt, name)(*args, **kw, time_dim=0, backend=cpu_backend)
    # a shape that fits neither layout gets no hint
    kw[kwarg] = _t(N + 1, seed=3)
    with pytest.raises(ValueError, match=kwarg) as err:
        getattr(rt, name)(*args, **kw, backend=cpu_backend)
    assert "time-major" not in str(err.value)


def test_last_done_of_time_major_data_gets_a_hint(cpu_backend, rt):
    args, kw = base_inputs("gae", shape=(T, N))
    kw.update(episode_starts=_flags(shape=(T, N)), last_done=_flags(shape=(N,)))
    expect_error(rt, "gae", args, kw, ValueError, r"last_done .*\(time-major data\? pass time_dim=0\)",
                 cpu_backend)


def test_retrace_action_tensor_shapes(cpu_backend, rt):
    args, _ = base_inputs("retrace")
    pi = torch.softmax(_t(N, T, 4, seed=5), -1)
    q = _t(N, T, 4, seed=6)
    expect_error(rt, "retrace", args, {"next_pi": pi, "next_q": _t(N, T, 3, seed=6)}, ValueError,
                 "next_q|next_pi", cpu_backend)
    expect_error(rt, "retrace", args, {"next_pi": pi[..., 0], "next_q": q}, ValueError,
                 "next_pi", cpu_backend)
    expect_error(rt, "retrace", args, {"next_pi": pi, "next_q": _t(N, T + 1, 4, seed=6)},
                 ValueError, "next_q", cpu_backend)


def test_values_larger_than_rewards(cpu_backend, rt):
    """values must broadcast TO the rewards' shape, not the other way around."""
    r = _t(T, seed=1)
    v = _t(2, T, seed=2)
    expect_error(rt, "gae", (r, v), {}, ValueError, "values", cpu_backend)


# ----------------------------------------------------------------------------------------
# devices
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SECOND_ARG))
def test_different_devices(name, cpu_backend, rt):
    if not torch.cuda.is_available():
        pytest.skip("needs a second device (CUDA)")
    args, kw = base_inputs(name)
    args = (args[0], args[1].cuda()) + args[2:]
    expect_error(rt, name, args, kw, ValueError, SECOND_ARG[name], cpu_backend)


@pytest.mark.parametrize("name", list(SECOND_ARG))
def test_different_devices_meta(name, cpu_backend, rt):
    """CPU-only stand-in for a second device: a tensor on the meta device."""
    args, kw = base_inputs(name)
    args = (args[0], args[1].to("meta")) + args[2:]
    expect_error(rt, name, args, kw, ValueError, SECOND_ARG[name], cpu_backend)


@pytest.mark.parametrize("kwarg", ["done", "terminated", "gamma", "bootstrap_value",
                                   "next_values"])
def test_keyword_tensor_on_other_device(kwarg, cpu_backend, rt):
    args, kw = base_inputs("gae")
    value = {"done": _flags(), "terminated": _flags(), "gamma": torch.full((N, T), 0.5, dtype=F64),
             "bootstrap_value": _t(N, seed=3), "next_values": _t(N, T, seed=4)}[kwarg]
    kw[kwarg] = value.to("meta")
    expect_error(rt, "gae", args, kw, ValueError, kwarg, cpu_backend)


def test_cpu_backend_rejects_cuda(rt):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args, kw = base_inputs("gae")
    args = tuple(a.cuda() for a in args)
    expect_error(rt, "gae", args, kw, ValueError, "backend", "cpu")


# ----------------------------------------------------------------------------------------
# time_dim
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("td", [2, -3, 5, -100])
def test_time_dim_out_of_range(name, td, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["time_dim"] = td
    expect_error(rt, name, args, kw, ValueError, "time_dim", cpu_backend)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("td", [1.0, "1", None, (1,)])
def test_time_dim_not_int(name, td, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["time_dim"] = td
    expect_error(rt, name, args, kw, (TypeError, ValueError), "time_dim", cpu_backend)


# ----------------------------------------------------------------------------------------
# gamma / lmbda / clip ranges
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WITH_GAMMA)
@pytest.mark.parametrize("bad", [-0.1, 1.0001, 2.0, -1e-9, math.nan, math.inf])
def test_gamma_out_of_range_float(name, bad, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["gamma"] = bad
    expect_error(rt, name, args, kw, ValueError, "gamma", cpu_backend)


@pytest.mark.parametrize("name", WITH_LMBDA)
@pytest.mark.parametrize("bad", [-0.5, 1.5, math.nan])
def test_lmbda_out_of_range_float(name, bad, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["lmbda"] = bad
    expect_error(rt, name, args, kw, ValueError, "lmbda", cpu_backend)


@pytest.mark.parametrize("name", WITH_GAMMA)
@pytest.mark.parametrize("form", ["zero_dim", "per_row", "per_step"])
@pytest.mark.parametrize("param", ["gamma", "lmbda"])
def test_coefficient_tensor_out_of_range(name, form, param, cpu_backend, rt):
    if param == "lmbda" and name not in WITH_LMBDA:
        pytest.skip("no lmbda")
    args, kw = base_inputs(name)
    if form == "zero_dim":
        bad = torch.tensor(1.25, dtype=F64)
    elif form == "per_row":
        bad = torch.full((N, 1), 0.5, dtype=F64)
        bad[1, 0] = -0.25
    else:
        bad = torch.full((N, T), 0.5, dtype=F64)
        bad[2, 3] = 1.5
    kw[param] = bad
    expect_error(rt, name, args, kw, ValueError, param, cpu_backend)


@pytest.mark.parametrize("name", WITH_GAMMA)
def test_gamma_tensor_wrong_shape(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["gamma"] = torch.full((N, T + 1), 0.5, dtype=F64)
    expect_error(rt, name, args, kw, ValueError, "gamma", cpu_backend)


@pytest.mark.parametrize("name,param", [("vtrace", "rho_bar"), ("vtrace", "c_bar"),
                                        ("vtrace", "rho_bar_pg"), ("retrace", "c_bar")])
@pytest.mark.parametrize("bad", [0.0, -1.0, -math.inf, math.nan])
def test_clip_thresholds(name, param, bad, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw[param] = bad
    expect_error(rt, name, args, kw, ValueError, param, cpu_backend)


@pytest.mark.parametrize("name,param", [("vtrace", "rho_bar"), ("vtrace", "c_bar"),
                                        ("vtrace", "rho_bar_pg"), ("retrace", "c_bar")])
def test_clip_threshold_inf_allowed(name, param, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw[param] = math.inf
    out = getattr(rt, name)(*args, **kw, backend=cpu_backend)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize("name", WITH_GAMMA)
@pytest.mark.parametrize("edge", [0.0, 1.0])
def test_gamma_edges_allowed(name, edge, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["gamma"] = edge
    if name in WITH_LMBDA:
        kw["lmbda"] = edge
    getattr(rt, name)(*args, **kw, backend=cpu_backend)


# ----------------------------------------------------------------------------------------
# flag conventions
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WITH_TERM)
def test_truncated_with_done(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    if name in ("gae", "vtrace", "discounted_return"):
        kw["next_values"] = _t(N, T, seed=8)
    kw["done"] = _flags(1)
    kw["truncated"] = _flags(1)
    expect_error(rt, name, args, kw, ValueError, "truncated", cpu_backend)


@pytest.mark.parametrize("name", WITH_TERM)
def test_terminated_where_done_is_not(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    if name in ("gae", "vtrace", "discounted_return"):
        kw["next_values"] = _t(N, T, seed=8)
    done = torch.zeros(N, T, dtype=torch.bool)
    term = torch.zeros(N, T, dtype=torch.bool)
    done[0, 1] = True
    term[0, 1] = True
    term[2, 4] = True  # terminated but not done
    kw["done"] = done
    kw["terminated"] = term
    expect_error(rt, name, args, kw, ValueError, "terminated", cpu_backend)


@pytest.mark.parametrize("name", WITH_DONE)
@pytest.mark.parametrize("bad_flag", [
    torch.tensor(2, dtype=torch.uint8), torch.tensor(-1, dtype=torch.int64),
    torch.tensor(0.5, dtype=F64), torch.tensor(3, dtype=torch.int32),
])
def test_flags_outside_zero_one(name, bad_flag, cpu_backend, rt):
    args, kw = base_inputs(name)
    if name in ("gae", "vtrace", "discounted_return"):
        kw["next_values"] = _t(N, T, seed=8)
    flag = torch.zeros(N, T, dtype=bad_flag.dtype)
    flag[1, 2] = bad_flag
    kw["done"] = flag
    expect_error(rt, name, args, kw, ValueError, "done", cpu_backend)


@pytest.mark.parametrize("name", ["gae", "vtrace"])
@pytest.mark.parametrize("flags", ["truncated", "done+terminated", "truncated+terminated"])
def test_implied_next_values_with_truncation(name, flags, cpu_backend, rt):
    args, kw = base_inputs(name)
    if flags == "truncated":
        kw["truncated"] = _flags(2)
    elif flags == "done+terminated":
        kw["done"] = _flags(2)
        kw["terminated"] = _flags(2) & _flags(3)
    else:
        kw["truncated"] = _flags(2)
        kw["terminated"] = _flags(3) & ~_flags(2)
    expect_error(rt, name, args, kw, ValueError, "next_values", cpu_backend)
    # even with bootstrap_value
    kw["bootstrap_value"] = _t(N, seed=4)
    expect_error(rt, name, args, kw, ValueError, "next_values", cpu_backend)


def test_discounted_return_truncation_needs_next_values(cpu_backend, rt):
    args, kw = base_inputs("discounted_return")
    kw["truncated"] = _flags(2)
    expect_error(rt, "discounted_return", args, kw, ValueError, "next_values", cpu_backend)


@pytest.mark.parametrize("name", ["gae", "vtrace"])
def test_implied_form_without_truncation_ok(name, cpu_backend, rt):
    """terminated only, or done only, needs no next_values."""
    args, kw = base_inputs(name)
    getattr(rt, name)(*args, terminated=_flags(2), backend=cpu_backend)
    getattr(rt, name)(*args, done=_flags(2), backend=cpu_backend)
    getattr(rt, name)(*args, done=_flags(2), bootstrap_value=_t(N, seed=3), backend=cpu_backend)


@pytest.mark.parametrize("name", ["gae", "vtrace"])
def test_next_values_with_bootstrap_value(name, cpu_backend, rt):
    args, kw = base_inputs(name)
    kw["next_values"] = _t(N, T, seed=8)
    kw["bootstrap_value"] = _t(N, seed=9)
    expect_error(rt, name, args, kw, ValueError, "bootstrap_value", cpu_backend)


# ----------------------------------------------------------------------------------------
# retrace's next-value forms
# ----------------------------------------------------------------------------------------


def test_retrace_both_forms(cpu_backend, rt):
    args, kw = base_inputs("retrace")
    kw["next_pi"] = torch.softmax(_t(N, T, 3, seed=5), -1)
    kw["next_q"] = _t(N, T, 3, seed=6)
    expect_error(rt, "retrace", args, kw, ValueError, "next_expected_q", cpu_backend)


def test_retrace_neither_form(cpu_backend, rt):
    args, _ = base_inputs("retrace")
    expect_error(rt, "retrace", args, {}, ValueError, "next_expected_q", cpu_backend)


@pytest.mark.parametrize("given_", ["next_pi", "next_q"])
def test_retrace_half_pair(given_, cpu_backend, rt):
    args, _ = base_inputs("retrace")
    kw = {given_: _t(N, T, 3, seed=5)}
    missing = "next_q" if given_ == "next_pi" else "next_pi"
    expect_error(rt, "retrace", args, kw, ValueError, missing, cpu_backend)


# ----------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", ["numba", "cuda", "", "gpu"])
def test_unknown_backend(name, bad, rt):
    args, kw = base_inputs(name)
    expect_error(rt, name, args, kw, ValueError, "backend", bad)


def test_backend_not_a_string(rt):
    args, kw = base_inputs("gae")
    expect_error(rt, "gae", args, kw, (TypeError, ValueError), "backend", 3)


def test_unknown_backend_from_env(rt, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", "bogus")
    args, kw = base_inputs("gae")
    expect_error(rt, "gae", args, kw, ValueError, "backend|RL_TRITON_BACKEND", None)


def test_triton_backend_without_cuda_or_interpreter(rt):
    from conftest import TRITON_INTERPRET_AT_STARTUP

    if torch.cuda.is_available() or TRITON_INTERPRET_AT_STARTUP:
        pytest.skip("triton can run here")
    args, kw = base_inputs("gae")
    expect_error(rt, "gae", args, kw, ValueError, "backend|triton", "triton")


# ----------------------------------------------------------------------------------------
# nothing written on error, inputs never modified on success
# ----------------------------------------------------------------------------------------


def test_outputs_do_not_alias_inputs(cpu_backend, rt):
    r, v = _t(N, T, seed=1), _t(N, T, seed=2)
    snap = (r.clone(), v.clone())
    adv, tgt = rt.gae(r, v, done=_flags(), backend=cpu_backend)
    assert torch.equal(r, snap[0]) and torch.equal(v, snap[1])
    for o in (adv, tgt):
        assert o.data_ptr() not in (r.data_ptr(), v.data_ptr())
    y = rt.affine_scan(r, v, backend=cpu_backend)
    assert y.data_ptr() not in (r.data_ptr(), v.data_ptr())
    assert torch.equal(r, snap[0])


def test_value_error_after_partial_validation_writes_nothing(cpu_backend, rt):
    """The data-dependent check (terminated where done is not) comes after the structural
    ones; still nothing written."""
    r, v, nv = _t(N, T, seed=1), _t(N, T, seed=2), _t(N, T, seed=3)
    done = torch.zeros(N, T, dtype=torch.uint8)
    term = torch.zeros(N, T, dtype=torch.uint8)
    term[1, 1] = 1
    g = torch.full((N, T), 0.9, dtype=F64)
    expect_error(rt, "gae", (r, v), dict(next_values=nv, done=done, terminated=term, gamma=g),
                 ValueError, "terminated", cpu_backend)


# ----------------------------------------------------------------------------------------
# edge shapes
# ----------------------------------------------------------------------------------------


def _call_all(rt, name, shape, backend, time_dim=-1):
    args, kw = base_inputs(name, shape=shape, time_dim=time_dim)
    kw = dict(kw, time_dim=time_dim)
    if name in WITH_DONE:
        kw["done"] = torch.zeros(shape, dtype=torch.bool)
    return getattr(rt, name)(*args, **kw, backend=backend)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape,time_dim", [((N, 0), -1), ((0,), -1), ((0, N), 0),
                                            ((2, 0, 1), -2), ((0, T), -1), ((2, 0, 3), 1)])
def test_empty_outputs(name, shape, time_dim, backend, rt):
    out = _call_all(rt, name, shape, backend, time_dim)
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == (2 if name in ("gae", "vtrace") else 1)
    for o in outs:
        assert isinstance(o, torch.Tensor)
        assert tuple(o.shape) == shape
        assert o.dtype == F64


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape,time_dim", [((N, 1), -1), ((1,), 0), ((1, N), 0), ((2, 1, 1), -2)])
def test_single_step(name, shape, time_dim, backend, rt):
    out = _call_all(rt, name, shape, backend, time_dim)
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        assert tuple(o.shape) == shape
        assert torch.isfinite(o).all()


def test_single_step_values(backend, rt):
    """T = 1: every estimator reduces to its one-step formula."""
    r = torch.tensor([[1.0], [2.0]], dtype=F64)
    v = torch.tensor([[0.5], [-1.0]], dtype=F64)
    nv = torch.tensor([[3.0], [4.0]], dtype=F64)
    term = torch.tensor([[False], [True]])
    # GAE: A = r + g (1-term) nv - v = [1 + 1.5 - 0.5, 2 - (-1)] = [2, 3]
    adv, tgt = rt.gae(r, v, next_values=nv, terminated=term, gamma=0.5, lmbda=0.3,
                      backend=backend)
    torch.testing.assert_close(adv, torch.tensor([[2.0], [3.0]], dtype=F64))
    torch.testing.assert_close(tgt, torch.tensor([[2.5], [2.0]], dtype=F64))
    # TD(lambda) = r + g (1-term) nv = [2.5, 2]
    G = rt.td_lambda_return(r, nv, terminated=term, gamma=0.5, lmbda=0.3, backend=backend)
    torch.testing.assert_close(G, torch.tensor([[2.5], [2.0]], dtype=F64))
    ref = oracle.td_lambda_return(r.numpy(), nv.numpy(), term.numpy(), term.numpy(),
                                  np.full((2, 1), 0.5), np.full((2, 1), 0.3))
    np.testing.assert_allclose(ref, [[2.5], [2.0]])


# ----------------------------------------------------------------------------------------
# opt-in / opt-out value checks
# ----------------------------------------------------------------------------------------


def test_check_values_forced_on(cpu_backend, rt, monkeypatch):
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "1")
    args, kw = base_inputs("gae")
    flag = torch.zeros(N, T, dtype=torch.uint8)
    flag[0, 0] = 2
    expect_error(rt, "gae", args, dict(kw, done=flag), ValueError, "done", cpu_backend)
