"""rl_triton.integrations.torchrl against TorchRL's own (loop) functionals and classes.

The oracle here is TorchRL: its Python-loop functionals (``functional.generalized_advantage_estimate``,
``td_lambda_return_estimate``, ``td1_return_estimate``, ``vtrace_advantage_estimate``) and its
unpatched estimator classes. Python-float discounts are drawn from values exact in float32:
TorchRL's loop GAE and V-trace multiply a Python float by an int32 mask, which rounds it to
float32, while rl_triton applies it exactly in float64 (docs/torchrl.md).
"""

from __future__ import annotations

import inspect
import threading
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("torchrl")
pytest.importorskip("tensordict")

from tensordict import TensorDict  # noqa: E402
from tensordict.nn import NormalParamExtractor, TensorDictModule  # noqa: E402
from torchrl.modules import ProbabilisticActor, ValueOperator  # noqa: E402
from torchrl.objectives import ClipPPOLoss, ValueEstimators  # noqa: E402
from torchrl.objectives import utils as obj_utils  # noqa: E402
from torchrl.objectives.value import advantages as tadv  # noqa: E402
from torchrl.objectives.value import functional as tfn  # noqa: E402

import rl_triton.integrations.torchrl as rtt  # noqa: E402
from helpers import concurrent_patch_use, nested_blocks_across_threads  # noqa: E402

F64 = torch.float64
GAMMAS = (0.5, 0.9375, 0.984375)  # exact in float32, see the module docstring
NAMES = (
    "generalized_advantage_estimate",
    "vec_generalized_advantage_estimate",
    "td_lambda_return_estimate",
    "vec_td_lambda_return_estimate",
    "td1_return_estimate",
    "vec_td1_return_estimate",
    "vtrace_advantage_estimate",
)


@pytest.fixture(autouse=True)
def _always_unpatched():
    rtt.unpatch()
    yield
    rtt.unpatch()


def close(a, b, tol=1e-10):
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

# (shape in TorchRL's [*B, T, *F] layout with T at -2, layout transform, time_dim to pass)
LAYOUTS = [
    ((11, 1), None, -2),  # no batch dims
    ((3, 11, 1), None, -2),
    ((2, 3, 11, 2), None, -2),  # multi-dim batch, features
    ((3, 11, 2, 5), "feat2", -3),  # two feature dims (TorchRL's test_gae_multidim)
    ((3, 11, 1), "time_first", 0),  # [T, B, 1] with time_dim=0
    ((3, 11, 1), "time_last", -1),  # [B, 1, T] with time_dim=-1
]


def _layout(x, how):
    if how is None or how == "feat2":
        return x
    if how == "time_first":
        return x.transpose(0, 1).contiguous()
    return x.transpose(-2, -1).contiguous()


def _data(shape, seed, p_done=0.15, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    v, nv, r, lp, lm = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(5))
    term = torch.rand(shape, generator=g) < p_done
    done = (torch.rand(shape, generator=g) < p_done) | term
    done[..., -1, :] |= torch.rand(done[..., -1, :].shape, generator=g) < 0.5  # sometimes done at T-1
    return dict(v=v, nv=nv, r=r, done=done, term=term, lp=lp, lm=lm, g=g)


def _coef(kind, value, shape, g):
    if kind == "float":
        return value
    if kind == "tensor0d":
        return torch.tensor(value, dtype=F64)
    if kind == "tensor1":
        return torch.tensor([value], dtype=F64)
    return torch.rand(shape, generator=g, dtype=F64)  # "full": per-step


# ---------------------------------------------------------------------------------------------
# functionals
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_signatures_match_torchrl(name):
    ours, theirs = inspect.signature(getattr(rtt, name)), inspect.signature(getattr(tfn, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("gkind", ["float", "tensor0d", "tensor1", "full"])
@pytest.mark.parametrize("vec", [False, True])
def test_gae_matches_torchrl_loop(layout, gkind, vec):
    shape, how, time_dim = layout
    d = _data(shape, seed=hash((shape, gkind, vec)) % 1000)
    gamma = _coef(gkind, GAMMAS[1], shape, d["g"])
    lmbda = _coef(gkind, 0.75, shape, d["g"])
    args = [_layout(x, how) if isinstance(x, torch.Tensor) and x.numel() > 1 else x
            for x in (gamma, lmbda, d["v"], d["nv"], d["r"], d["done"], d["term"])]
    fn = rtt.vec_generalized_advantage_estimate if vec else rtt.generalized_advantage_estimate
    adv, vt = fn(*args, time_dim=time_dim)
    adv_ref, vt_ref = tfn.generalized_advantage_estimate(*args, time_dim=time_dim)
    close(adv, adv_ref)
    close(vt, vt_ref)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_gae_terminated_defaults_to_done_and_lambda_zero(gamma):
    d = _data((4, 9, 1), seed=3)
    for lmbda in (0.0, 1.0):
        ours = rtt.vec_generalized_advantage_estimate(gamma, lmbda, d["v"], d["nv"], d["r"], d["done"])
        ref = tfn.generalized_advantage_estimate(gamma, lmbda, d["v"], d["nv"], d["r"], d["done"])
        close(ours[0], ref[0])


@pytest.mark.parametrize("layout", LAYOUTS[:5], ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("gkind", ["float", "tensor1", "full", "full_lambda_only"])
@pytest.mark.parametrize("rolling", [None, True, False])
def test_td_lambda_matches_torchrl_loop(layout, gkind, rolling):
    shape, how, time_dim = layout
    d = _data(shape, seed=hash((shape, gkind, rolling)) % 1000)
    if gkind == "full_lambda_only":
        gamma, lmbda = GAMMAS[2], _coef("full", 0, shape, d["g"])
    else:
        gamma, lmbda = _coef(gkind, GAMMAS[2], shape, d["g"]), _coef(gkind, 0.5, shape, d["g"])
    args = [_layout(x, how) if isinstance(x, torch.Tensor) and x.numel() > 1 else x
            for x in (gamma, lmbda, d["nv"], d["r"], d["done"], d["term"])]
    if rolling is False and gkind in ("float", "tensor1"):
        with pytest.raises(RuntimeError, match="time-sensitive"):
            tfn.td_lambda_return_estimate(*args, rolling_gamma=False, time_dim=time_dim)
        with pytest.raises(RuntimeError, match="time-sensitive"):
            rtt.td_lambda_return_estimate(*args, rolling_gamma=False, time_dim=time_dim)
        return
    ref = tfn.td_lambda_return_estimate(*args, rolling_gamma=rolling, time_dim=time_dim)
    close(rtt.td_lambda_return_estimate(*args, rolling_gamma=rolling, time_dim=time_dim), ref)
    if rolling is False:  # TorchRL's vectorised version does not implement it, nor does ours
        with pytest.raises(NotImplementedError):
            rtt.vec_td_lambda_return_estimate(*args, rolling_gamma=False, time_dim=time_dim)
    else:
        close(rtt.vec_td_lambda_return_estimate(*args, rolling_gamma=rolling, time_dim=time_dim), ref)


@pytest.mark.parametrize("layout", LAYOUTS[:5], ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("gkind", ["float", "tensor0d", "full"])
@pytest.mark.parametrize("rolling", [None, True, False])
def test_td1_matches_torchrl_loop(layout, gkind, rolling):
    shape, how, time_dim = layout
    d = _data(shape, seed=hash((shape, gkind, rolling, 1)) % 1000)
    gamma = _coef(gkind, GAMMAS[2], shape, d["g"])
    args = [_layout(x, how) if isinstance(x, torch.Tensor) and x.numel() > 1 else x
            for x in (gamma, d["nv"], d["r"], d["done"], d["term"])]
    if rolling is False and gkind != "full":
        with pytest.raises(RuntimeError, match="time-sensitive"):
            tfn.td1_return_estimate(*args, rolling_gamma=False, time_dim=time_dim)
        with pytest.raises(RuntimeError, match="time-sensitive"):
            rtt.td1_return_estimate(*args, rolling_gamma=False, time_dim=time_dim)
        return
    ref = tfn.td1_return_estimate(*args, rolling_gamma=rolling, time_dim=time_dim)
    close(rtt.td1_return_estimate(*args, rolling_gamma=rolling, time_dim=time_dim), ref)
    if rolling is not False:
        close(rtt.vec_td1_return_estimate(*args, rolling_gamma=rolling, time_dim=time_dim), ref)


def test_rolling_gamma_false_chunked(monkeypatch):
    # the per-start-step path in several chunks gives the same as in one
    d = _data((2, 13, 1), seed=5)
    gamma = torch.rand(2, 13, 1, dtype=F64, generator=d["g"])
    ref = tfn.td_lambda_return_estimate(gamma, 0.75, d["nv"], d["r"], d["done"], d["term"], rolling_gamma=False)
    monkeypatch.setattr(rtt, "_PER_START_BUDGET", 2 * 13 * 3)
    close(rtt.td_lambda_return_estimate(gamma, 0.75, d["nv"], d["r"], d["done"], d["term"], rolling_gamma=False), ref)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("thresh", [(1.0, 1.0), (2.0, 0.5), (0.75, float("inf"))])
@pytest.mark.parametrize("with_term", [True, False])
def test_vtrace_matches_torchrl(layout, thresh, with_term):
    shape, how, time_dim = layout
    d = _data(shape, seed=hash((shape, thresh, with_term)) % 1000)
    term = d["term"] if with_term else None
    args = [_layout(x, how) if isinstance(x, torch.Tensor) else x
            for x in (GAMMAS[1], d["lp"] * 0.3, d["lm"] * 0.3, d["v"], d["nv"], d["r"], d["done"], term)]
    kw = dict(rho_thresh=thresh[0], c_thresh=thresh[1], time_dim=time_dim)
    adv, vs = rtt.vtrace_advantage_estimate(*args, **kw)
    adv_ref, vs_ref = tfn.vtrace_advantage_estimate(*args, **kw)
    close(adv, adv_ref)
    close(vs, vs_ref)
    # TorchRL's class passes 0-d tensor thresholds and gamma
    kw.update(rho_thresh=torch.tensor(thresh[0]), c_thresh=torch.tensor(thresh[1]))
    close(rtt.vtrace_advantage_estimate(torch.tensor(GAMMAS[1]), *args[1:], **kw)[0], adv_ref)


def test_float32_and_mixed_dtypes():
    d = _data((4, 30, 1), seed=7, dtype=torch.float32)
    args = (0.99, 0.95, d["v"], d["nv"], d["r"], d["done"], d["term"])
    adv, vt = rtt.generalized_advantage_estimate(*args)
    ref = tfn.generalized_advantage_estimate(*args)
    assert adv.dtype == torch.float32
    close(adv, ref[0], 1e-5)
    # float64 values with float32 next values: cast to TorchRL's output dtype (next_state_value's)
    adv2, _ = rtt.generalized_advantage_estimate(0.99, 0.95, d["v"].double(), d["nv"], d["r"], d["done"], d["term"])
    assert adv2.dtype == torch.float32
    close(adv2, ref[0], 1e-5)


def test_errors_match_torchrl():
    d = _data((3, 8, 1), seed=1)
    v, nv, r, done, term = d["v"], d["nv"], d["r"], d["done"], d["term"]
    for mod in (tfn, rtt):
        with pytest.raises(TypeError):  # float done: TorchRL applies ~ to it
            mod.generalized_advantage_estimate(0.9, 0.9, v, nv, r, done.double(), term)
        with pytest.raises(RuntimeError, match="unique shape"):
            mod.generalized_advantage_estimate(0.9, 0.9, v, nv, r[:, :-1], done, term)
        with pytest.raises(RuntimeError, match="unique shape"):
            mod.td_lambda_return_estimate(0.9, 0.9, nv, r, done[:, :-1], term[:, :-1])
        with pytest.raises(RuntimeError, match="unique shape"):
            mod.vtrace_advantage_estimate(0.9, r, r, v[:, 1:], nv, r, done, term)
        with pytest.raises(TypeError, match="positional arguments"):
            mod.vec_generalized_advantage_estimate(0.9, 0.9, v, nv, r, done, term, -2)
        with pytest.raises(RuntimeError, match="not compatible"):
            mod.generalized_advantage_estimate(0.9, 0.9, v, nv, r, done, term, time_dim=5)
    # integer flags, which TorchRL takes (and inverts bitwise), raise rl_triton's own TypeError
    with pytest.raises(TypeError, match="terminated must be a torch.bool"):
        rtt.td1_return_estimate(0.9, nv, r, done, term.to(torch.uint8))


def _error_cases():
    """(id, functional, args, kwargs) on which TorchRL 0.14.1's functional raises."""
    d = _data((3, 8, 1), seed=21)
    v, nv, r, done, term = d["v"], d["nv"], d["r"], d["done"], d["term"]
    full = torch.rand(3, 8, 1, dtype=F64, generator=d["g"])
    clean = torch.zeros_like(term)  # no termination: TorchRL's other rolling_gamma=False message
    base = {
        "generalized_advantage_estimate": (0.9, 0.8, v, nv, r, done, term),
        "vec_generalized_advantage_estimate": (0.9, 0.8, v, nv, r, done, term),
        "td_lambda_return_estimate": (0.9, 0.8, nv, r, done, term),
        "vec_td_lambda_return_estimate": (0.9, 0.8, nv, r, done, term),
        "td1_return_estimate": (0.9, nv, r, done, term),
        "vec_td1_return_estimate": (0.9, nv, r, done, term),
        "vtrace_advantage_estimate": (0.9, d["lp"], d["lm"], v, nv, r, done, term),
    }
    cases = []
    for name, args in base.items():
        i_done = len(args) - 2

        def swap(i, x, args=args):
            return args[:i] + (x,) + args[i + 1:]

        if name not in ("vec_generalized_advantage_estimate", "td_lambda_return_estimate"):
            # those two never apply ~ to done, so TorchRL takes a float done there (rl_triton does not)
            cases.append((f"{name}-float_done", name, swap(i_done, done.double()), {}))
        cases += [
            (f"{name}-float_terminated", name, swap(i_done + 1, term.double()), {}),
            (f"{name}-done_none", name, args[:i_done] + (None,), {}),
            (f"{name}-short_reward", name, swap(i_done - 1, r[:, :-1]), {}),
            (f"{name}-time_dim", name, args, {"time_dim": 5}),
            (f"{name}-gamma_shape", name, swap(0, torch.rand(5, dtype=F64)), {}),
        ]
    for name in ("vec_td_lambda_return_estimate", "vec_td1_return_estimate"):
        args = base[name]
        cases += [
            (f"{name}-rolling_false", name, (full,) + args[1:], {"rolling_gamma": False}),
            (f"{name}-rolling_false_no_term", name, (full,) + args[1:-1] + (clean,), {"rolling_gamma": False}),
        ]
    cases += [
        ("vec_td_lambda_return_estimate-rolling_false_lmbda", "vec_td_lambda_return_estimate",
         (0.9, full) + base["td_lambda_return_estimate"][2:], {"rolling_gamma": False}),
        ("td_lambda_return_estimate-rolling_false_scalar", "td_lambda_return_estimate",
         base["td_lambda_return_estimate"], {"rolling_gamma": False}),
        ("td1_return_estimate-rolling_false_scalar", "td1_return_estimate", base["td1_return_estimate"],
         {"rolling_gamma": False}),
        ("vec_generalized_advantage_estimate-positional_time_dim", "vec_generalized_advantage_estimate",
         base["vec_generalized_advantage_estimate"] + (-2,), {}),
    ]
    return cases


def _error_of(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[0])
def test_error_paths_match_torchrl_word_for_word(case):
    _, name, args, kwargs = case
    assert _error_of(getattr(rtt, name), *args, **kwargs) == _error_of(getattr(tfn, name), *args, **kwargs)


# the paths on which TorchRL applies ~ to a float done (GAE's vectorised path and TD(lambda)'s
# loop do not, and compute with it)
@pytest.mark.parametrize("cls_name,vectorized", [("GAE", False), ("TDLambdaEstimator", True),
                                                 ("TD1Estimator", None), ("VTrace", None)])
def test_class_error_paths_match_torchrl(cls_name, vectorized):
    kwargs = dict(gamma=0.99, value_network=_critic())
    if vectorized is not None:
        kwargs.update(lmbda=0.95, vectorized=vectorized)
    if cls_name == "VTrace":
        kwargs["actor_network"] = _actor()
    ours, theirs = getattr(rtt, cls_name)(**kwargs), getattr(tadv, cls_name)(**kwargs)
    td = _td()
    if cls_name == "VTrace":
        td = _with_behaviour_log_prob(td, theirs, kwargs["actor_network"], noise=0.0)
    td["next", "done"] = td["next", "done"].float()
    assert _error_of(ours, td.clone()) == _error_of(theirs, td.clone())


@pytest.mark.parametrize("name", ["vec_td_lambda_return_estimate", "vec_td1_return_estimate"])
@pytest.mark.parametrize("gkind", ["float", "tensor0d", "tensor1"])
def test_vec_td_rolling_gamma_false_with_scalar_discounts(name, gkind):
    # TorchRL's vectorised TD functions take scalar discounts on their rolling path whatever
    # rolling_gamma says, and return the rolling result
    d = _data((3, 10, 1), seed=17)
    gamma = _coef(gkind, GAMMAS[2], None, d["g"])
    lmbda = () if "td1" in name else (_coef(gkind, 0.5, None, d["g"]),)
    args = (gamma, *lmbda, d["nv"], d["r"], d["done"], d["term"])
    ref = getattr(tfn, name.removeprefix("vec_"))(*args)
    close(getattr(rtt, name)(*args, rolling_gamma=False), ref)
    close(getattr(tfn, name)(*args, rolling_gamma=False), ref, 1e-6)


@pytest.mark.parametrize("which", ["gae", "td_lambda", "td1_rolling_false", "vtrace"])
def test_gradients_match_torchrl(which):
    d = _data((2, 9, 1), seed=11)
    leaves = {k: d[k].clone().requires_grad_(True) for k in ("v", "nv", "r", "lp")}
    gamma = torch.rand(2, 9, 1, dtype=F64, generator=d["g"]).requires_grad_(True)

    def run(mod):
        if which == "gae":
            a, vt = mod.generalized_advantage_estimate(gamma, 0.75, leaves["v"], leaves["nv"], leaves["r"],
                                                       d["done"], d["term"])
            return (a * torch.arange(9.0, dtype=F64)[:, None]).sum() + vt.square().sum()
        if which == "td_lambda":
            return mod.td_lambda_return_estimate(gamma, 0.75, leaves["nv"], leaves["r"], d["done"],
                                                 d["term"]).square().sum()
        if which == "td1_rolling_false":
            return mod.td1_return_estimate(gamma, leaves["nv"], leaves["r"], d["done"], d["term"],
                                           rolling_gamma=False).square().sum()
        a, vs = mod.vtrace_advantage_estimate(GAMMAS[1], leaves["lp"], d["lm"], leaves["v"], leaves["nv"],
                                              leaves["r"], d["done"], d["term"], rho_thresh=1.5, c_thresh=0.875)
        return a.square().sum() + vs.sum()

    tensors = [*leaves.values(), gamma]
    ref = torch.autograd.grad(run(tfn), tensors, allow_unused=True)
    ours = torch.autograd.grad(run(rtt), tensors, allow_unused=True)
    for a, b in zip(ours, ref):
        if b is None:
            assert a is None or not a.any()
        else:
            close(a, b)


def test_torch_compile_fullgraph(monkeypatch):
    # rl_triton's CPU value checks read the data (a graph break); they are off in compiled code
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "0")
    d = _data((4, 16, 1), seed=2, dtype=torch.float32)

    def step(v, nv, r, done, term):
        adv, vt = rtt.generalized_advantage_estimate(0.99, 0.95, v, nv, r, done, term)
        return (adv - adv.mean()) / adv.std(), vt

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    args = (d["v"], d["nv"], d["r"], d["done"], d["term"])
    for x, y in zip(compiled(*args), step(*args)):
        close(x, y, 1e-6)


# ---------------------------------------------------------------------------------------------
# estimator classes on TensorDicts
# ---------------------------------------------------------------------------------------------

OBS = 3


def _td(B=4, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    term = torch.rand(B, T, 1, generator=g) < 0.1
    done = (torch.rand(B, T, 1, generator=g) < 0.1) | term
    return TensorDict(
        {
            "observation": torch.randn(B, T, OBS, generator=g),
            "action": torch.randn(B, T, 1, generator=g),
            "next": {
                "observation": torch.randn(B, T, OBS, generator=g),
                "reward": torch.randn(B, T, 1, generator=g),
                "done": done,
                "terminated": term,
            },
        },
        [B, T],
    )


def _critic(seed=0):
    torch.manual_seed(seed)
    return TensorDictModule(nn.Linear(OBS, 1), in_keys=["observation"], out_keys=["state_value"])


def _actor(seed=1):
    torch.manual_seed(seed)
    net = TensorDictModule(nn.Sequential(nn.Linear(OBS, 2), NormalParamExtractor()),
                           in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(net, in_keys=["loc", "scale"], distribution_class=torch.distributions.Normal,
                              return_log_prob=True)


def _with_behaviour_log_prob(td, est, actor, noise=0.2):
    """``td`` with the estimator's sample-log-prob entry: the actor's log-prob of the taken
    action, plus ``noise`` (an off-policy behaviour policy)."""
    key = est.tensor_keys.sample_log_prob
    with torch.no_grad():
        lp = actor(td.clone())[key]
    td[key] = lp + noise * torch.randn_like(lp)
    return td


def _assert_globals_original():
    for name, fn in rtt._ORIGINAL.items():
        assert getattr(tadv, name) is fn


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(vectorized=True),
    dict(average_gae=True),
    dict(shifted=True),
    dict(time_dim=1, vectorized=True),
], ids=str)
def test_gae_class_matches_torchrl(kwargs):
    critic = _critic()
    td = _td()
    ours = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=critic, **kwargs)(td.clone())
    ref = tadv.GAE(gamma=0.99, lmbda=0.95, value_network=critic, vectorized=False,
                   **{k: v for k, v in kwargs.items() if k != "vectorized"})(td.clone())
    for key in ("advantage", "value_target", "state_value", ("next", "state_value")):
        close(ours[key], ref[key], 1e-5)
    _assert_globals_original()
    # value_estimate (returns the value target only; TorchRL's always runs its vec approximation)
    kw = {k: v for k, v in kwargs.items() if k not in ("vectorized", "average_gae")}
    vt = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=critic, **kw).value_estimate(td.clone())
    close(vt, tadv.GAE(gamma=0.99, lmbda=0.95, value_network=critic, **kw).value_estimate(td.clone()), 1e-5)


def test_gae_class_takes_the_fast_path():
    # gamma*lmbda == 0 makes TorchRL's vectorised GAE raise IndexError; ours routes around it
    td = _td()
    with pytest.raises(IndexError):
        tadv.GAE(gamma=0.99, lmbda=0.0, value_network=_critic(), vectorized=True)(td.clone())
    out = rtt.GAE(gamma=0.99, lmbda=0.0, value_network=_critic(), vectorized=True)(td.clone())
    ref = tadv.GAE(gamma=0.99, lmbda=0.0, value_network=_critic(), vectorized=False)(td.clone())
    close(out["advantage"], ref["advantage"], 1e-6)
    _assert_globals_original()


def test_gae_class_differentiable_gradient_reaches_reward():
    critic = _critic()
    td = _td()
    td["next", "reward"].requires_grad_(True)
    out = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=critic, differentiable=True)(td)
    out["advantage"].sum().backward()
    grad = td["next", "reward"].grad
    assert grad is not None and grad.abs().sum() > 0
    assert all(p.grad is None for p in critic.parameters())
    # differentiable=False: the advantage is a leaf
    td2 = _td()
    td2["next", "reward"].requires_grad_(True)
    out2 = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td2)
    assert not out2["advantage"].requires_grad


def test_gae_class_keys_skip_existing_and_no_value_network():
    td = _td()
    tadv.GAE(gamma=0.99, lmbda=0.95, value_network=_critic())(td)  # writes the values
    td = td.exclude("advantage", "value_target")
    est = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=None)
    est.set_keys(advantage="adv2", value_target="vt2")
    out = est(td.clone())
    ref = tadv.GAE(gamma=0.99, lmbda=0.95, value_network=None)
    ref.set_keys(advantage="adv2", value_target="vt2")
    close(out["adv2"], ref(td.clone())["adv2"], 1e-5)
    td["adv2"] = torch.zeros_like(td["next", "reward"])
    td["vt2"] = torch.zeros_like(td["next", "reward"])
    results = []
    for cls in (rtt.GAE, tadv.GAE):  # same skip_existing behaviour as TorchRL's
        est = cls(gamma=0.99, lmbda=0.95, value_network=None, skip_existing=True)
        est.set_keys(advantage="adv2", value_target="vt2")
        results.append(est(td.clone())["adv2"])
    close(*results, tol=1e-5)


@pytest.mark.parametrize("cls_name,kwargs", [
    ("TDLambdaEstimator", dict(gamma=0.99, lmbda=0.95)),
    ("TDLambdaEstimator", dict(gamma=0.99, lmbda=0.95, vectorized=False, average_rewards=True)),
    ("TDLambdaEstimator", dict(gamma=0.99, lmbda=0.95, shifted=True)),
    ("TD1Estimator", dict(gamma=0.99)),
    ("TD1Estimator", dict(gamma=0.99, time_dim=1)),
], ids=str)
def test_td_classes_match_torchrl(cls_name, kwargs):
    critic = _critic()
    td = _td(seed=4)
    ours = getattr(rtt, cls_name)(value_network=critic, **kwargs)(td.clone())
    ref_kwargs = dict(kwargs, vectorized=False) if cls_name == "TDLambdaEstimator" else kwargs
    ref = getattr(tadv, cls_name)(value_network=critic, **ref_kwargs)(td.clone())
    for key in ("advantage", "value_target"):
        close(ours[key], ref[key], 2e-5)
    _assert_globals_original()


def test_td_lambda_class_differentiable():
    td = _td()
    td["next", "reward"].requires_grad_(True)
    out = rtt.TDLambdaEstimator(gamma=0.99, lmbda=0.95, value_network=_critic(), differentiable=True)(td)
    out["value_target"].sum().backward()
    assert td["next", "reward"].grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs", [dict(), dict(rho_thresh=1.5, c_thresh=0.8), dict(average_adv=True)], ids=str)
def test_vtrace_class_matches_torchrl(kwargs):
    critic, actor = _critic(), _actor()
    td = _td(seed=6)
    est = rtt.VTrace(gamma=0.99, value_network=critic, actor_network=actor, **kwargs)
    td = _with_behaviour_log_prob(td, est, actor)
    ours = est(td.clone())
    ref = tadv.VTrace(gamma=0.99, value_network=critic, actor_network=actor, **kwargs)(td.clone())
    for key in ("advantage", "value_target"):
        close(ours[key], ref[key], 2e-5)
    _assert_globals_original()


# ---------------------------------------------------------------------------------------------
# patch / unpatch, registry, a PPO step
# ---------------------------------------------------------------------------------------------

def _registry_snapshot():
    """Every built-in estimator's registry entry, read through TorchRL's public lookup, as
    (class, default kwargs)."""
    entries = {key: obj_utils.get_value_estimator_entry(key) for key in ValueEstimators}
    return {key: (entry.cls, entry.default_kwargs) for key, entry in entries.items()}


def test_patch_unpatch_round_trip():
    before_globals = {name: getattr(tadv, name) for name in rtt._OURS}
    before_registry = _registry_snapshot()
    functional_before = {name: getattr(tfn, name) for name in NAMES}
    assert not rtt.is_patched()
    rtt.patch()
    rtt.patch()  # idempotent
    assert rtt.is_patched()
    for name in rtt._OURS:
        assert getattr(tadv, name) is getattr(rtt, name)
    reg = _registry_snapshot()
    assert reg[ValueEstimators.GAE][0] is rtt.GAE
    assert reg[ValueEstimators.TDLambda][0] is rtt.TDLambdaEstimator
    assert reg[ValueEstimators.TD1][0] is rtt.TD1Estimator
    assert reg[ValueEstimators.VTrace][0] is rtt.VTrace
    assert all(reg[k][1] == before_registry[k][1] for k in reg)  # TorchRL's default kwargs kept
    assert {name: getattr(tfn, name) for name in NAMES} == functional_before  # functional untouched
    rtt.unpatch()
    rtt.unpatch()
    assert not rtt.is_patched()
    for name, fn in before_globals.items():
        assert getattr(tadv, name) is fn
    assert _registry_snapshot() == before_registry  # TorchRL's classes and default kwargs
    with rtt.patched():
        assert rtt.is_patched()
        with rtt.patched():
            pass
        assert rtt.is_patched()
    assert not rtt.is_patched()
    _assert_globals_original()


def test_patch_reaches_plain_torchrl_classes():
    td = _td()
    ref = tadv.GAE(gamma=0.99, lmbda=0.95, value_network=_critic(), vectorized=False)(td.clone())
    with rtt.patched():
        # a plain TorchRL GAE (vectorized, lmbda=0 would raise IndexError unpatched) now runs ours
        out = tadv.GAE(gamma=0.99, lmbda=0.95, value_network=_critic(), vectorized=True)(td.clone())
        close(out["advantage"], ref["advantage"], 1e-5)
        tadv.GAE(gamma=0.99, lmbda=0.0, value_network=_critic(), vectorized=True)(td.clone())
        # routed calls inside a patch leave it patched
        rtt.GAE(gamma=0.99, lmbda=0.95, value_network=_critic())(td.clone())
        assert tadv.vec_generalized_advantage_estimate is rtt.vec_generalized_advantage_estimate
    _assert_globals_original()


def test_compiled_class_runs_ours(monkeypatch):
    # a compiled drop-in class calls our functionals too, patched or not, and leaves TorchRL alone
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "0")
    calls = []
    inner = rtt._rt_gae
    monkeypatch.setattr(rtt, "_rt_gae", lambda *a, **k: calls.append(1) or inner(*a, **k))
    critic, td = _critic(), _td()
    est = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=critic)
    compiled = torch.compile(lambda data: est(data)["advantage"], backend="eager")
    ref = tadv.GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td.clone())["advantage"]
    close(compiled(td.clone()), ref, 1e-5)
    assert calls
    _assert_globals_original()


def _recording_critic(seen):
    """A critic that records TorchRL's module globals while an estimator calls it."""

    class Recording(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(OBS, 1)

        def forward(self, obs):
            seen.append({name: getattr(tadv, name) for name in rtt._ORIGINAL})
            return self.lin(obs)

    torch.manual_seed(0)
    return TensorDictModule(Recording(), in_keys=["observation"], out_keys=["state_value"])


@pytest.mark.parametrize("cls_name", ["GAE", "TDLambdaEstimator", "TD1Estimator", "VTrace"])
def test_classes_leave_torchrl_globals_alone(cls_name, monkeypatch):
    # the drop-in classes call our functionals without touching TorchRL's module, during the call too
    seen, calls = [], []
    for name in ("_rt_gae", "_rt_td_lambda_return", "_rt_vtrace"):
        inner = getattr(rtt, name)
        monkeypatch.setattr(rtt, name, lambda *a, _inner=inner, **k: calls.append(1) or _inner(*a, **k))
    critic = _recording_critic(seen)
    kwargs = dict(gamma=0.99, value_network=critic)
    if cls_name in ("GAE", "TDLambdaEstimator"):
        kwargs["lmbda"] = 0.95
    if cls_name == "VTrace":
        kwargs["actor_network"] = _actor()
    est = getattr(rtt, cls_name)(**kwargs)
    td = _td()
    if cls_name == "VTrace":
        td = _with_behaviour_log_prob(td, est, kwargs["actor_network"], noise=0.0)
    est(td)
    assert calls and seen
    assert all(globals_seen == rtt._ORIGINAL for globals_seen in seen)
    _assert_globals_original()


def test_classes_do_not_change_plain_torchrl_in_other_threads():
    # plain TorchRL, in another thread, with uint8 flags (which TorchRL accepts and rl_triton rejects)
    critic = _critic()
    td = _td()
    td8 = td.clone()
    for key in (("next", "done"), ("next", "terminated")):
        td8[key] = td8[key].to(torch.uint8)
    ref = tadv.GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td8.clone())["advantage"]
    stop = threading.Event()

    def ours():
        est = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=critic)
        while not stop.is_set():
            est(td.clone())

    thread = threading.Thread(target=ours)
    thread.start()
    try:
        for _ in range(50):
            out = tadv.GAE(gamma=0.99, lmbda=0.95, value_network=critic)(td8.clone())["advantage"]
            assert torch.equal(out, ref)
    finally:
        stop.set()
        thread.join()


def _routes_ours():
    return (rtt.is_patched() and tadv.vec_generalized_advantage_estimate is rtt.vec_generalized_advantage_estimate
            and obj_utils.get_value_estimator_entry(ValueEstimators.GAE).cls is rtt.GAE)


def test_patched_blocks_nest_across_threads():
    # A opens a block, B opens one, A closes its own: B's block stays patched until B closes it
    assert nested_blocks_across_threads(rtt.patched, _routes_ours) == [True]
    assert not rtt.is_patched()
    _assert_globals_original()


def test_patch_and_unpatch_inside_patched_blocks():
    # unpatch() withdraws patch() only: an open block keeps the patch until it closes
    with rtt.patched():
        rtt.patch()
        rtt.unpatch()
        assert _routes_ours()
    assert not rtt.is_patched()
    _assert_globals_original()
    # patch() made inside a block outlives it, until unpatch()
    with rtt.patched():
        rtt.patch()
    assert _routes_ours()
    rtt.unpatch()
    assert not rtt.is_patched()
    _assert_globals_original()


def test_patch_state_under_concurrent_use():
    registry_before = _registry_snapshot()
    assert not concurrent_patch_use(rtt.patched, rtt.patch, rtt.unpatch, _routes_ours, rounds=50)
    assert not rtt.is_patched()
    _assert_globals_original()
    assert _registry_snapshot() == registry_before


def _ppo_loss():
    critic = ValueOperator(nn.Linear(OBS, 1), in_keys=["observation"])
    return ClipPPOLoss(_actor(), critic)


def test_clip_ppo_loss_step_with_patched_registry():
    torch.manual_seed(0)
    td = _td(B=4, T=16, seed=9)
    loss_ref = _ppo_loss()
    with torch.no_grad():
        td[loss_ref.tensor_keys.sample_log_prob] = loss_ref.actor_network(td.clone())[
            loss_ref.tensor_keys.sample_log_prob]
    torch.manual_seed(0)
    loss_ref = _ppo_loss()
    loss_ref.make_value_estimator(ValueEstimators.GAE, gamma=0.99, lmbda=0.95)
    assert type(loss_ref.value_estimator) is tadv.GAE
    ref = loss_ref.value_estimator(td.clone())

    with rtt.patched():
        torch.manual_seed(0)
        loss = _ppo_loss()
        assert type(loss.value_estimator) is rtt.GAE  # the lazily built default
        loss.make_value_estimator(ValueEstimators.GAE, gamma=0.99, lmbda=0.95)
        assert type(loss.value_estimator) is rtt.GAE
        data = loss.value_estimator(td.clone())
        close(data["advantage"], ref["advantage"], 1e-5)
        out = loss(td.clone())
        total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
        total.backward()
        grads = [p.grad for p in loss.parameters() if p.requires_grad]
        assert any(g is not None and g.abs().sum() > 0 for g in grads)
        loss.make_value_estimator("tdlambda")
        assert type(loss.value_estimator) is rtt.TDLambdaEstimator
    assert type(_ppo_loss().value_estimator) is tadv.GAE


def test_threshold_tensors_are_read_at_every_call():
    # TorchRL accepts thresholds made under inference mode, and changed in place through .data
    # (which moves no version counter); nothing may be remembered on the caller's tensors
    d = _data((3, 9, 1), seed=13)
    args = (GAMMAS[1], d["lp"] * 0.3, d["lm"] * 0.3, d["v"], d["nv"], d["r"], d["done"], d["term"])
    with torch.inference_mode():
        rho = torch.tensor(1.5)
    c = torch.tensor(0.75)
    for value in (None, 0.1, 2.0):
        if value is not None:
            c.data.fill_(value)
        ours = rtt.vtrace_advantage_estimate(*args, rho_thresh=rho, c_thresh=c)
        ref = tfn.vtrace_advantage_estimate(*args, rho_thresh=rho, c_thresh=c)
        close(ours[0], ref[0])
        close(ours[1], ref[1])
    assert not vars(rho) and not vars(c)


def test_vtrace_class_sees_thresholds_changed_in_place():
    critic, actor = _critic(), _actor()
    td = _td(seed=6)
    est = rtt.VTrace(gamma=0.99, value_network=critic, actor_network=actor, rho_thresh=1.5, c_thresh=0.8)
    td = _with_behaviour_log_prob(td, est, actor)
    est(td.clone())
    est.rho_thresh.data.fill_(0.25)
    est.c_thresh.data.fill_(0.5)
    ref = tadv.VTrace(gamma=0.99, value_network=critic, actor_network=actor, rho_thresh=0.25, c_thresh=0.5)
    close(est(td.clone())["advantage"], ref(td.clone())["advantage"], 2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_threshold_tensors_under_cuda_graph_capture():
    # a capture cannot read device memory: it takes the value of the last read outside it
    d = _data((3, 9, 1), seed=13, dtype=torch.float32)
    args = [x.cuda() if isinstance(x, torch.Tensor) else x
            for x in (GAMMAS[1], d["lp"] * 0.3, d["lm"] * 0.3, d["v"], d["nv"], d["r"], d["done"], d["term"])]
    rho, c = torch.tensor(1.5, device="cuda"), torch.tensor(0.75, device="cuda")
    ref = rtt.vtrace_advantage_estimate(*args, rho_thresh=rho, c_thresh=c)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rtt.vtrace_advantage_estimate(*args, rho_thresh=rho, c_thresh=c)
    graph.replay()
    close(out[0], ref[0], 1e-5)
    close(out[1], ref[1], 1e-5)
    never_read = torch.tensor(2.0, device="cuda")
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            rtt.vtrace_advantage_estimate(*args, rho_thresh=never_read, c_thresh=c)


def _graphed_estimator_run(cls, device):
    """The estimator inside tensordict's CudaGraphModule (eager without CUDA) against plain calls.

    The state values are computed beforehand (``value_network=None``): TorchRL 0.14.1's
    value-network path reads the data on the host (its NaN check of the next observations),
    which no CUDA-graph capture allows."""
    from tensordict.nn import CudaGraphModule

    critic, actor = _critic().to(device), _actor().to(device)
    if cls == "GAE":
        est = rtt.GAE(gamma=0.99, lmbda=0.95, value_network=None)
    else:
        est = rtt.VTrace(gamma=0.99, value_network=None, actor_network=actor, rho_thresh=1.5,
                         c_thresh=0.75).to(device)

    def batch(seed):
        td = _td(seed=seed).to(device)
        with torch.no_grad():
            critic(td)
            critic(td["next"])
        return _with_behaviour_log_prob(td, est, actor) if cls == "VTrace" else td

    def run(td):
        with torch.no_grad():
            return est(td)["advantage"]

    graphed = CudaGraphModule(run, warmup=2, device=torch.device(device) if device != "cpu" else None)
    for seed in range(5):  # warm-up calls, the capture, then replays on new data
        td = batch(seed)
        close(graphed(td.clone()), run(td.clone()), 1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CudaGraphModule runs eagerly only without CUDA")
@pytest.mark.parametrize("cls", ["GAE", "VTrace"])
def test_estimators_in_cudagraphmodule_on_cpu(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CudaGraphModule warns that it runs eagerly without CUDA
        _graphed_estimator_run(cls, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("cls", ["GAE", "VTrace"])
def test_estimators_under_cudagraphmodule(cls):
    _graphed_estimator_run(cls, "cuda")
