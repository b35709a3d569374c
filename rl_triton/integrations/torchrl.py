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

Conventions mapped here (docs/semantics.md, section 12): TorchRL's flags are already
transition-aligned, ``done`` cuts the trace and ``terminated`` (default: ``done``) removes the
bootstrap, so they pass straight through as ``done=``/``terminated=``, with
``next_values=next_state_value`` explicit. The time dim is moved exactly as TorchRL moves it
(its own ``_transpose_time`` decorator wraps every functional here), so shapes, ``time_dim``
rules and layout errors are TorchRL's. Float inputs are cast to ``next_state_value.dtype``
(TorchRL's output dtype) because rl_triton wants one dtype per call. ``done``/``terminated``
must be ``torch.bool`` (TorchRL applies ``~`` to them; other dtypes raise ``TypeError`` here).
Where a functional here raises, it raises what TorchRL's raises on the same arguments, word
for word, if TorchRL's raises at all.

The classes run TorchRL's own methods with our functionals and never touch TorchRL's module;
only ``patch()`` / ``patched()`` change TorchRL (thread-safe, reference-counted).

Results are exact recurrences, also for the ``vec_*`` names, where TorchRL truncates a
convolution filter at ``(gamma*lmbda)**n < 1e-7``; see docs/torchrl.md for what differs.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref

import torch

from ._patching import requires_framework

requires_framework(__name__, "TorchRL", "torchrl", extra="torchrl")

from torchrl.objectives import utils as _obj_utils  # noqa: E402
from torchrl.objectives.value import advantages as _adv  # noqa: E402
from torchrl.objectives.value import functional as _fn  # noqa: E402

from .. import td_lambda_return as _rt_td_lambda_return  # noqa: E402
from .. import gae as _rt_gae  # noqa: E402
from .. import vtrace as _rt_vtrace  # noqa: E402
from ..core.docstrings import documented  # noqa: E402
from ._patching import PatchState, error_of  # noqa: E402

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


# The value each CUDA threshold tensor held at its last read outside CUDA-graph capture, by
# id(tensor), dropped with the tensor. Nothing is stored on the caller's tensor.
_last_read: dict[int, float] = {}


def _threshold(x):
    """rho_thresh / c_thresh: rl_triton takes Python numbers (TorchRL's buffers are 0-d tensors).

    A tensor is read at every call (a host synchronisation on CUDA), so every change to it is
    seen, in place or through ``.data``. Under CUDA-graph capture, which cannot read device
    memory, the value of the tensor's last read outside the capture is taken: the captured
    graph replays that value, as it replays every scalar kernel argument."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise NotImplementedError("rl_triton's vtrace takes scalar clipping thresholds only")
        if torch.compiler.is_compiling() or x.device.type != "cuda":
            return float(x)
        key = id(x)
        if torch.cuda.is_current_stream_capturing():
            if key not in _last_read:
                raise RuntimeError(
                    "a CUDA clipping-threshold tensor cannot be read during CUDA-graph capture: call the "
                    "estimator once before capturing (CudaGraphModule's warm-up calls do)"
                )
            return _last_read[key]
        value = float(x)
        if key not in _last_read:
            weakref.finalize(x, _last_read.pop, key, None)
        _last_read[key] = value
        return value
    return x


def _scalar(x):
    """TorchRL's test for discounts its vectorised TD functions take as scalars."""
    return not isinstance(x, torch.Tensor) or x.numel() == 1


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
        if vec:
            if not (_scalar(gamma) and _scalar(lmbda)):
                raise NotImplementedError(
                    "the vectorised TD functions do not implement rolling_gamma=False with per-step gamma or "
                    "lmbda; td_lambda_return_estimate / td1_return_estimate do"
                )
            # with scalar discounts the vectorised functions compute the rolling return whatever
            # rolling_gamma says, as TorchRL's do
            rolling_gamma = True
        elif td1 and not _full(gamma, done.shape):
            raise RuntimeError("rolling_gamma=False needs a per-step gamma tensor")
        elif not td1 and not _full(gamma, done.shape) and not _full(lmbda, done.shape):
            raise RuntimeError("rolling_gamma=False needs a per-step gamma or lmbda tensor")
    if rolling_gamma:
        return _td_lambda(reward, next_state_value, done, terminated, gamma, lmbda)
    fn = _td1_no_window_bootstrap if td1 else _td_lambda
    return _per_start(fn, gamma, lmbda, next_state_value, reward, done, terminated)


# ---------------------------------------------------------------------------------------------
# functionals: TorchRL 0.14.1 signatures
# ---------------------------------------------------------------------------------------------

# the functionals' arguments (TorchRL's names and layout)
_ARGS = {
    "gamma": ("the discount in [0, 1]: a number, or a tensor broadcastable to ``reward``'s shape (per step or per "
              "row), on any device (moved to the data's)."),
    "lmbda": "lambda in [0, 1]: a number or a tensor, as ``gamma``.",
    "state_value": "``V(s_t)``, the shape of ``reward``; cast to ``next_state_value``'s dtype.",
    "next_state_value": (
        "``V(s_{t+1})`` of each step's true successor (the final observation's value at a truncation), "
        "``[*B, T, F]`` with time at ``time_dim``; the output has its dtype, and the other float inputs are "
        "cast to it."),
    "reward": "``r[t]``, the shape of ``next_state_value``; cast to its dtype.",
    "done": ("a ``torch.bool`` tensor of ``reward``'s shape (TypeError for another dtype): the episode ends after "
             "step t (terminated or truncated), so the trace stops there."),
    "terminated": ("a ``torch.bool`` tensor of ``reward``'s shape: ``s_{t+1}`` is terminal, so step t does not "
                   "bootstrap from ``next_state_value[t]``. None: ``done`` (every end a termination)."),
    "rolling_gamma": (
        "None or True: each step's ``gamma`` and ``lmbda`` discount that step. False: the return from step k "
        "uses step k's ``gamma`` and ``lmbda`` at every later step of the window, which needs a per-step "
        "``gamma`` or ``lmbda`` tensor (RuntimeError otherwise); the ``vec_*`` functions take it only with "
        "scalar discounts (where it changes nothing) and raise ``NotImplementedError`` otherwise, as "
        "TorchRL's do."),
    "time_dim": ("the time dimension of every tensor (default -2, TorchRL's ``[*B, T, F]``), moved by TorchRL's "
                 "own ``_transpose_time``, so its layout rules and errors hold."),
    "log_pi": "the target policy's log-probability of the taken action, the shape of ``reward``.",
    "log_mu": "the behaviour policy's log-probability of the taken action, the shape of ``reward``.",
    "rho_thresh": (
        "the clip of the importance ratio ``rho`` (in the TD errors and the policy-gradient advantages): a "
        "number > 0, or a one-element tensor, read at every call (a host synchronisation on CUDA; "
        "``NotImplementedError`` for more elements)."),
    "c_thresh": "the clip of the trace ratio ``c``, as ``rho_thresh``.",
}
_TD1_ROLLING = (
    "None or True: each step's ``gamma`` discounts that step. False: the return from step k uses step k's "
    "``gamma`` at every later step of the window, which needs a per-step ``gamma`` tensor (RuntimeError "
    "otherwise); ``vec_td1_return_estimate`` takes it only with a scalar ``gamma`` (where it changes nothing) "
    "and raises ``NotImplementedError`` otherwise, as TorchRL's does.")


def _raises_as_torchrl(ours):
    """Where the drop-in ``ours`` raises, raise what TorchRL's function of the same name raises on
    the same arguments: its exception, type and message word for word (TorchRL's own tests and
    user code match them). Where TorchRL's function accepts the arguments, ours raises its own.
    TorchRL's function runs on the error path only."""
    theirs = getattr(_fn, ours.__name__)

    @functools.wraps(ours)
    def call(*args, **kwargs):
        try:
            return ours(*args, **kwargs)
        except Exception:
            error = error_of(theirs, args, kwargs)
            if error is None:
                raise
            raise error from None

    return call


@_raises_as_torchrl
@_transpose_time
@documented(_ARGS)
def generalized_advantage_estimate(
    gamma, lmbda, state_value, next_state_value, reward, done, terminated=None, *, time_dim=-2
):
    """Drop-in for ``torchrl.objectives.value.functional.generalized_advantage_estimate``:
    returns ``(advantage, value_target)``, one fused scan.
    """
    return _gae_impl(gamma, lmbda, state_value, next_state_value, reward, done, terminated)


@_raises_as_torchrl
@_transpose_time
@documented(_ARGS)
def vec_generalized_advantage_estimate(
    gamma, lmbda, state_value, next_state_value, reward, done, terminated=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``vec_generalized_advantage_estimate``; exact (no filter truncation),
    no host synchronisation, and ``gamma*lmbda == 0`` works. Returns ``(advantage, value_target)``.
    """
    return _gae_impl(gamma, lmbda, state_value, next_state_value, reward, done, terminated)


@_raises_as_torchrl
@_transpose_time
@documented(_ARGS)
def td_lambda_return_estimate(
    gamma, lmbda, next_state_value, reward, done, terminated=None, rolling_gamma=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``td_lambda_return_estimate``, ``rolling_gamma=False`` included:
    returns the TD(lambda) return.
    """
    return _td_lambda_impl(gamma, lmbda, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=False, vec=False)


@_raises_as_torchrl
@_transpose_time
@documented(_ARGS)
def vec_td_lambda_return_estimate(
    gamma, lmbda, next_state_value, reward, done, terminated=None, rolling_gamma=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``vec_td_lambda_return_estimate`` (exact; ``rolling_gamma=False``
    with per-step discounts raises ``NotImplementedError`` as TorchRL's does: use
    ``td_lambda_return_estimate``). Returns the TD(lambda) return.
    """
    return _td_lambda_impl(gamma, lmbda, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=False, vec=True)


@_raises_as_torchrl
@_transpose_time
@documented(_ARGS, rolling_gamma=_TD1_ROLLING)
def td1_return_estimate(
    gamma, next_state_value, reward, done, terminated=None, rolling_gamma=None, *, time_dim=-2
):
    """Drop-in for TorchRL's ``td1_return_estimate``, ``rolling_gamma=False`` included: returns
    the TD(1) return.
    """
    return _td_lambda_impl(gamma, 1.0, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=True, vec=False)


@_raises_as_torchrl
@_transpose_time
@documented(_ARGS, rolling_gamma=_TD1_ROLLING)
def vec_td1_return_estimate(
    gamma, next_state_value, reward, done, terminated=None, rolling_gamma=None, time_dim=-2
):
    """Drop-in for TorchRL's ``vec_td1_return_estimate`` (``time_dim`` is positional-or-keyword
    there too): returns the TD(1) return.
    """
    return _td_lambda_impl(gamma, 1.0, next_state_value, reward, done, terminated, rolling_gamma,
                           td1=True, vec=True)


@_raises_as_torchrl
@_transpose_time
@documented(_ARGS)
def vtrace_advantage_estimate(
    gamma, log_pi, log_mu, state_value, next_state_value, reward, done, terminated=None,
    rho_thresh=1.0, c_thresh=1.0, time_dim=-2,
):
    """Drop-in for TorchRL 0.14.1's ``vtrace_advantage_estimate``: returns ``(advantage, vs)``.

    As in 0.14.1: ``c = min(ratio, c_thresh)`` (no lambda), the policy-gradient rho is clipped at
    ``rho_thresh``, and ``vs_next`` is the true next value wherever ``done``.
    """
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
# the globals our classes' methods run with: TorchRL's advantages module, but our functionals
_NAMESPACE = {**vars(_adv), **_OURS}


def _reads_functionals(fn) -> bool:
    """Whether ``fn``, code nested in it or a function it wraps names one of the functionals."""
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        if not _OURS.keys().isdisjoint(code.co_names):
            return True
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    inner = getattr(fn, "__wrapped__", None)
    return inner is not None and _reads_functionals(inner)


def _cell_holds(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _with_our_functionals(fn):
    """A copy of ``fn`` that finds our functionals where it found TorchRL's: functions of TorchRL's
    advantages module get ``_NAMESPACE`` as their globals, and the decorators around them
    (``functools.wraps`` wrappers holding the function they wrap in a closure cell) are copied
    around the copy. TorchRL's module and functions are left as they are."""
    inner = getattr(fn, "__wrapped__", None)
    closure = fn.__closure__
    if inner is not None:
        held = [i for i, cell in enumerate(closure or ()) if _cell_holds(cell, inner)]
        if len(held) != 1:
            raise RuntimeError(
                f"cannot route {fn.__qualname__}: its decorator does not keep the function it wraps "
                f"in a closure cell (this module is written against TorchRL 0.14.1)"
            )
        inner = _with_our_functionals(inner)
        closure = closure[:held[0]] + (types.CellType(inner),) + closure[held[0] + 1:]
    namespace = _NAMESPACE if fn.__globals__ is vars(_adv) else fn.__globals__
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    copy.__annotations__ = dict(fn.__annotations__)
    if inner is not None:
        copy.__wrapped__ = inner
    return copy


def _routed(cls):
    """Class decorator for a subclass of a TorchRL estimator: every method of the TorchRL class
    that calls a value functional (``forward``, ``value_estimate``) is TorchRL's own code, with
    every key, shifted, chunking, averaging and differentiability rule unchanged, calling ours."""
    base = cls.__mro__[1]
    for name in dir(base):
        fn = inspect.getattr_static(base, name)
        if isinstance(fn, types.FunctionType) and _reads_functionals(fn):
            setattr(cls, name, _with_our_functionals(fn))
    return cls


@_routed
class GAE(_adv.GAE):
    """``torchrl.objectives.value.GAE`` with the fused scan (loop and ``vectorized`` paths alike)."""


@_routed
class TDLambdaEstimator(_adv.TDLambdaEstimator):
    """``torchrl.objectives.value.TDLambdaEstimator`` with the fused scan."""


@_routed
class TD1Estimator(_adv.TD1Estimator):
    """``torchrl.objectives.value.TD1Estimator`` with the fused scan."""


@_routed
class VTrace(_adv.VTrace):
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
_saved_registry = {}  # TorchRL's registry entries while patched: key -> (class, default kwargs)


def _set_globals(table) -> None:
    for name, fn in table.items():
        setattr(_adv, name, fn)


def _register(key, cls, defaults) -> None:
    _obj_utils.register_value_estimator(key, default_kwargs=defaults)(cls)


def _apply() -> None:
    for key, cls in _REGISTERED.items():
        entry = _obj_utils.get_value_estimator_entry(key)  # registers TorchRL's built-in classes first
        _saved_registry[key] = (entry.cls, entry.default_kwargs)
        _register(key, cls, entry.default_kwargs)
    _set_globals(_OURS)


def _restore() -> None:
    for key, (cls, defaults) in _saved_registry.items():
        _register(key, cls, defaults)
    _saved_registry.clear()
    _set_globals(_ORIGINAL)


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route TorchRL's estimators through rl_triton until ``unpatch()``: the functionals the
    classes call (module globals of ``torchrl.objectives.value.advantages``) and the
    value-estimator registry entries for GAE, TDLambda, TD1 and VTrace (so
    ``loss.make_value_estimator(...)`` builds our classes). ``torchrl.objectives.value.functional``
    itself is left alone. Idempotent. Thread-safe.

    The patch is shared with ``patched()`` blocks, which may be open in other threads: TorchRL
    is patched while ``patch()`` is in effect or any block is open."""
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``. TorchRL's own function objects (the same objects) and registry
    entries (the classes and default kwargs found by ``patch()``) are back at once, or, while
    ``patched()`` blocks are open (in any thread), when the last of them closes. Idempotent.
    Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether TorchRL's estimators are routed through rl_triton now."""
    return _state.active


def patched():
    """``with patched(): ...``: TorchRL is patched for the block, and the block's hold on the
    patch ends with it. Blocks nest, also across threads: each holds the patch until it closes,
    and TorchRL's own objects come back when the last holder (block or ``patch()``) lets go."""
    return _state.patched()
