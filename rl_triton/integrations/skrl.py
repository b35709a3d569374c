"""skrl (PyTorch agents, written against skrl 2.1.1): one fused GAE call, with skrl's
normalisation of the advantages, instead of the Python loop of ``compute_gae``.

    import rl_triton.integrations.skrl as rt_skrl
    rt_skrl.patch()           # every torch agent module that defines compute_gae
    agent = PPO(models=models, memory=memory, cfg=cfg, ...)    # skrl's own classes
    rt_skrl.unpatch()         # skrl's functions back, the same objects

or per agent, without patching, by changing the import (one line)::

    from rl_triton.integrations.skrl import PPO    # instead of skrl.agents.torch.ppo's

The agent classes here (``A2C``, ``A2C_RNN``, ``AMP``, ``PPO``, ``PPO_RNN``, ``RPO``,
``RPO_RNN``, ``TRPO``, ``TRPO_RNN``, ``IPPO``, ``MAPPO``) are skrl's, with ``update`` running
rl_triton's GAE; agents of skrl's own classes keep skrl's loop, also in other threads.

skrl defines ``compute_gae`` once per agent module (``FEED_FORWARD`` and ``RECURRENT`` name
them), in two signatures, and each agent's ``update`` calls its module's function by name:
``patch()`` sets that module attribute.

Conventions mapped here (docs/skrl.md): time-major ``(memory_size, num_envs, 1)`` tensors, as
skrl's memories hold them; ``terminated[t]``/``truncated[t]`` end the episode after step t;
``last_values`` is V of the observation after the window. In the loop every flag that ends a
trace also drops the bootstrap (skrl folds the time-limit bootstrap into the rewards at
collection): with ``time_limit_bootstrap`` both flags do (``done = terminated | truncated``),
without it only ``terminated`` does and a truncation neither cuts the trace nor the bootstrap;
the recurrent agents' function reads ``terminated`` only. The advantages are then normalised
over the whole rollout, ``(A - mean) / (std + 1e-8)`` with the unbiased std, after the returns
``A + values`` are formed. Where a function here raises, it raises what skrl's own function
raises on the same arguments, if that raises at all.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading

import torch
from skrl.agents.torch.a2c import a2c as _a2c
from skrl.agents.torch.a2c import a2c_rnn as _a2c_rnn
from skrl.agents.torch.amp import amp as _amp
from skrl.agents.torch.ppo import ppo as _ppo
from skrl.agents.torch.ppo import ppo_rnn as _ppo_rnn
from skrl.agents.torch.rpo import rpo as _rpo
from skrl.agents.torch.rpo import rpo_rnn as _rpo_rnn
from skrl.agents.torch.trpo import trpo as _trpo
from skrl.agents.torch.trpo import trpo_rnn as _trpo_rnn
from skrl.multi_agents.torch.ippo import ippo as _ippo
from skrl.multi_agents.torch.mappo import mappo as _mappo

from .. import gae
from ._patching import PatchState, error_of

__all__ = [
    "A2C", "A2C_RNN", "AMP", "FEED_FORWARD", "IPPO", "MAPPO", "PPO", "PPO_RNN", "RECURRENT", "RPO", "RPO_RNN",
    "TRPO", "TRPO_RNN", "compute_gae", "compute_gae_rnn", "is_patched", "patch", "patched", "unpatch",
]

# the modules whose compute_gae has the feed-forward signature (terminated, truncated,
# last_values, time_limit_bootstrap) and the recurrent one (terminated, next_values)
FEED_FORWARD = ("skrl.agents.torch.a2c.a2c", "skrl.agents.torch.amp.amp", "skrl.agents.torch.ppo.ppo",
                "skrl.agents.torch.rpo.rpo", "skrl.agents.torch.trpo.trpo", "skrl.multi_agents.torch.ippo.ippo",
                "skrl.multi_agents.torch.mappo.mappo")
RECURRENT = ("skrl.agents.torch.a2c.a2c_rnn", "skrl.agents.torch.ppo.ppo_rnn", "skrl.agents.torch.rpo.rpo_rnn",
             "skrl.agents.torch.trpo.trpo_rnn")
_MODULES = {name: importlib.import_module(name) for name in FEED_FORWARD + RECURRENT}
_ORIGINALS = {name: module.__dict__["compute_gae"] for name, module in _MODULES.items()}

# skrl's normalisation: (A - mean) / (std + eps), std with Bessel's correction
_EPS = 1e-8


def _normalized(adv: torch.Tensor) -> torch.Tensor:
    return (adv - adv.mean()) / (adv.std() + _EPS)


def _gae_normalized(rewards, values, done, last_values, gamma, lmbda):
    """``(returns, normalised advantages)`` of skrl's loop: every flag in ``done`` a termination."""
    for name, x in (("rewards", rewards), ("values", values), ("last_values", last_values), ("terminated", done)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if rewards.ndim < 1:
        raise ValueError(f"rewards must have a time dim (memory_size, ...), got shape {tuple(rewards.shape)}")
    # skrl accumulates into a tensor of the rewards' dtype and forms the returns with the values
    dtype = rewards.dtype
    v = values if values.dtype == dtype else values.to(dtype)
    boot = last_values.detach()
    boot = boot.to(dtype) if boot.dtype != dtype else boot
    if isinstance(gamma, (int, float)) and not isinstance(gamma, bool):
        # skrl multiplies the bool flags by the factor first, which gives a tensor of torch's
        # default dtype: its loop discounts by the factor rounded to that dtype
        gamma = torch.tensor(float(gamma), dtype=torch.get_default_dtype()).item()
    adv, returns = gae(rewards, v, done=done, bootstrap_value=boot, gamma=gamma, lmbda=lmbda, time_dim=0)
    if v is not values:
        returns = adv + values
    return returns, _normalized(adv)


def _raises_as_skrl(original):
    """Where the drop-in raises, raise what skrl's own function raises on the arguments, if it does."""

    def wrap(ours):
        @functools.wraps(ours)
        def call(**kwargs):
            try:
                return ours(**kwargs)
            except Exception:
                error = error_of(original, (), kwargs)
                if error is None:
                    raise
                raise error from None

        return call

    return wrap


@_raises_as_skrl(_ORIGINALS["skrl.agents.torch.ppo.ppo"])
def compute_gae(*, rewards: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor, values: torch.Tensor,
                last_values: torch.Tensor, discount_factor: float = 0.99, lambda_coefficient: float = 0.95,
                time_limit_bootstrap: bool = False):
    """skrl's feed-forward ``compute_gae`` as one fused scan: ``(returns, advantages)``.

    d[t] = terminated[t] | truncated[t] with ``time_limit_bootstrap``, else terminated[t];
    A[t] = r[t] - V[t] + gamma * (1 - d[t]) * (V[t+1] + lambda * A[t+1]), V[T] = last_values,
    A[T] = 0; returns = A + V; advantages = (A - mean(A)) / (std(A) + 1e-8), over all elements.
    Tensors are time-major ``(memory_size, num_envs, 1)``.
    """
    done = (terminated | truncated) if time_limit_bootstrap else terminated
    return _gae_normalized(rewards, values, done, last_values, discount_factor, lambda_coefficient)


@_raises_as_skrl(_ORIGINALS["skrl.agents.torch.ppo.ppo_rnn"])
def compute_gae_rnn(*, rewards: torch.Tensor, terminated: torch.Tensor, values: torch.Tensor,
                    next_values: torch.Tensor, discount_factor: float = 0.99, lambda_coefficient: float = 0.95):
    """skrl's ``compute_gae`` of the recurrent agents (``*_rnn`` modules) as one fused scan:
    ``(returns, advantages)``, the feed-forward recurrence with d[t] = terminated[t] and
    V[T] = ``next_values``."""
    return _gae_normalized(rewards, values, terminated, next_values, discount_factor, lambda_coefficient)


# -- patching ------------------------------------------------------------------------------
_lock = threading.Lock()
_modes = {"patch": False, "agents": 0}  # patch() in effect; this module's agents inside update()
_ROUTED = contextvars.ContextVar("rl_triton_skrl_routed", default=False)


def _ours(name: str):
    return compute_gae_rnn if name in RECURRENT else compute_gae


def _routed(name: str):
    """The module function while only this module's agents ask for rl_triton: theirs for the
    calls made inside such an agent's ``update``, skrl's own for every other caller."""
    ours, original = _ours(name), _ORIGINALS[name]

    @functools.wraps(original)
    def compute_gae(**kwargs):
        return (ours if _ROUTED.get() else original)(**kwargs)

    return compute_gae


_ROUTERS = {name: _routed(name) for name in _MODULES}


def _sync() -> None:
    """Set each module's ``compute_gae`` for the modes in effect (call with ``_lock`` held)."""
    for name, module in _MODULES.items():
        if _modes["patch"]:
            module.compute_gae = _ours(name)
        elif _modes["agents"]:
            module.compute_gae = _ROUTERS[name]
        else:
            module.compute_gae = _ORIGINALS[name]


def _set_patch(on: bool) -> None:
    with _lock:
        _modes["patch"] = on
        _sync()


_state = PatchState(lambda: _set_patch(True), lambda: _set_patch(False))


def patch() -> None:
    """Route ``compute_gae`` of every module in ``FEED_FORWARD`` and ``RECURRENT`` through
    rl_triton until ``unpatch()``: ``compute_gae`` or ``compute_gae_rnn`` by the module's
    signature. Idempotent. Thread-safe; shared with ``patched()`` blocks in any thread."""
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``: skrl's own functions (the original objects) are back at once, or
    when the last open ``patched()`` block closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``patch()`` or a ``patched()`` block routes skrl's ``compute_gae`` now."""
    return _state.active


def patched():
    """``with patched(): ...``: skrl's modules are patched for the block. Blocks nest, also
    across threads; skrl's functions come back when the last holder (block or ``patch()``)
    lets go."""
    return _state.patched()


@contextlib.contextmanager
def _routing():
    with _lock:
        _modes["agents"] += 1
        _sync()
    token = _ROUTED.set(True)
    try:
        yield
    finally:
        _ROUTED.reset(token)
        with _lock:
            _modes["agents"] -= 1
            _sync()


class _FusedUpdate:
    """Mixin: the agent's ``update`` computes its GAE with rl_triton."""

    def update(self, *args, **kwargs):
        with _routing():
            return super().update(*args, **kwargs)


class A2C(_FusedUpdate, _a2c.A2C):
    """skrl's ``A2C`` with the fused GAE."""


class A2C_RNN(_FusedUpdate, _a2c_rnn.A2C_RNN):
    """skrl's ``A2C_RNN`` with the fused GAE."""


class AMP(_FusedUpdate, _amp.AMP):
    """skrl's ``AMP`` with the fused GAE."""


class PPO(_FusedUpdate, _ppo.PPO):
    """skrl's ``PPO`` with the fused GAE: ``PPO(models=..., memory=..., cfg=..., ...)``."""


class PPO_RNN(_FusedUpdate, _ppo_rnn.PPO_RNN):
    """skrl's ``PPO_RNN`` with the fused GAE."""


class RPO(_FusedUpdate, _rpo.RPO):
    """skrl's ``RPO`` with the fused GAE."""


class RPO_RNN(_FusedUpdate, _rpo_rnn.RPO_RNN):
    """skrl's ``RPO_RNN`` with the fused GAE."""


class TRPO(_FusedUpdate, _trpo.TRPO):
    """skrl's ``TRPO`` with the fused GAE."""


class TRPO_RNN(_FusedUpdate, _trpo_rnn.TRPO_RNN):
    """skrl's ``TRPO_RNN`` with the fused GAE."""


class IPPO(_FusedUpdate, _ippo.IPPO):
    """skrl's multi-agent ``IPPO`` with the fused GAE."""


class MAPPO(_FusedUpdate, _mappo.MAPPO):
    """skrl's multi-agent ``MAPPO`` with the fused GAE."""
