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
The two methods need no rl_games for the form rl_games' agents pass; ``patch()``, ``register``
and the agent classes import it.

Conventions mapped here (docs/rl_games.md): time-major ``[horizon_length, N, K]`` rewards and
values (``K = value_size``, the value heads), ``mb_fdones[t]`` the done flag stored with obs t,
the one of the step before (an episode start) and ``fdones`` the live one after the last step:
rl_triton's observation-aligned flags, read in place (done[t] = mb_fdones[t+1], done[T-1] =
``fdones``, every done a termination, as rl_games folds the time-limit bootstrap into the
rewards), broadcast over the heads; V(s_T) is ``last_extrinsic_values``. With ``mb_masks``
(``[T, N]``) a masked step's advantage is 0 and nothing flows through it to the step before.
rl_games' trace factor gamma * tau * (1 - d[t]) is formed in the flags' dtype; where that rounds
it above gamma (float64 rollouts, float32 flags, tau = 1) the recurrence runs as one
``affine_scan`` on rl_games' per-step coefficients. Inputs of any other form (bool done flags
too), or a horizon that is not the tensors' length, take rl_games' own loop; where the fused
call raises, the method raises what rl_games' own method raises, if it does.

Normalisation over the ranks (opt-in): with ``global_normalisation`` (``patch()``'s argument, or
the field ``global_normalisation`` of the agent's config, ``params.config`` of the yaml) the
whole-batch normalisation of the advantages in ``prepare_dataset`` takes the mean and std of the
rollouts of every rank of a ``torch.distributed`` process group (``whiten=dict(group=...)``,
docs/distributed.md) instead of this process's; ``prepare_dataset`` is rl_games' own, after which
the dataset's advantages are normalised again with those statistics. Off by default, as
rl_games' multi-GPU runs normalise per rank; ``normalize_rms_advantage`` (running statistics)
is left as it is.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading

import torch

from .. import affine_scan, gae, masked_whiten
from ._patching import PatchState, error_of, normalisation_group, normalisation_setting, requires_framework, rounded

# the agent classes (AGENTS) are module attributes made on first access, not listed here
__all__ = ["AGENTS", "FusedDiscount", "METHODS", "RL_GAMES_VERSION", "discount_values", "discount_values_masks",
           "is_patched", "normalise_over_ranks", "patch", "patched", "register", "unpatch"]

RL_GAMES_VERSION = "1.6.5"  # the version these drop-ins were written and checked against
_A2C_COMMON = "rl_games.common.a2c_common"
METHODS = ("discount_values", "discount_values_masks")
# the agent classes here: name -> (rl_games' module, the algorithm name its Runner builds it for)
AGENTS = {"A2CAgent": ("rl_games.algos_torch.a2c_continuous", "a2c_continuous"),
          "DiscreteA2CAgent": ("rl_games.algos_torch.a2c_discrete", "a2c_discrete")}

_lock = threading.Lock()
_ORIGINALS: dict = {}  # method name -> A2CBase's function, as found when rl_games is first used here
# the classes whose prepare_dataset normalises the advantages -> that function, as found then
_PREPARE_CLASSES = ("DiscreteA2CBase", "ContinuousA2CBase")
_PREPARE: dict = {}


def _base():
    """rl_games' ``A2CBase``, imported on first use; its methods are recorded then.
    ``FrameworkNotInstalled`` where rl_games is not installed."""
    requires_framework(__name__, "rl_games", "rl_games", extra="rl-games")
    common = importlib.import_module(_A2C_COMMON)
    base = common.A2CBase
    with _lock:
        if not _ORIGINALS:
            _ORIGINALS.update({name: base.__dict__[name] for name in METHODS})
            _PREPARE.update({getattr(common, name): getattr(common, name).__dict__["prepare_dataset"]
                             for name in _PREPARE_CLASSES})
    return base


def _rl_games_method(name: str):
    """rl_games' own method, for its loop and its errors: None where rl_games is not imported."""
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    return _base().__dict__[name] if _A2C_COMMON in sys.modules else None


def _fused_form(agent, fdones, last_values, mb_fdones, mb_values, mb_rewards, mb_masks=None) -> bool:
    """Whether the arguments have the form the fused call maps (else rl_games' loop runs, which
    also raises rl_games' error for bool done flags: ``1.0 - flags`` takes no bool tensor)."""
    tensors = (fdones, last_values, mb_fdones, mb_values, mb_rewards) + (() if mb_masks is None else (mb_masks,))
    if not all(isinstance(x, torch.Tensor) for x in tensors) or mb_rewards.ndim != 3 \
            or torch.bool in (fdones.dtype, mb_fdones.dtype):
        return False
    T, N, K = mb_rewards.shape
    return (agent.horizon_length == T and mb_values.shape == (T, N, K) and last_values.shape == (N, K)
            and mb_fdones.shape == (T, N) and fdones.shape == (N,)
            and (mb_masks is None or mb_masks.shape == (T, N)))


def _trace_factor(gamma: float, tau: float, flags: torch.Tensor, dtype: torch.dtype) -> float:
    """lmbda for rl_triton such that gamma * lmbda is rl_games' trace factor: the loop multiplies
    ``gamma * tau`` by the flags' ``1 - done`` first, a tensor of the flags' float dtype (torch's
    default float dtype for integer flags). Above 1 where that rounding lifts the factor above
    gamma (float64 rollouts with float32 flags and ``tau = 1``)."""
    flag_dtype = flags.dtype if flags.is_floating_point() or flags.is_complex() else torch.get_default_dtype()
    if flag_dtype == dtype or gamma == 0:
        return tau
    return rounded(gamma * tau, flag_dtype) / gamma


def _advantages_by_steps(gamma, tau, fdones, last_values, mb_fdones, mb_values, mb_rewards, mb_masks):
    """rl_games' recurrence A[t] = m[t] * (delta[t] + c[t] * A[t+1]) as one ``affine_scan``, its
    coefficients formed as the loop forms them: delta[t] = r[t] + gamma * V[t+1] * (1 - d[t]) -
    V[t] and the trace factor c[t] = gamma * tau * (1 - d[t]) in the flags' dtype (a factor
    that ``gae``'s lmbda in [0, 1] cannot express where it rounds above gamma)."""
    not_done = torch.cat([1.0 - mb_fdones[1:], (1.0 - fdones).unsqueeze(0)]).unsqueeze(-1)
    next_values = torch.cat([mb_values[1:], last_values.unsqueeze(0)])
    delta = mb_rewards + gamma * next_values * not_done - mb_values
    trace = gamma * tau * not_done
    if mb_masks is not None:  # m * delta + (m * c) * A[t+1] is m * (delta + c * A[t+1]) for 0/1 masks
        mask = mb_masks.unsqueeze(-1)
        delta, trace = delta * mask, trace * mask
    return affine_scan(delta, trace.to(delta.dtype), time_dim=0).to(mb_rewards.dtype)


def _advantages(agent, fdones, last_values, mb_fdones, mb_values, mb_rewards, mb_masks=None):
    gamma, tau = float(agent.gamma), float(agent.tau)
    lmbda = _trace_factor(gamma, tau, fdones, mb_rewards.dtype)
    boot = last_values if last_values.dtype == mb_rewards.dtype else last_values.to(mb_rewards.dtype)
    values = mb_values if mb_values.dtype == mb_rewards.dtype else mb_values.to(mb_rewards.dtype)
    if lmbda > 1:
        return _advantages_by_steps(gamma, tau, fdones, boot, mb_fdones, values, mb_rewards, mb_masks)
    if mb_masks is not None:
        # a masked step t + 1 cuts the trace into step t (the advantages get the mask below)
        lmbda = torch.full(mb_rewards.shape[:2], lmbda, dtype=mb_rewards.dtype, device=mb_rewards.device)
        lmbda[:-1] *= mb_masks[1:]
    # [T, N, K] as [T, N * K], the kernels' plain time-major form, with the flags (and a per-step
    # lmbda) repeated over the heads: views for one head, a copy of the flags for several
    T, N, K = mb_rewards.shape

    def heads(x):
        return x if K == 1 else x.unsqueeze(-1).expand(*x.shape, K).reshape(*x.shape[:-1], N * K)

    if isinstance(lmbda, torch.Tensor):
        lmbda = heads(lmbda)
    adv, _ = gae(mb_rewards.reshape(T, N * K), values.reshape(T, N * K), episode_starts=heads(mb_fdones),
                 last_done=heads(fdones), bootstrap_value=boot.reshape(N * K), gamma=gamma, lmbda=lmbda, time_dim=0)
    adv = adv.reshape(mb_rewards.shape)
    if mb_masks is not None:
        adv *= mb_masks.unsqueeze(-1)
    return adv


def _fused(name: str):
    def method(self, *args):
        if not _fused_form(self, *args):
            original = _rl_games_method(name)
            if original is None:
                raise ValueError(f"{name}: these arguments need rl_games' own loop (shapes other than "
                                 "[T, N, K] values with [T, N] flags, a horizon_length that is not T, or "
                                 "bool done flags), and rl_games is not imported")
            return original(self, *args)
        try:
            return _advantages(self, *args)
        except Exception:
            original = _rl_games_method(name)
            error = None if original is None else error_of(original, (self, *args), {})
            if error is None:
                raise
            raise error from None

    method.__name__ = method.__qualname__ = name
    return method


discount_values = _fused("discount_values")
discount_values.__doc__ = """rl_games' ``A2CBase.discount_values`` as one fused scan: the advantages
``[T, N, K]``.

delta[t] = r[t] + gamma * (1 - d[t]) * V[t+1] - V[t], A[t] = delta[t] + gamma * tau * (1 - d[t]) *
A[t+1], with d[t] = mb_fdones[t+1], d[T-1] = fdones, V[T] = last_extrinsic_values, A[T] = 0.

Args:
    self: the agent (an ``A2CBase``), whose ``gamma``, ``tau`` and ``horizon_length`` it reads.
    *args: rl_games' positional arguments, ``(fdones, last_extrinsic_values, mb_fdones,
        mb_extrinsic_values, mb_rewards)``: ``fdones`` ``[N]``, the done flags after the last step;
        ``last_extrinsic_values`` ``[N, K]``, V(s_T); ``mb_fdones`` ``[T, N]``, the done flag stored
        with each observation (that of the step before); ``mb_extrinsic_values`` and
        ``mb_rewards`` ``[T, N, K]`` (``K`` value heads). Other forms take rl_games' own loop.
"""
discount_values_masks = _fused("discount_values_masks")
discount_values_masks.__doc__ = """rl_games' ``A2CBase.discount_values_masks`` as one fused scan:
A[t] = m[t] * (delta[t] + gamma * tau * (1 - d[t]) * A[t+1]), ``discount_values``' recurrence with
the step mask ``mb_masks`` ``[T, N]``.

Args:
    self: the agent (an ``A2CBase``), whose ``gamma``, ``tau`` and ``horizon_length`` it reads.
    *args: ``discount_values``' five arguments, then ``mb_masks`` ``[T, N]`` (nonzero: the step
        counts; a masked step's advantage is 0 and nothing flows through it to the step before).
"""


def _global_group(agent):
    """The process group of the agent's advantage statistics: its config's
    ``global_normalisation`` where that is set to other than False, else ``patch()``'s."""
    config = getattr(agent, "config", None)
    setting = config.get("global_normalisation", False) if isinstance(config, dict) else False
    if setting is False:
        setting = _state.settings(_DEFAULTS)["global_normalisation"]
    return normalisation_group(normalisation_setting(setting, "config['global_normalisation']"))


def normalise_over_ranks(agent, batch_dict) -> None:
    """After rl_games' ``prepare_dataset``: where the agent asks for ``global_normalisation`` and
    normalises its advantages over the whole batch (``normalize_advantage`` on,
    ``normalize_rms_advantage`` off), its dataset's advantages again, with the statistics of
    every rank's batch: A = sum over the value heads of (returns - values), then (A - mean) /
    (std + 1e-8), mean and unbiased std over the valid elements (``rnn_masks`` nonzero, or all)
    of every rank of the group. Otherwise nothing.

    Args:
        agent: the agent (an ``A2CBase``) whose ``prepare_dataset`` ran on ``batch_dict``.
        batch_dict: rl_games' batch: ``returns`` and ``values`` ``[B, K]``, ``rnn_masks``
            (None, or one flag per element of the batch's advantages).
    """
    group = _global_group(agent)
    if group is None or not agent.normalize_advantage or agent.normalize_rms_advantage:
        return
    advantages = torch.sum(batch_dict["returns"] - batch_dict["values"], dim=1)
    masks = batch_dict.get("rnn_masks", None) if agent.is_rnn else None
    if masks is not None:
        masks = masks.reshape(advantages.shape)
    advantages = masked_whiten(advantages, masks, eps_mode="std", group=group)
    agent.dataset.values_dict["advantages"] = advantages
    if agent.has_central_value:
        agent.central_value_net.dataset.values_dict["advantages"] = advantages


def _prepare_dataset(cls):
    def prepare_dataset(self, batch_dict):
        _PREPARE[cls](self, batch_dict)
        normalise_over_ranks(self, batch_dict)

    prepare_dataset.__qualname__ = f"{cls.__name__}.prepare_dataset"
    prepare_dataset.__doc__ = (f"rl_games' ``{cls.__name__}.prepare_dataset``, then ``normalise_over_ranks`` "
                               "(nothing more without ``global_normalisation``).")
    return prepare_dataset


class FusedDiscount:
    """Mixin for agents derived from ``A2CBase``: both methods through rl_triton, and the
    advantages normalised over the ranks after ``prepare_dataset`` where the agent's config (or
    ``patch()``) sets ``global_normalisation`` (``normalise_over_ranks``)."""

    discount_values = discount_values
    discount_values_masks = discount_values_masks

    def prepare_dataset(self, batch_dict):
        super().prepare_dataset(batch_dict)
        normalise_over_ranks(self, batch_dict)


def __getattr__(name: str):
    """The agent classes (``AGENTS``), made from rl_games' on first access: rl_games' class with
    ``FusedDiscount`` first in its bases, under rl_games' name."""
    if name not in AGENTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _base()
    rl_games_cls = getattr(importlib.import_module(AGENTS[name][0]), name)
    cls = type(name, (FusedDiscount, rl_games_cls), {"__module__": __name__, "__qualname__": name,
                                                     "__doc__": f"rl_games' ``{name}`` with the fused GAE."})
    with _lock:
        cls = globals().setdefault(name, cls)
    return cls


def register(runner) -> None:
    """Make ``runner`` (an ``rl_games.torch_runner.Runner``) build ``A2CAgent`` and
    ``DiscreteA2CAgent`` for the algorithm names ``a2c_continuous`` and ``a2c_discrete``; its
    players and other algorithms stay as they are.

    Args:
        runner: an rl_games ``Runner``, changed in place (``TypeError`` for an object without an
            ``algo_factory``).
    """
    factory = getattr(runner, "algo_factory", None)
    if factory is None or not callable(getattr(factory, "register_builder", None)):
        raise TypeError(f"runner must be an rl_games Runner (with an algo_factory), got {type(runner).__name__}")
    for name, (_, algo) in AGENTS.items():
        factory.register_builder(algo, functools.partial(_build, __getattr__(name)))


def _build(cls, **kwargs):
    return cls(**kwargs)


def _apply() -> None:
    base = _base()
    base.discount_values = discount_values
    base.discount_values_masks = discount_values_masks
    for cls in _PREPARE:
        cls.prepare_dataset = _prepare_dataset(cls)


def _restore() -> None:
    base = _base()
    for name, fn in _ORIGINALS.items():
        setattr(base, name, fn)
    for cls, fn in _PREPARE.items():
        cls.prepare_dataset = fn


_state = PatchState(_apply, _restore)
_DEFAULTS = {"global_normalisation": False}


def patch(global_normalisation=False) -> None:
    """Route ``A2CBase.discount_values`` and ``discount_values_masks`` (and so every agent that
    inherits them) through rl_triton until ``unpatch()``, and ``prepare_dataset`` of
    ``DiscreteA2CBase`` and ``ContinuousA2CBase`` through ``normalise_over_ranks`` after
    rl_games' own. Imports rl_games. Idempotent. Thread-safe; shared with ``patched()`` blocks
    in any thread; a later call's setting replaces an earlier one's.

    Args:
        global_normalisation: False (default): the advantages are normalised with the statistics
            of this process's batch, as rl_games'; True: of the batches of every rank of the
            default process group (``dist.group.WORLD``, read at each call; this process's alone
            where ``torch.distributed`` is not initialised); a ``torch.distributed``
            ProcessGroup: of its ranks. ``TypeError`` for other values. An agent whose config
            sets ``global_normalisation`` (to other than False) uses that instead.
    """
    _state.patch({"global_normalisation": normalisation_setting(global_normalisation)})


def unpatch() -> None:
    """Withdraw ``patch()``: rl_games' own methods (the original function objects) are back at
    once, or when the last open ``patched()`` block closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``A2CBase``'s methods are routed through rl_triton now."""
    return _state.active


def patched(global_normalisation=False):
    """``with patched(): ...``: ``A2CBase`` is patched for the block. Blocks nest, also across
    threads; rl_games' methods come back when the last holder (block or ``patch()``) lets go.

    Args:
        global_normalisation: as for ``patch()``, in effect while this block is the most recent
            holder.
    """
    return _state.patched({"global_normalisation": normalisation_setting(global_normalisation)})
