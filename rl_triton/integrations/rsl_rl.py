"""rsl_rl (rsl-rl-lib): one fused GAE-plus-normalisation call instead of the Python loop over the
rollout and the normalisation after it.

    # rsl-rl-lib 3.3 and later, no patching: the algorithm of the train config
    train_cfg["algorithm"]["class_name"] = "rl_triton.integrations.rsl_rl:PPO"
    runner = OnPolicyRunner(env, train_cfg, device="cuda")

    import rl_triton.integrations.rsl_rl as rt_rsl
    rt_rsl.patch()            # every PPO (subclasses too), whatever builds it
    rt_rsl.patch(global_normalisation=True)   # the same, statistics over every rank
    ...
    rt_rsl.unpatch()          # the original method, the same function object

Two layouts. From rsl-rl-lib 3.2 on the loop is in ``PPO.compute_returns(obs)``, which
``patch()`` replaces; up to 3.1 it is in ``RolloutStorage.compute_returns(last_values, gamma,
lam, normalize_advantage)``, which ``patch()`` replaces there (those runners build the algorithm
with ``eval``, so their config cannot name a class of another module; :class:`PPO` still works
when constructed directly). Tested: 5.5.1 and 3.1.3 (docs/rsl_rl.md).

What is kept of the method: the bootstrap value V(s_T) from the installed version's own call
(``self.critic(obs)``, or ``self.policy.evaluate(obs)`` before 4.0), the critic's hidden state
saved around that call where the installed version does so (5.3 on), and the normalisation only
where ``normalize_advantage_per_mini_batch`` is off. Time-outs and RND's intrinsic rewards are
folded into the stored rewards before this method runs (``process_env_step``), so they reach
the call through ``storage.rewards``.

Conventions mapped (docs/semantics.md, sections 4 and 15): the storage is time-major ``[T, N,
1]`` (``time_dim=0``); ``dones[t]`` (uint8) ends the episode at step t and cuts both the
bootstrap and the trace (``done=``, every done a termination); the next value is
``values[t+1]``, and V(s_T) the last values (``bootstrap_value=``); the normalisation is
``(A - A.mean()) / (A.std() + 1e-8)`` over the whole batch (``whiten=dict(eps_mode="std")``).
With ``global_normalisation`` (``patch()``'s argument, or :class:`PPO`'s, as
``train_cfg["algorithm"]["global_normalisation"] = True``) the mean and std span the rollouts of
every rank of a ``torch.distributed`` process group (``whiten=dict(group=...)``, docs/distributed.md)
instead of this process's: the statistics of the concatenated rollouts, each rank's advantages
normalised with them. Off by default, as rsl_rl's multi-GPU runs normalise per rank.
``storage.returns`` is written in place and ``storage.advantages`` rebound to a new tensor, as
rsl_rl does. Storage that is not what these versions allocate (other shapes, non-float values),
and last values that the fused call does not take (a critic with 2 outputs for 1-value storage),
go to rsl_rl's own method as it was before ``patch()``, with its own behaviour and errors.
"""

from __future__ import annotations

import torch

from ._patching import requires_framework

requires_framework(__name__, "rsl_rl (rsl-rl-lib)", "rsl_rl", extra="rsl-rl")

from rsl_rl.algorithms import ppo as _ppo  # noqa: E402
from rsl_rl.storage import rollout_storage as _storage  # noqa: E402

from .. import gae, masked_whiten  # noqa: E402
from ._patching import PatchState, normalisation_group, normalisation_setting  # noqa: E402

__all__ = ["PPO", "compute_returns", "is_patched", "patch", "patched", "storage_compute_returns", "unpatch"]

_RslPPO = _ppo.PPO
_Storage = _storage.RolloutStorage
# up to 3.1 the loop is the storage's method, and PPO.compute_returns calls it
STORAGE_LAYOUT = "compute_returns" in vars(_Storage)
_ORIGINAL = (_Storage if STORAGE_LAYOUT else _RslPPO).__dict__["compute_returns"]
# PPO's own method, read before patch() can replace it: the fallback of this module's method
_PPO_ORIGINAL = _RslPPO.__dict__["compute_returns"]
# what the installed version's PPO.compute_returns calls, read from its code: the critic (4.0
# on; the actor-critic's ``policy.evaluate`` before) and the hidden state kept around it (5.3 on)
_PPO_NAMES = _PPO_ORIGINAL.__code__.co_names
_HAS_CRITIC = "critic" in _PPO_NAMES
_KEEPS_HIDDEN_STATE = "get_hidden_state" in _PPO_NAMES
_WHITEN = dict(eps_mode="std")  # rsl_rl's (A - mean) / (std + 1e-8), torch's unbiased std


def _mapped(storage) -> bool:
    """Whether the storage holds what these versions allocate: float rewards, values and
    returns of one dtype and the dones, all ``[T, N, ...]`` of one shape on one device."""
    tensors = (storage.rewards, storage.values, storage.dones, storage.returns)
    if not all(isinstance(x, torch.Tensor) for x in tensors):
        return False
    rewards, values, dones, returns = tensors
    return values.ndim >= 2 and values.is_floating_point() and rewards.dtype == returns.dtype == values.dtype \
        and rewards.shape == dones.shape == returns.shape == values.shape and len({x.device for x in tensors}) == 1


def _fused(storage, last_values: torch.Tensor, gamma, lam, normalize: bool, group=None) -> bool:
    """GAE (and the normalisation, its statistics over ``group``'s ranks where it is not None)
    into ``storage.returns`` (in place) and a new ``storage.advantages``, for a storage that
    ``_mapped`` accepts. False where ``gae`` rejects the arguments (e.g. the last values of a
    critic with 2 outputs): rsl_rl's own method then runs and writes the storage anew, with its
    result or its error."""
    values = storage.values
    if last_values.dtype != values.dtype:
        last_values = last_values.to(values.dtype)  # rsl_rl's loop promotes; the storage's dtype is the result's
    advantages = torch.empty_like(values)
    try:
        gae(storage.rewards, values, bootstrap_value=last_values, done=storage.dones, gamma=float(gamma),
            lmbda=float(lam), time_dim=0, whiten=_whiten(normalize, group), out=(advantages, storage.returns))
    except (TypeError, ValueError):
        return False
    storage.advantages = advantages
    return True


def _whiten(normalize: bool, group):
    if not normalize:
        return False
    return _WHITEN if group is None else dict(_WHITEN, group=group)


def _renormalize(storage, normalize: bool, group) -> None:
    """After rsl_rl's own method ran with ``global_normalisation``: its advantages, returns
    minus values, normalised again with the statistics over ``group``'s ranks."""
    if normalize and group is not None:
        storage.advantages = masked_whiten(storage.returns - storage.values, group=group, **_WHITEN)


def _settings_group():
    return normalisation_group(_state.settings(_DEFAULTS)["global_normalisation"])


def compute_returns(self, obs) -> None:
    """``PPO.compute_returns`` (rsl-rl-lib 3.2 on) with the loop and the normalisation as one
    fused call; see the module docstring. The normalisation's statistics span the ranks where
    ``patch(global_normalisation=...)`` asks for it.

    Args:
        self: rsl_rl's ``PPO``, whose ``storage`` it reads and writes.
        obs: the observations after the rollout's last step, from which the critic gives the
            bootstrap value V(s_T), as rsl_rl's method does.
    """
    _compute_returns(self, obs, _settings_group())


def _compute_returns(self, obs, group) -> None:
    normalize = not self.normalize_advantage_per_mini_batch
    if STORAGE_LAYOUT or not _mapped(self.storage):  # up to 3.1 PPO's part, then the storage's method
        _PPO_ORIGINAL(self, obs)
        return _renormalize(self.storage, normalize, group)
    if _HAS_CRITIC:
        hidden = self.critic.get_hidden_state() if _KEEPS_HIDDEN_STATE else None
        last_values = self.critic(obs).detach()
        if _KEEPS_HIDDEN_STATE:  # the bootstrap pass must not advance a recurrent critic's state
            self.critic.reset(hidden_state=hidden)
    else:
        last_values = self.policy.evaluate(obs).detach()
    if not _fused(self.storage, last_values, self.gamma, self.lam, normalize, group):
        _PPO_ORIGINAL(self, obs)  # with its own bootstrap pass (the critic's state restored above, 5.3 on)
        _renormalize(self.storage, normalize, group)


def storage_compute_returns(self, last_values, gamma, lam, normalize_advantage: bool = True) -> None:
    """``RolloutStorage.compute_returns`` (rsl-rl-lib up to 3.1) as one fused call.

    Args:
        self: rsl_rl's ``RolloutStorage``; ``returns`` is written in place and ``advantages``
            rebound to a new tensor.
        last_values: V(s_T) after the rollout's last step, ``[N, 1]`` as the storage's values
            (cast to their dtype). Where it is not a tensor, or the fused call rejects it (the
            last values of a critic with 2 outputs), rsl_rl's own method runs.
        gamma: the discount, a number in [0, 1].
        lam: the GAE lambda, a number in [0, 1].
        normalize_advantage: whether to normalise the advantages over the whole batch,
            ``(A - A.mean()) / (A.std() + 1e-8)`` (over every rank's batch where
            ``patch(global_normalisation=...)`` asks for it).
    """
    _storage_compute_returns(self, last_values, gamma, lam, normalize_advantage, _settings_group())


def _storage_compute_returns(self, last_values, gamma, lam, normalize_advantage, group) -> None:
    if not _mapped(self) or not isinstance(last_values, torch.Tensor) \
            or not _fused(self, last_values, gamma, lam, normalize_advantage, group):
        _ORIGINAL(self, last_values, gamma, lam, normalize_advantage)
        _renormalize(self, normalize_advantage, group)


class PPO(_RslPPO):
    """rsl_rl's ``PPO`` with the fused GAE and normalisation:
    ``algorithm.class_name = "rl_triton.integrations.rsl_rl:PPO"`` (rsl-rl-lib 3.3 on, whose
    runners resolve ``module:Class`` names; up to 3.1 construct it directly).

    Args:
        *args: rsl_rl's ``PPO`` positional arguments, as the installed version takes them.
        global_normalisation: False (default): the whole-batch normalisation uses this process's
            rollout, as rsl_rl's; True: the rollouts of every rank of the default process group
            (``dist.group.WORLD``; one process's own where ``torch.distributed`` is not
            initialised); a ``torch.distributed`` ProcessGroup: those of its ranks. Each rank's
            advantages are ``(A - mean) / (std + 1e-8)`` with the mean and unbiased std of the
            concatenated rollouts. ``TypeError`` for other values. ``patch()``'s setting does not
            apply to this class.
        **kwargs: rsl_rl's ``PPO`` keyword arguments.
    """

    def __init__(self, *args, global_normalisation=False, **kwargs):
        self.global_normalisation = normalisation_setting(global_normalisation)
        super().__init__(*args, **kwargs)

    def compute_returns(self, obs) -> None:
        group = normalisation_group(getattr(self, "global_normalisation", False))
        if STORAGE_LAYOUT:
            last_values = self.policy.evaluate(obs).detach()
            _storage_compute_returns(self.storage, last_values, self.gamma, self.lam,
                                     not self.normalize_advantage_per_mini_batch, group)
            return
        _compute_returns(self, obs, group)


def _apply() -> None:
    if STORAGE_LAYOUT:
        _Storage.compute_returns = storage_compute_returns
    else:
        _RslPPO.compute_returns = compute_returns


def _restore() -> None:
    setattr(_Storage if STORAGE_LAYOUT else _RslPPO, "compute_returns", _ORIGINAL)


_state = PatchState(_apply, _restore)
_DEFAULTS = {"global_normalisation": False}


def patch(global_normalisation=False) -> None:
    """Route rsl_rl's GAE (``PPO.compute_returns``, or up to 3.1 ``RolloutStorage.compute_returns``)
    through rl_triton until ``unpatch()``, for every instance and subclass that inherits the
    method. Idempotent, thread-safe, shared with ``patched()`` blocks (see docs/rsl_rl.md); a
    later call's setting replaces an earlier one's.

    Args:
        global_normalisation: False (default): the whole-batch normalisation of the advantages
            uses this process's rollout, as rsl_rl's; True: the rollouts of every rank of the
            default process group (``dist.group.WORLD``, at each call; this process's alone
            where ``torch.distributed`` is not initialised); a ``torch.distributed``
            ProcessGroup: those of its ranks. ``TypeError`` for other values.
    """
    _state.patch({"global_normalisation": normalisation_setting(global_normalisation)})


def unpatch() -> None:
    """Withdraw ``patch()``: rsl_rl's own method (the original function object) is back at once,
    or when the last open ``patched()`` block closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether rsl_rl's method is routed through rl_triton now."""
    return _state.active


def patched(global_normalisation=False):
    """``with patched(): ...``: rsl_rl is patched for the block. Blocks nest, also across threads;
    rsl_rl's own method comes back when the last holder (block or ``patch()``) lets go.

    Args:
        global_normalisation: as for ``patch()``, in effect while this block is the most recent
            holder.
    """
    return _state.patched({"global_normalisation": normalisation_setting(global_normalisation)})
