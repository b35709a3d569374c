"""skrl (PyTorch agents, written against skrl 2.1.1): one fused GAE call, with skrl's
normalisation of the advantages, instead of the Python loop of ``compute_gae``.

    import rl_triton.integrations.skrl as rt_skrl
    rt_skrl.patch()           # every torch agent module that defines compute_gae
    rt_skrl.patch(global_normalisation=True)   # the same, statistics over every rank
    agent = PPO(models=models, memory=memory, cfg=cfg, ...)    # skrl's own classes
    rt_skrl.unpatch()         # skrl's functions back, the same objects

or per agent, without patching, by changing the import (one line)::

    from rl_triton.integrations.skrl import PPO    # instead of skrl.agents.torch.ppo's

The agent classes here (``A2C``, ``A2C_RNN``, ``AMP``, ``PPO``, ``PPO_RNN``, ``RPO``,
``RPO_RNN``, ``TRPO``, ``TRPO_RNN``, ``IPPO``, ``MAPPO``) are skrl's, with ``update`` running
rl_triton's GAE (``FusedUpdate``, the mixin, for one's own subclasses); agents of skrl's own
classes keep skrl's loop, also in other threads. ``compute_gae`` and ``compute_gae_rnn`` need
no skrl; ``patch()`` and the agent classes import it.

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

With ``global_normalisation`` (``patch()``'s argument, or the attribute of an agent of the classes
here) the mean and std span the rollouts of every rank of a ``torch.distributed`` process group
(``whiten=dict(group=...)``, docs/distributed.md) instead of this process's: the statistics of the
concatenated rollouts. Off by default, as skrl's distributed runs normalise per rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import sys
import threading

import torch

from .. import gae, masked_whiten
from ..core.docstrings import documented
from ._patching import PatchState, error_of, normalisation_group, normalisation_setting, requires_framework, rounded

# the agent classes (AGENTS) are module attributes made on first access, not listed here
__all__ = ["AGENTS", "FEED_FORWARD", "FusedUpdate", "RECURRENT", "SKRL_VERSION", "compute_gae", "compute_gae_rnn",
           "is_patched", "patch", "patched", "unpatch"]

SKRL_VERSION = "2.1.1"  # the version these drop-ins were written and checked against
# the modules whose compute_gae has the feed-forward signature (terminated, truncated,
# last_values, time_limit_bootstrap) and the recurrent one (terminated, next_values)
FEED_FORWARD = ("skrl.agents.torch.a2c.a2c", "skrl.agents.torch.amp.amp", "skrl.agents.torch.ppo.ppo",
                "skrl.agents.torch.rpo.rpo", "skrl.agents.torch.trpo.trpo", "skrl.multi_agents.torch.ippo.ippo",
                "skrl.multi_agents.torch.mappo.mappo")
RECURRENT = ("skrl.agents.torch.a2c.a2c_rnn", "skrl.agents.torch.ppo.ppo_rnn", "skrl.agents.torch.rpo.rpo_rnn",
             "skrl.agents.torch.trpo.trpo_rnn")
# the agent classes here: name -> skrl's module that defines it
AGENTS = {"A2C": "skrl.agents.torch.a2c.a2c", "A2C_RNN": "skrl.agents.torch.a2c.a2c_rnn",
          "AMP": "skrl.agents.torch.amp.amp", "PPO": "skrl.agents.torch.ppo.ppo",
          "PPO_RNN": "skrl.agents.torch.ppo.ppo_rnn", "RPO": "skrl.agents.torch.rpo.rpo",
          "RPO_RNN": "skrl.agents.torch.rpo.rpo_rnn", "TRPO": "skrl.agents.torch.trpo.trpo",
          "TRPO_RNN": "skrl.agents.torch.trpo.trpo_rnn", "IPPO": "skrl.multi_agents.torch.ippo.ippo",
          "MAPPO": "skrl.multi_agents.torch.mappo.mappo"}

_lock = threading.Lock()
_MODULES: dict = {}  # module name -> module, once skrl is imported by patching or an agent class
_ORIGINALS: dict = {}  # module name -> skrl's compute_gae there, as found on first import


def _load() -> dict:
    """skrl's agent modules, imported on first use; their functions are recorded then.
    ``FrameworkNotInstalled`` where skrl is not installed."""
    requires_framework(__name__, "skrl", "skrl", extra="skrl")
    with _lock:
        if not _MODULES:
            for name in FEED_FORWARD + RECURRENT:
                module = importlib.import_module(name)
                _ORIGINALS[name] = module.__dict__["compute_gae"]
                _MODULES[name] = module
    return _MODULES


def _skrl_function(recurrent: bool):
    """skrl's own function of that signature, for the error path: None where skrl's agent
    modules are not imported."""
    name = RECURRENT[1] if recurrent else FEED_FORWARD[2]
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    module = sys.modules.get(name)
    fn = None if module is None else getattr(module, "compute_gae", None)
    return None if fn is None or fn in (compute_gae, compute_gae_rnn) else fn


# skrl's normalisation, (A - mean) / (std + 1e-8) with the unbiased std, as masked_whiten keywords
_WHITEN = {"eps_mode": "std", "eps": 1e-8}


def _group():
    """The process group of the normalisation's statistics for this call: the setting of the
    agent whose ``update`` runs (agents of the classes here), else ``patch()``'s."""
    setting = _AGENT_SETTING.get()
    if setting is None:
        setting = _state.settings(_DEFAULTS)["global_normalisation"]
    return normalisation_group(setting)


def _gae_normalized(rewards, values, done, last_values, gamma, lmbda):
    """``(returns, normalised advantages)`` of skrl's loop: every flag in ``done`` a termination;
    the statistics over the ranks of ``_group()``, where it is not None."""
    group = _group()
    whiten = _WHITEN if group is None else dict(_WHITEN, group=group)
    for name, x in (("rewards", rewards), ("values", values), ("last_values", last_values), ("terminated", done)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if rewards.ndim < 1:
        raise ValueError(f"rewards must have a time dim (memory_size, ...), got shape {tuple(rewards.shape)}")
    # skrl accumulates into a tensor of the rewards' dtype and forms the returns with the values
    dtype = rewards.dtype
    v = values if values.dtype == dtype else values.to(dtype)
    boot = last_values if last_values.dtype == dtype else last_values.to(dtype)
    if isinstance(gamma, (int, float)) and not isinstance(gamma, bool):
        # skrl multiplies the bool flags by the factor first, which gives a tensor of torch's
        # default dtype: its loop discounts by the factor rounded to that dtype
        gamma = rounded(float(gamma), torch.get_default_dtype())
    # one call, the normalisation fused, where skrl's returns are the value targets it forms
    fused = v is values and not (torch.is_grad_enabled() and any(x.requires_grad for x in (rewards, values, boot)))
    shape = rewards.shape
    if rewards.ndim > 2 and v.shape == shape and boot.shape == shape[1:] and done.ndim == len(shape) \
            and all(d in (1, n) for d, n in zip(done.shape, shape)):
        # [T, N, 1] as [T, N] (views of contiguous memories; flags that broadcast over trailing
        # dims are repeated): every element is its own row of the scan and of the statistics
        # alike, the kernels' plain time-major form
        rewards, v, done = (x.expand(shape).flatten(1) for x in (rewards, v, done))
        boot = boot.reshape(-1)
    adv, returns = gae(rewards, v, done=done, bootstrap_value=boot, gamma=gamma, lmbda=lmbda, time_dim=0,
                       whiten=whiten if fused else False)
    adv, returns = adv.reshape(shape), returns.reshape(shape)
    if fused:
        return returns, adv
    return adv + values, masked_whiten(adv, **whiten)


def _raises_as_skrl(recurrent: bool):
    """Where the drop-in raises and skrl is imported, raise what skrl's own function raises on
    the arguments, if it does."""

    def wrap(ours):
        @functools.wraps(ours)
        def call(**kwargs):
            try:
                return ours(**kwargs)
            except Exception:
                original = _skrl_function(recurrent)
                error = None if original is None else error_of(original, (), kwargs)
                if error is None:
                    raise
                raise error from None

        return call

    return wrap


# the arguments of skrl's two signatures (all keyword-only, as skrl's)
_ARGS = {
    "rewards": ("``r[t]``, a float tensor, time-major ``(memory_size, num_envs, 1)`` as skrl's memories hold it; "
                "the outputs have its shape and dtype."),
    "terminated": ("``terminated[t]``: the episode ended after step t at a terminal state (no bootstrap, and the "
                   "trace stops); bool flags of the rewards' shape."),
    "truncated": ("``truncated[t]``: the episode was cut after step t; it ends the trace and the bootstrap only "
                  "with ``time_limit_bootstrap``; bool flags of the rewards' shape."),
    "values": "``V[t]``, the rewards' shape; cast to their dtype.",
    "discount_factor": "gamma, the discount, a number in [0, 1].",
    "lambda_coefficient": "lambda, the GAE lambda, a number in [0, 1].",
}


@_raises_as_skrl(recurrent=False)
@documented(
    _ARGS,
    last_values=("``V[T]``, the value of the observation after the window, ``(num_envs, 1)``; cast to the "
                 "rewards' dtype."),
    time_limit_bootstrap=("a bool: True makes ``d[t] = terminated[t] | truncated[t]``, False ``d[t] = "
                          "terminated[t]`` (a truncation then cuts neither the trace nor the bootstrap), as in "
                          "skrl's loop."),
)
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


@_raises_as_skrl(recurrent=True)
@documented(_ARGS, next_values="``V[T]``, the value after the window's last step, ``(num_envs, 1)``, as "
                               "``last_values`` of ``compute_gae``.")
def compute_gae_rnn(*, rewards: torch.Tensor, terminated: torch.Tensor, values: torch.Tensor,
                    next_values: torch.Tensor, discount_factor: float = 0.99, lambda_coefficient: float = 0.95):
    """skrl's ``compute_gae`` of the recurrent agents (``*_rnn`` modules) as one fused scan:
    ``(returns, advantages)``, the feed-forward recurrence with d[t] = terminated[t] and
    V[T] = ``next_values``."""
    return _gae_normalized(rewards, values, terminated, next_values, discount_factor, lambda_coefficient)


# -- patching ------------------------------------------------------------------------------
_modes = {"patch": False, "agents": 0}  # patch() in effect; this module's agents inside update()
_ROUTED = contextvars.ContextVar("rl_triton_skrl_routed", default=False)
# the global_normalisation of the agent whose update() runs in this context; None outside one
_AGENT_SETTING = contextvars.ContextVar("rl_triton_skrl_normalisation", default=None)
_ROUTERS: dict = {}


def _ours(name: str):
    return compute_gae_rnn if name in RECURRENT else compute_gae


def _router(name: str):
    """The module function while only this module's agents ask for rl_triton: theirs for the
    calls made inside such an agent's ``update``, skrl's own for every other caller."""
    ours, original = _ours(name), _ORIGINALS[name]

    @functools.wraps(original)
    def compute_gae(**kwargs):
        return (ours if _ROUTED.get() else original)(**kwargs)

    return compute_gae


def _sync() -> None:
    """Set each module's ``compute_gae`` for the modes in effect (call with ``_lock`` held)."""
    for name, module in _MODULES.items():
        if _modes["patch"]:
            module.compute_gae = _ours(name)
        elif _modes["agents"]:
            if name not in _ROUTERS:
                _ROUTERS[name] = _router(name)
            module.compute_gae = _ROUTERS[name]
        else:
            module.compute_gae = _ORIGINALS[name]


def _set_patch(on: bool) -> None:
    _load()
    with _lock:
        _modes["patch"] = on
        _sync()


_state = PatchState(lambda: _set_patch(True), lambda: _set_patch(False))
_DEFAULTS = {"global_normalisation": False}
_GLOBAL_NORMALISATION = (
    "False (default): the advantages are normalised with the statistics of this process's rollout, as "
    "skrl's; True: of the rollouts of every rank of the default process group (``dist.group.WORLD``, "
    "read at each call; this process's alone where ``torch.distributed`` is not initialised); a "
    "``torch.distributed`` ProcessGroup: of its ranks. ``(A - mean) / (std + 1e-8)`` with the mean "
    "and unbiased std of all ranks' advantages concatenated. ``TypeError`` for other values.")


@documented(global_normalisation=_GLOBAL_NORMALISATION + " An agent of this module's classes uses its own "
                                                             "``global_normalisation`` attribute instead.")
def patch(global_normalisation=False) -> None:
    """Route ``compute_gae`` of every module in ``FEED_FORWARD`` and ``RECURRENT`` through
    rl_triton until ``unpatch()``: ``compute_gae`` or ``compute_gae_rnn`` by the module's
    signature. Imports skrl's agent modules. Idempotent. Thread-safe; shared with
    ``patched()`` blocks in any thread; a later call's setting replaces an earlier one's."""
    _state.patch({"global_normalisation": normalisation_setting(global_normalisation)})


def unpatch() -> None:
    """Withdraw ``patch()``: skrl's own functions (the original objects) are back at once, or
    when the last open ``patched()`` block closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``patch()`` or a ``patched()`` block routes skrl's ``compute_gae`` now."""
    return _state.active


def patched(global_normalisation=False):
    """``with patched(): ...``: skrl's modules are patched for the block. Blocks nest, also
    across threads; skrl's functions come back when the last holder (block or ``patch()``)
    lets go.

    Args:
        global_normalisation: as for ``patch()``, in effect while this block is the most recent
            holder.
    """
    return _state.patched({"global_normalisation": normalisation_setting(global_normalisation)})


@contextlib.contextmanager
def _routing():
    _load()
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


class FusedUpdate:
    """Mixin for skrl agents (subclasses of the classes in ``AGENTS``): ``update`` computes the
    GAE with rl_triton; every other caller of skrl's ``compute_gae`` keeps skrl's loop.

    ``global_normalisation`` (a class attribute, False; set it on the agent or on a subclass,
    read at each ``update``): False normalises the advantages with this process's rollout, as
    skrl does; True with the rollouts of every rank of ``dist.group.WORLD`` (this process's
    alone where ``torch.distributed`` is not initialised); a ``torch.distributed`` ProcessGroup
    with those of its ranks. ``TypeError`` at ``update`` for other values."""

    global_normalisation = False

    def update(self, *args, **kwargs):
        setting = normalisation_setting(self.global_normalisation)
        token = _AGENT_SETTING.set(setting)
        try:
            with _routing():
                return super().update(*args, **kwargs)
        finally:
            _AGENT_SETTING.reset(token)


def __getattr__(name: str):
    """The agent classes (``AGENTS``), made from skrl's on first access: skrl's class with
    ``FusedUpdate`` first in its bases, under skrl's name."""
    if name not in AGENTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base = getattr(_load()[AGENTS[name]], name)
    cls = type(name, (FusedUpdate, base), {"__module__": __name__, "__qualname__": name,
                                            "__doc__": f"skrl's ``{name}`` with the fused GAE."})
    with _lock:
        cls = globals().setdefault(name, cls)
    return cls
