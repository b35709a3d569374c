"""TorchRL: exact, fused drop-ins for the value functionals and estimator classes of
``torchrl.objectives.value`` (written against TorchRL 0.14.1).

    import rl_triton.integrations.torchrl as rt_torchrl
    rt_torchrl.patch()        # every GAE / TDLambdaEstimator / TD1Estimator / VTrace (and
                              # MultiAgentGAE), built anywhere, before or after, and every loss's
                              # make_value_estimator(ValueEstimators.GAE, ...) now use rl_triton
    loss = ClipPPOLoss(actor, critic)          # loss.value_estimator runs the fused GAE
    rt_torchrl.unpatch()      # TorchRL's own function objects and registry entries again

or, without patching anything, the classes (same constructor arguments as TorchRL's)::

    adv = rt_torchrl.GAE(gamma=0.99, lmbda=0.95, value_network=critic)
    data = adv(data)                           # writes "advantage" and "value_target"
    loss.make_value_estimator(rt_torchrl.GAE(gamma=0.99, lmbda=0.95, value_network=critic))

or the functionals, with TorchRL's signatures, shapes and return conventions::

    adv, value_target = rt_torchrl.generalized_advantage_estimate(
        gamma, lmbda, state_value, next_state_value, reward, done, terminated, time_dim=-2)

Conventions mapped here (docs/semantics.md, section 11): TorchRL's flags are already
transition-aligned, ``done`` cuts the trace and ``terminated`` (default: ``done``) removes the
bootstrap, so they pass straight through as ``done=``/``terminated=``, with
``next_values=next_state_value`` explicit. The time dim is moved exactly as TorchRL moves it
(its own ``_transpose_time`` decorator wraps every functional here), so shapes, ``time_dim``
rules and layout errors are TorchRL's. Float inputs are cast to ``next_state_value.dtype``
(TorchRL's output dtype) because rl_triton wants one dtype per call. ``done``/``terminated``
must be ``torch.bool`` (TorchRL applies ``~`` to them; other dtypes raise ``TypeError`` here).

Results are exact recurrences, also for the ``vec_*`` names, where TorchRL truncates a
convolution filter at ``(gamma*lmbda)**n < 1e-7``; see docs/torchrl.md for what differs.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torchrl.objectives import utils as _obj_utils
from torchrl.objectives.value import advantages as _adv
from torchrl.objectives.value import functional as _fn

from .. import td_lambda_return as _rt_td_lambda_return
from .. import gae as _rt_gae
from .. import vtrace as _rt_vtrace

__all__ = [
    "GAE",
    "TD1Estimator",
    "TDLambdaEstimator",
    "VTrace",
    "generalized_advantage_estimate",
    "is_patched",
    "patch",
    "patched",
    "td1_return_estimate",
    "td_lambda_return_estimate",
    "unpatch",
    "vec_generalized_advantage_estimate",
    "vec_td1_return_estimate",
    "vec_td_lambda_return_estimate",
    "vtrace_advantage_estimate",
]

SHAPE_ERR = _fn.SHAPE_ERR
_transpose_time = _fn._transpose_time  # TorchRL's own time-dim handling: identical layout rules

# at most this many elements per batched call of the rolling_gamma=False path
_PER_START_BUDGET = 1 << 24


# ---------------------------------------------------------------------------------------------
# argument mapping
# ---------------------------------------------------------------------------------------------

def _check_flag(x, name):
    if x is not None and x.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a torch.bool tensor, as in TorchRL (which applies ~ to it), got {x.dtype}"
        )


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def _coef(x, like):
    """gamma / lmbda: Python numbers pass through; tensors go to the data's device."""
    if isinstance(x, torch.Tensor) and x.device != like.device:
        return x.to(like.device)
    return x


def _threshold(x):
    """rho_thresh / c_thresh: rl_triton takes Python numbers (TorchRL's buffers are 0-d tensors).

    A buffer's value is read once and remembered on the tensor until it is modified in place
    (its version counter moves): reading a CUDA tensor synchronises, which costs a round trip
    per call and would break CUDA-graph capture (CudaGraphModule warms up eagerly first)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise NotImplementedError("rl_triton's vtrace takes scalar clipping thresholds only")
        if torch.compiler.is_compiling():
            return float(x)
        cached = getattr(x, "_rl_triton_scalar", None)
        if cached is not None and cached[0] == x._version:
            return cached[1]
        value = float(x)
        x._rl_triton_scalar = (x._version, value)
        return value
    return x


def _full(x, shape):
    return isinstance(x, torch.Tensor) and x.shape == shape


def _per_start(fn, gamma, lmbda, next_state_value, reward, done, terminated):
    """TorchRL's ``rolling_gamma=False``: the return from start step k uses gamma[k] and lmbda[k]
    for every later step of the window. A backward recurrence's value at k depends only on the
    steps k..T-1, so output k is output k of one call whose gamma/lmbda are held at step k's:
    one batched call over the start steps (chunked), then the diagonal. Time sits at -2."""
    T = reward.shape[-2]
    gamma = torch.as_tensor(gamma, dtype=reward.dtype, device=reward.device).expand_as(reward)
    lmbda = torch.as_tensor(lmbda, dtype=reward.dtype, device=reward.device).expand_as(reward)
    chunk = max(1, _PER_START_BUDGET // max(1, reward.numel()))
    outs = []
    for k0 in range(0, T, chunk):
        k1 = min(T, k0 + chunk)
        K = k1 - k0

        def suffix(x):
            x = x[..., k0:, :]
            return x.unsqueeze(0).expand(K, *x.shape)

        g = gamma[..., k0:k1, :].movedim(-2, 0).unsqueeze(-2)  # [K, *B, 1, F]
        l = lmbda[..., k0:k1, :].movedim(-2, 0).unsqueeze(-2)
        res = fn(suffix(reward), suffix(next_state_value), suffix(done), suffix(terminated), g, l)
        idx = torch.arange(K, device=reward.device)
        outs.append(res.movedim(-2, 1)[idx, idx].movedim(0, -2))  # [*B, K, F]
    if not outs:
        return torch.empty_like(reward)
    return torch.cat(outs, dim=-2)


def _td_lambda(reward, next_state_value, done, terminated, gamma, lmbda):
    return _rt_td_lambda_return(reward, next_state_value, done=done, terminated=terminated,
                                gamma=gamma, lmbda=lmbda, time_dim=-2)


def _td1_no_window_bootstrap(reward, next_state_value, done, terminated, gamma, lmbda):
    # TorchRL's td1 rolling_gamma=False loop starts from g = 0: the window end bootstraps only
    # where the last step is a truncation (done and not terminated)
    last = next_state_value[..., -1:, :]
    last = torch.where(done[..., -1:, :], last, torch.zeros_like(last))
    nv = torch.cat([next_state_value[..., :-1, :], last], dim=-2)
    return _td_lambda(reward, nv, done, terminated, gamma, 1.0)


def _gae_impl(gamma, lmbda, state_value, next_state_value, reward, done, terminated):
    if terminated is None:
        terminated = done
    if not (next_state_value.shape == state_value.shape == reward.shape == done.shape == terminated.shape):
        raise RuntimeError(SHAPE_ERR)
    _check_flag(done, "done")
    _check_flag(terminated, "terminated")
    dtype = next_state_value.dtype
    return _rt_gae(_cast(reward, dtype), _cast(state_value, dtype), next_values=next_state_value,
                   done=done, terminated=terminated, gamma=_coef(gamma, reward), lmbda=_coef(lmbda, reward),
                   time_dim=-2)


def _td_lambda_impl(gamma, lmbda, next_state_value, reward, done, terminated, rolling_gamma, *, td1, vec):
    if terminated is None:
        terminated = done
    if not (next_state_value.shape == reward.shape == done.shape == terminated.shape):
        raise RuntimeError(SHAPE_ERR)
    _check_flag(done, "done")
    _check_flag(terminated, "terminated")
    dtype = next_state_value.dtype
    reward = _cast(reward, dtype)
    gamma, lmbda = _coef(gamma, reward), _coef(lmbda, reward)
    if rolling_gamma is None:
        rolling_gamma = True
    elif not rolling_gamma:
        if vec:  # TorchRL's vectorised functions do not implement it; neither do these drop-ins
            raise NotImplementedError(
                "rolling_gamma=False is not available in the vectorised TD functions (as in TorchRL); "
                "use td_lambda_return_estimate / td1_return_estimate, which implement it exactly"
            )
        if td1 and not _full(gamma, done.shape):
            raise RuntimeError("rolling_gamma=False is expected only with time-sensitive gamma values")
        if not td1 and not _full(gamma, done.shape) and not _full(lmbda, done.shape):
            raise RuntimeError(
                "rolling_gamma=False is expected only with time-sensitive gamma or lambda values"
            )
    if rolling_gamma:
        return _td_lambda(reward, next_state_value, done, terminated, gamma, lmbda)
    fn = _td1_no_window_bootstrap if td1 else _td_lambda
    return _per_start(fn, gamma, lmbda, next_state_value, reward, done, terminated)


# ---------------------------------------------------------------------------------------------
# functionals: TorchRL 0.14.1 signatures
# ---------------------------------------------------------------------------------------------

@_transpose_time
def generalized_advantage_estimate(
    gamma, lmbda, state_value, next_state_value, reward, done, terminated=None, *, time_dim=-2
):
    """Drop-in for ``torchrl.objectives.value.functional.generalized_advantage_estimate``:
    returns ``(advantage, value_target)``, one fused scan."""
    return _gae_impl(gamma, lmbda, state_value, next_state_value, reward, done, terminated)


@_transpose_time
def vec_generalized_advantage_estimate(
    gamma, lmbda, state_value, next_state_value, reward, done, terminated=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``vec_generalized_advantage_estimate``; exact (no filter truncation),
    no host synchronisation, and ``gamma*lmbda == 0`` works."""
    return _gae_impl(gamma, lmbda, state_value, next_state_value, reward, done, terminated)


@_transpose_time
def td_lambda_return_estimate(
    gamma, lmbda, next_state_value, reward, done, terminated=None, rolling_gamma=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``td_lambda_return_estimate``, ``rolling_gamma=False`` included."""
    return _td_lambda_impl(gamma, lmbda, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=False, vec=False)


@_transpose_time
def vec_td_lambda_return_estimate(
    gamma, lmbda, next_state_value, reward, done, terminated=None, rolling_gamma=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``vec_td_lambda_return_estimate`` (exact; ``rolling_gamma=False``
    raises ``NotImplementedError`` as TorchRL's does: use ``td_lambda_return_estimate``)."""
    return _td_lambda_impl(gamma, lmbda, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=False, vec=True)


@_transpose_time
def td1_return_estimate(
    gamma, next_state_value, reward, done, terminated=None, rolling_gamma=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``td1_return_estimate``, ``rolling_gamma=False`` included."""
    return _td_lambda_impl(gamma, 1.0, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=True, vec=False)


@_transpose_time
def vec_td1_return_estimate(
    gamma, next_state_value, reward, done, terminated=None, rolling_gamma=None, time_dim=-2
):
    """Drop-in for TorchRL's ``vec_td1_return_estimate`` (``time_dim`` is positional-or-keyword
    there too)."""
    return _td_lambda_impl(gamma, 1.0, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=True, vec=True)


@_transpose_time
def vtrace_advantage_estimate(
    gamma, log_pi, log_mu, state_value, next_state_value, reward, done, terminated=None,
    rho_thresh=1.0, c_thresh=1.0, time_dim=-2,
):
    """Drop-in for TorchRL 0.14.1's ``vtrace_advantage_estimate``: returns ``(advantage, vs)``.

    As in 0.14.1: ``c = min(ratio, c_thresh)`` (no lambda), the policy-gradient rho is clipped at
    ``rho_thresh``, and ``vs_next`` is the true next value wherever ``done``."""
    if not (next_state_value.shape == state_value.shape == reward.shape == done.shape):
        raise RuntimeError(SHAPE_ERR)
    _check_flag(done, "done")
    _check_flag(terminated, "terminated")
    dtype = next_state_value.dtype
    vs, adv = _rt_vtrace(
        _cast(reward, dtype), _cast(state_value, dtype), _cast(log_pi, dtype), _cast(log_mu, dtype),
        next_values=next_state_value, done=done, terminated=done if terminated is None else terminated,
        gamma=_coef(gamma, reward), lmbda=1.0, rho_bar=_threshold(rho_thresh), c_bar=_threshold(c_thresh),
        time_dim=-2,
    )
    return adv, vs


# ---------------------------------------------------------------------------------------------
# routing: the names TorchRL's classes look up in torchrl.objectives.value.advantages
# ---------------------------------------------------------------------------------------------

_OURS = {
    "generalized_advantage_estimate": generalized_advantage_estimate,
    "vec_generalized_advantage_estimate": vec_generalized_advantage_estimate,
    "td_lambda_return_estimate": td_lambda_return_estimate,
    "vec_td_lambda_return_estimate": vec_td_lambda_return_estimate,
    "vec_td1_return_estimate": vec_td1_return_estimate,
    "vtrace_advantage_estimate": vtrace_advantage_estimate,
}
_ORIGINAL = {name: getattr(_adv, name) for name in _OURS}
_lock = threading.RLock()
_state = {"patched": False, "depth": 0, "registry": {}}


def _set_globals(table) -> None:
    for name, fn in table.items():
        setattr(_adv, name, fn)


@contextlib.contextmanager
def _routed():
    """Point the advantages module's functionals at ours for the duration of one call (the
    classes below have no method hook around the recursion). Re-entrant and thread-safe: the
    originals come back when the last concurrent call leaves, unless patch() is active."""
    with _lock:
        _state["depth"] += 1
        _set_globals(_OURS)
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and not _state["patched"]:
                _set_globals(_ORIGINAL)


def _call_routed(method, self, *args, **kwargs):
    if torch.compiler.is_compiling():
        # no module-global swaps inside a trace: compiled estimators follow patch()'s state
        return method(self, *args, **kwargs)
    with _routed():
        return method(self, *args, **kwargs)


class _Routed:
    """Mixin: run TorchRL's own ``forward`` / ``value_estimate`` (every key, shifted, chunking,
    averaging and differentiability rule unchanged) with the recursion routed to rl_triton."""

    def forward(self, *args, **kwargs):
        return _call_routed(super().forward.__func__, self, *args, **kwargs)

    def value_estimate(self, *args, **kwargs):
        return _call_routed(super().value_estimate.__func__, self, *args, **kwargs)


class GAE(_Routed, _adv.GAE):
    """``torchrl.objectives.value.GAE`` with the fused scan (loop and ``vectorized`` paths alike)."""


class TDLambdaEstimator(_Routed, _adv.TDLambdaEstimator):
    """``torchrl.objectives.value.TDLambdaEstimator`` with the fused scan."""


class TD1Estimator(_Routed, _adv.TD1Estimator):
    """``torchrl.objectives.value.TD1Estimator`` with the fused scan."""


class VTrace(_Routed, _adv.VTrace):
    """``torchrl.objectives.value.VTrace`` (0.14.1 semantics) with the fused scan."""


# ---------------------------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------------------------

_REGISTERED = {
    _obj_utils.ValueEstimators.GAE: GAE,
    _obj_utils.ValueEstimators.TDLambda: TDLambdaEstimator,
    _obj_utils.ValueEstimators.TD1: TD1Estimator,
    _obj_utils.ValueEstimators.VTrace: VTrace,
}


def patch() -> None:
    """Route TorchRL's estimators through rl_triton: the functionals the classes call (module
    globals of ``torchrl.objectives.value.advantages``) and the value-estimator registry entries
    for GAE, TDLambda, TD1 and VTrace (so ``loss.make_value_estimator(...)`` builds our classes).
    ``torchrl.objectives.value.functional`` itself is left alone. Idempotent."""
    with _lock:
        if _state["patched"]:
            return
        _obj_utils._ensure_builtin_value_estimators_registered()
        registry = _obj_utils._VALUE_ESTIMATOR_REGISTRY
        saved = {}
        for key, cls in _REGISTERED.items():
            entry = registry.get(key)
            saved[key] = entry
            defaults = entry.default_kwargs if entry is not None else _obj_utils._BUILTIN_VALUE_ESTIMATOR_DEFAULTS[key]
            registry[key] = _obj_utils._ValueEstimatorRegistryEntry(cls, defaults)
        _state["registry"] = saved
        _set_globals(_OURS)
        _state["patched"] = True


def unpatch() -> None:
    """Restore TorchRL's own function objects and registry entries (the same objects). Idempotent."""
    with _lock:
        if not _state["patched"]:
            return
        registry = _obj_utils._VALUE_ESTIMATOR_REGISTRY
        for key, entry in _state["registry"].items():
            if entry is None:
                registry.pop(key, None)
            else:
                registry[key] = entry
        _state["registry"] = {}
        _state["patched"] = False
        if _state["depth"] == 0:
            _set_globals(_ORIGINAL)


def is_patched() -> bool:
    return _state["patched"]


@contextlib.contextmanager
def patched():
    """``with patched(): ...`` patches for the block and restores the previous state after."""
    was_patched = is_patched()
    patch()
    try:
        yield
    finally:
        if not was_patched:
            unpatch()
