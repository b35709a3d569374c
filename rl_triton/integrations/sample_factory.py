"""Sample Factory (written against sample-factory 2.1.1): its GAE and discounted sums as fused
scans instead of its scripted loops over time, and V-trace on the tensors' device.

    import rl_triton.integrations.sample_factory as rt_sf
    rt_sf.patch()             # gae_advantages and calculate_discounted_sum_torch, where looked up
    ...                       # run_rl(cfg) as usual
    rt_sf.unpatch()           # Sample Factory's scripted functions back, the same objects

``patch()`` sets ``gae_advantages`` and ``calculate_discounted_sum_torch`` in
``sample_factory.algo.utils.rl_utils`` and ``gae_advantages`` in
``sample_factory.algo.learning.learner``, which imports it by name (the learner computes the GAE
of each training batch with it when ``with_vtrace`` is off). The functions need no Sample
Factory; ``patch()`` imports it.

V-trace (``with_vtrace``) is not a function in Sample Factory: it is a block inside
``Learner._calculate_losses`` that copies the minibatch's ratios and values to the host, runs
the recurrence there and copies the targets and advantages back. Replacing that block means
replacing the whole method, whose other lines are Sample Factory's; this module does not copy
it. :func:`vtrace_targets` computes what the block computes, on the tensors' device, for a
``_calculate_losses`` of one's own (docs/sample_factory.md).

Conventions mapped (docs/sample_factory.md):

- ``gae_advantages``: ``[E, T]`` rows (batch-major), ``values`` and ``valids`` ``[E, T+1]``
  (the last column V(s_T) and its validity), ``dones[t]`` ends the episode after step t and cuts
  both the bootstrap and the trace. An invalid step (experience of another policy, or too old)
  is Sample Factory's: its TD error is ``(1 - d[t]) * gamma * V[t+1] * valid[t+1]`` and it
  passes the next advantage on undiscounted, ``A[t] = delta[t] + (1 - d[t]) * (valid[t] * gamma
  * lambda + 1 - valid[t]) * A[t+1]``: ``rl_triton.core.valid.valid_gae`` on the views
  ``values[:, :-1]``, ``values[:, 1:]``, ``valids[:, :-1]``, ``valids[:, 1:]`` (docs/semantics.md,
  section 6.11), one launch for any mask, which is never read on the host.
- ``calculate_discounted_sum_torch``: time-major ``[T, ...]``, ``x_last`` the value beyond the
  window (default 0): ``rl_triton.core.valid.valid_discounted_return(x, valids, dones,
  initial=x_last, time_dim=0)``, the same rule.
- ``vtrace_targets``: the minibatch is trajectory-major, ``recurrence`` steps per trajectory,
  flattened; Sample Factory bootstraps the last step from ``(V[T-1] - r[T-1]) / gamma``, clips
  the ratio at ``rho`` for the TD errors and the advantages and at ``c`` for the trace, and
  every done is a termination: ``rl_triton.vtrace(..., done=dones, rho_bar=rho, c_bar=c,
  rho_bar_pg=rho)``.

Where the inputs are not what Sample Factory's learner passes (other ranks, non-tensors), the
functions raise a ``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

import importlib
import threading

import torch

from .. import vtrace
from ..core.valid import valid_discounted_return, valid_gae
from ._patching import PatchState, rounded

__all__ = ["SAMPLE_FACTORY_VERSION", "calculate_discounted_sum_torch", "gae_advantages", "is_patched", "patch",
           "patched", "unpatch", "vtrace_targets"]

SAMPLE_FACTORY_VERSION = "2.1.1"  # the version these drop-ins were written and checked against
# (module, name) pairs that patch() sets: the definitions and the learner's imported name
TARGETS = (("sample_factory.algo.utils.rl_utils", "gae_advantages"),
           ("sample_factory.algo.utils.rl_utils", "calculate_discounted_sum_torch"),
           ("sample_factory.algo.learning.learner", "gae_advantages"))


def _tensor(x, name: str, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def _number(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    return float(x)


def gae_advantages(rewards: torch.Tensor, dones: torch.Tensor, values: torch.Tensor, valids: torch.Tensor,
                   γ: float, λ: float) -> torch.Tensor:  # noqa: PLC2401 (Sample Factory's parameter names)
    """Sample Factory's ``gae_advantages`` as one fused scan (one launch, no read of the mask on
    the host): the advantages ``[E, T]``.

    delta[t] = (r[t] - V[t]) * valid[t] + (1 - d[t]) * gamma * V[t+1] * valid[t+1],
    A[t] = delta[t] + (1 - d[t]) * (valid[t] * gamma * lambda + 1 - valid[t]) * A[t+1], A[T] = 0.

    Args:
        rewards: ``[E, T]``.
        dones: ``[E, T]``, nonzero where the episode ends after the step.
        values: ``[E, T+1]``, V(s_t) and V(s_T) in the last column.
        valids: ``[E, T+1]``, bool or 0/1: which steps are the learning policy's.
        γ: the discount.
        λ: the GAE parameter.
    """
    rewards, dones = _tensor(rewards, "rewards", 2), _tensor(dones, "dones", 2)
    values, valids = _tensor(values, "values", 2), _tensor(valids, "valids", 2)
    E, T = rewards.shape
    for name, x, shape in (("dones", dones, (E, T)), ("values", values, (E, T + 1)), ("valids", valids, (E, T + 1))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (rewards are {(E, T)}), got {tuple(x.shape)}")
    gamma, lmbda = _number(γ, "γ"), _number(λ, "λ")
    # the loop discounts the trace by gamma * lambda rounded to float32 (its mask's .float()),
    # whatever the data's dtype
    return valid_gae(rewards, values[:, :-1], values[:, 1:], valids[:, :-1], valids[:, 1:], dones, gamma=gamma,
                     trace=rounded(gamma * lmbda, torch.float32))


def calculate_discounted_sum_torch(x: torch.Tensor, dones: torch.Tensor, valids: torch.Tensor, discount: float,
                                   x_last: torch.Tensor | None = None) -> torch.Tensor:
    """Sample Factory's ``calculate_discounted_sum_torch`` as one fused scan (one launch, no read
    of the mask on the host), time-major:

    S[t] = x[t] + (1 - d[t]) * (valid[t] * discount + 1 - valid[t]) * S[t+1], S[T] = x_last (0).

    Args:
        x: ``[T, ...]``, already multiplied by the valid mask where that is wanted.
        dones: ``x``'s shape, nonzero where the episode ends after the step.
        valids: ``x``'s shape, bool or 0/1.
        discount: the discount of valid steps.
        x_last: ``x.shape[1:]``, the value beyond the window, or None for 0.
    """
    x, dones, valids = _tensor(x, "x"), _tensor(dones, "dones"), _tensor(valids, "valids")
    if x.ndim < 1:
        raise ValueError("x must have a time dim (dim 0)")
    for name, y in (("dones", dones), ("valids", valids)):
        if y.shape != x.shape:
            raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(y.shape)}")
    if x_last is not None:
        _tensor(x_last, "x_last")
    discount = _number(discount, "discount")
    # the loop's discount is rounded to the mask's dtype (float32 for a bool one)
    rounding = valids.dtype if valids.is_floating_point() else torch.get_default_dtype()
    return valid_discounted_return(x, valids, dones, gamma=rounded(discount, rounding), initial=x_last, time_dim=0)


def vtrace_targets(ratio: torch.Tensor, values: torch.Tensor, rewards: torch.Tensor, dones: torch.Tensor,
                   recurrence: int, gamma: float, rho: float, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The V-trace block of Sample Factory's ``Learner._calculate_losses``, on the tensors'
    device: ``(targets, advantages)``, flat like the minibatch.

    Per trajectory (``recurrence`` consecutive entries), with rho_t = min(rho, ratio_t),
    c_t = min(c, ratio_t), V[T] = (V[T-1] - r[T-1]) / gamma:
    vs[t] = V[t] + rho_t (r[t] + gamma (1 - d[t]) V[t+1] - V[t]) + gamma (1 - d[t]) c_t (vs[t+1] - V[t+1]),
    vs[T] = V[T]; advantages[t] = rho_t (r[t] + gamma (1 - d[t]) vs[t+1] - V[t]).

    Args:
        ratio: ``[B]`` pi / mu of the minibatch's actions (Sample Factory clamps it to
            [0.05, 20] first).
        values: ``[B]`` the critic's values of the minibatch.
        rewards: ``[B]``.
        dones: ``[B]``, nonzero where the episode ends after the step.
        recurrence: steps per trajectory; ``B`` must be a multiple of it.
        gamma: the discount (> 0: the bootstrap divides by it).
        rho: the clip of the ratio in the TD errors and the advantages (``vtrace_rho``).
        c: the clip of the ratio in the trace (``vtrace_c``).
    """
    ratio, values = _tensor(ratio, "ratio", 1), _tensor(values, "values", 1)
    rewards, dones = _tensor(rewards, "rewards", 1), _tensor(dones, "dones", 1)
    if isinstance(recurrence, bool) or not isinstance(recurrence, int) or recurrence < 1:
        raise TypeError(f"recurrence must be a positive int, got {recurrence!r}")
    n = ratio.shape[0]
    if n % recurrence:
        raise ValueError(f"ratio's length {n} must be a multiple of recurrence={recurrence}")
    for name, x in (("values", values), ("rewards", rewards), ("dones", dones)):
        if x.shape[0] != n:
            raise ValueError(f"{name} must have ratio's length {n}, got {x.shape[0]}")
    gamma, rho, c = _number(gamma, "gamma"), _number(rho, "rho"), _number(c, "c")
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0 (the bootstrap divides by it), got {gamma}")
    device, dtype = ratio.device, ratio.dtype
    rows = (-1, recurrence)
    v = values.to(device=device, dtype=dtype).reshape(rows)
    r = rewards.to(device=device, dtype=dtype).reshape(rows)
    d = dones.to(device=device).reshape(rows)
    # Sample Factory's bootstrap of the last step: V(s_T) from the last value and reward
    bootstrap = (v[:, -1] - r[:, -1]) / gamma
    vs, adv = vtrace(r, v, torch.log(ratio).reshape(rows), torch.zeros_like(v), bootstrap_value=bootstrap, done=d,
                     gamma=gamma, rho_bar=rho, c_bar=c, rho_bar_pg=rho)
    return vs.reshape(-1), adv.reshape(-1)


# -- patching ------------------------------------------------------------------------------
_lock = threading.Lock()
_ORIGINALS: dict = {}  # (module name, attribute) -> Sample Factory's object, as found on first patch
_OURS = {"gae_advantages": gae_advantages, "calculate_discounted_sum_torch": calculate_discounted_sum_torch}


def _set_patch(on: bool) -> None:
    modules = {name: importlib.import_module(name) for name, _ in TARGETS}
    with _lock:
        if not _ORIGINALS:
            for name, attr in TARGETS:
                _ORIGINALS[name, attr] = modules[name].__dict__[attr]
        for name, attr in TARGETS:
            setattr(modules[name], attr, _OURS[attr] if on else _ORIGINALS[name, attr])


_state = PatchState(lambda: _set_patch(True), lambda: _set_patch(False))


def patch() -> None:
    """Route Sample Factory's ``gae_advantages`` and ``calculate_discounted_sum_torch``
    (``TARGETS``: where they are defined and where the learner imported them) through rl_triton
    until ``unpatch()``. Imports Sample Factory. Idempotent. Thread-safe; shared with
    ``patched()`` blocks in any thread."""
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``: Sample Factory's own functions (the same objects) are back at once,
    or when the last open ``patched()`` block closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``patch()`` or a ``patched()`` block routes Sample Factory's functions now."""
    return _state.active


def patched():
    """``with patched(): ...``: Sample Factory is patched for the block. Blocks nest, also
    across threads; its functions come back when the last holder (block or ``patch()``) lets
    go."""
    return _state.patched()
