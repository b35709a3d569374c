"""rl_games (written against rl-games 1.6.5; IsaacLab's fork ``isaac-sim/rl_games`` has the
same methods): one fused GAE call instead of the Python loops of
``A2CBase.discount_values`` and ``A2CBase.discount_values_masks``.

    import rl_triton.integrations.rl_games as rt_rl_games
    rt_rl_games.patch()       # A2CBase and every agent that inherits from it
    runner.run({"train": True, ...})
    rt_rl_games.unpatch()     # rl_games' own methods, the same function objects

or without patching, through rl_games' agent registry (one line after the ``Runner`` is made;
the config keeps ``algo: name: a2c_continuous``)::

    runner = Runner(IsaacAlgoObserver())
    rt_rl_games.register(runner)    # a2c_continuous / a2c_discrete build the agents below

The agents here, ``A2CAgent`` and ``DiscreteA2CAgent``, are rl_games' with the two methods
replaced; ``FusedDiscount`` is the mixin for agents of one's own that derive from ``A2CBase``.

Conventions mapped here (docs/rl_games.md): time-major ``[horizon_length, N, K]`` rewards and
values (``K = value_size``, the value heads), ``mb_fdones[t]`` the done flag stored with obs t,
the one of the step before (an episode start) and ``fdones`` the live one after the last step:
rl_triton's observation-aligned flags, read in place (done[t] = mb_fdones[t+1], done[T-1] =
``fdones``, every done a termination, as rl_games folds the time-limit bootstrap into the
rewards), broadcast over the heads; V(s_T) is ``last_extrinsic_values``. With ``mb_masks``
(``[T, N]``) a masked step's advantage is 0 and nothing flows through it to the step before.
Inputs of any other form, or a horizon that is not the tensors' length, take rl_games' own loop;
where the fused call raises, the method raises what rl_games' own method raises, if it does.
"""

from __future__ import annotations

import functools

import torch
from rl_games.algos_torch import a2c_continuous as _continuous
from rl_games.algos_torch import a2c_discrete as _discrete
from rl_games.common import a2c_common as _a2c_common

from .. import gae
from ._patching import PatchState, error_of

__all__ = ["A2CAgent", "DiscreteA2CAgent", "FusedDiscount", "discount_values", "discount_values_masks",
           "is_patched", "patch", "patched", "register", "unpatch"]

_BASE = _a2c_common.A2CBase
_ORIGINALS = {name: _BASE.__dict__[name] for name in ("discount_values", "discount_values_masks")}


def _fused_form(agent, fdones, last_values, mb_fdones, mb_values, mb_rewards, mb_masks=None) -> bool:
    """Whether the arguments have the form the fused call maps (else rl_games' loop runs)."""
    tensors = (fdones, last_values, mb_fdones, mb_values, mb_rewards) + (() if mb_masks is None else (mb_masks,))
    if not all(isinstance(x, torch.Tensor) for x in tensors) or mb_rewards.ndim != 3:
        return False
    T, N, K = mb_rewards.shape
    return (agent.horizon_length == T and mb_values.shape == (T, N, K) and last_values.shape == (N, K)
            and mb_fdones.shape == (T, N) and fdones.shape == (N,)
            and (mb_masks is None or mb_masks.shape == (T, N)))


def _trace_factor(gamma: float, tau: float, flags: torch.Tensor, dtype: torch.dtype) -> float:
    """lmbda for rl_triton such that gamma * lmbda is rl_games' trace factor: the loop multiplies
    ``gamma * tau`` by the flags' ``1 - done`` first, a tensor of the flags' float dtype."""
    flag_dtype = torch.result_type(flags, 1.0)
    if flag_dtype == dtype or gamma == 0:
        return tau
    return torch.tensor(gamma * tau, dtype=flag_dtype).item() / gamma


def _advantages(agent, fdones, last_values, mb_fdones, mb_values, mb_rewards, mb_masks=None):
    gamma, tau = float(agent.gamma), float(agent.tau)
    lmbda = _trace_factor(gamma, tau, fdones, mb_rewards.dtype)
    if mb_masks is not None:
        # a masked step t + 1 cuts the trace into step t (the advantages get the mask below)
        lmbda = torch.full(mb_rewards.shape[:2], lmbda, dtype=mb_rewards.dtype, device=mb_rewards.device)
        lmbda[:-1] *= mb_masks[1:]
        lmbda = lmbda.unsqueeze(-1)
    boot = last_values if last_values.dtype == mb_rewards.dtype else last_values.to(mb_rewards.dtype)
    values = mb_values if mb_values.dtype == mb_rewards.dtype else mb_values.to(mb_rewards.dtype)
    adv, _ = gae(mb_rewards, values, episode_starts=mb_fdones.unsqueeze(-1), last_done=fdones.unsqueeze(-1),
                 bootstrap_value=boot, gamma=gamma, lmbda=lmbda, time_dim=0)
    if mb_masks is not None:
        adv *= mb_masks.unsqueeze(-1)
    return adv


def _fused(name: str):
    original = _ORIGINALS[name]

    def method(self, *args):
        if not _fused_form(self, *args):
            return original(self, *args)
        try:
            return _advantages(self, *args)
        except Exception:
            error = error_of(original, (self, *args), {})
            if error is None:
                raise
            raise error from None

    return functools.wraps(original)(method)


discount_values = _fused("discount_values")
discount_values.__doc__ = """rl_games' ``A2CBase.discount_values`` as one fused scan: the advantages
``[T, N, K]``.

delta[t] = r[t] + gamma * (1 - d[t]) * V[t+1] - V[t], A[t] = delta[t] + gamma * tau * (1 - d[t]) *
A[t+1], with d[t] = mb_fdones[t+1], d[T-1] = fdones, V[T] = last_extrinsic_values, A[T] = 0."""
discount_values_masks = _fused("discount_values_masks")
discount_values_masks.__doc__ = """rl_games' ``A2CBase.discount_values_masks`` as one fused scan:
A[t] = m[t] * (delta[t] + gamma * tau * (1 - d[t]) * A[t+1]), ``discount_values``' recurrence with
the step mask ``mb_masks`` ``[T, N]``."""


class FusedDiscount:
    """Mixin for agents derived from ``A2CBase``: both methods through rl_triton."""

    discount_values = discount_values
    discount_values_masks = discount_values_masks


class A2CAgent(FusedDiscount, _continuous.A2CAgent):
    """rl_games' continuous-action PPO agent (``a2c_continuous``) with the fused GAE."""


class DiscreteA2CAgent(FusedDiscount, _discrete.DiscreteA2CAgent):
    """rl_games' discrete-action PPO agent (``a2c_discrete``) with the fused GAE."""


AGENTS = {"a2c_continuous": A2CAgent, "a2c_discrete": DiscreteA2CAgent}


def register(runner) -> None:
    """Make ``runner`` (an ``rl_games.torch_runner.Runner``) build ``A2CAgent`` and
    ``DiscreteA2CAgent`` for the algorithm names ``a2c_continuous`` and ``a2c_discrete``; its
    players and other algorithms stay as they are."""
    factory = getattr(runner, "algo_factory", None)
    if factory is None or not callable(getattr(factory, "register_builder", None)):
        raise TypeError(f"runner must be an rl_games Runner (with an algo_factory), got {type(runner).__name__}")
    for name, cls in AGENTS.items():
        factory.register_builder(name, functools.partial(_build, cls))


def _build(cls, **kwargs):
    return cls(**kwargs)


def _apply() -> None:
    _BASE.discount_values = discount_values
    _BASE.discount_values_masks = discount_values_masks


def _restore() -> None:
    for name, fn in _ORIGINALS.items():
        setattr(_BASE, name, fn)


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route ``A2CBase.discount_values`` and ``discount_values_masks`` (and so every agent that
    inherits them) through rl_triton until ``unpatch()``. Idempotent. Thread-safe; shared with
    ``patched()`` blocks in any thread."""
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``: rl_games' own methods (the original function objects) are back at
    once, or when the last open ``patched()`` block closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``A2CBase``'s methods are routed through rl_triton now."""
    return _state.active


def patched():
    """``with patched(): ...``: ``A2CBase`` is patched for the block. Blocks nest, also across
    threads; rl_games' methods come back when the last holder (block or ``patch()``) lets go."""
    return _state.patched()
