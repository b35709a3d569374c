"""SkyRL: drop-ins for the advantage estimators of
``skyrl.backends.skyrl_train.utils.ppo_utils`` (written against skyrl 0.3.0), each one or two
calls to rl_triton.

    import rl_triton.integrations.skyrl as rt_skyrl
    rt_skyrl.patch()          # in the process that computes the advantages (SkyRL's trainer)
    ...                       # compute_advantages_and_returns(...) now runs rl_triton for ESTIMATORS
    rt_skyrl.unpatch()        # SkyRL's own function objects, in the registry and the module

or without patching, with SkyRL's signatures (SkyRL itself need not be installed)::

    adv, returns = rt_skyrl.compute_gae_advantage_return(token_level_rewards, values, response_mask,
                                                         gamma=1.0, lambd=0.95)

``patch()`` goes through SkyRL's own extension point, ``AdvantageEstimatorRegistry``: for each
name in ``ESTIMATORS`` it unregisters SkyRL's function and registers the drop-in
(``register`` refuses a name it holds already, with ``ValueError``), and sets the module
attribute of the same name; ``unpatch()`` does the reverse where the drop-in is still in place.
The registry's other entries (``maxrl``, estimators users registered) are left alone. With Ray
initialised, ``register``/``unregister`` update SkyRL's registry actor too, as they do for any
estimator. SkyRL is imported by ``patch()``/``patched()`` only.

Conventions mapped here (docs/skyrl.md): one row per response, tokens along the last dim,
``response_mask`` nonzero on the tokens that count; an outcome score is the row sum of
``token_level_rewards``; ``index`` holds one prompt id per response. SkyRL's GAE runs over every
token of the row (the mask enters only the whitening), its REINFORCE++ return restarts where the
next token is masked. The mask is read as a flag (0/1), where SkyRL multiplies by it: for 0/1
masks and finite inputs the results agree. Outputs have the dtype SkyRL's type promotion gives
them, never require grad, and lie on the inputs' device. A whitening over fewer than two valid
tokens raises ``ValueError``, as SkyRL's ``masked_var`` does. Where a function here raises while
SkyRL's ``ppo_utils`` is imported, it raises what SkyRL's own function raises on the same
arguments, if that raises at all.
"""

from __future__ import annotations

import collections
import importlib
import sys
import types

import numpy as np
import torch

from .. import discounted_return, gae, group_advantages, masked_whiten
from ..core.docstrings import documented
from ._llm import require_two_valid as _require_two_valid, tensor_arg as _tensor
from ._patching import PatchState, raising_as, requires_framework

__all__ = [
    "ESTIMATORS",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "is_patched",
    "patch",
    "patched",
    "unpatch",
]

_PPO_UTILS = "skyrl.backends.skyrl_train.utils.ppo_utils"
SKYRL_VERSION = "0.3.0"  # the version these drop-ins were written and checked against

# SkyRL's registry name -> the ppo_utils attribute (and the function of that name here)
ESTIMATORS = types.MappingProxyType({
    "gae": "compute_gae_advantage_return",
    "grpo": "compute_grpo_outcome_advantage",
    "rloo": "compute_rloo_outcome_advantage",
    "reinforce++": "compute_reinforce_plus_plus_outcome_advantage",
})


def _same_shape(x: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be [batch_size, seqlen], got shape {tuple(x.shape)}")
    if mask.shape != x.shape:
        raise ValueError(f"response_mask must have {name}'s shape {tuple(x.shape)}, got {tuple(mask.shape)}")


def _promoted(x: torch.Tensor, mask: torch.Tensor) -> torch.dtype:
    """The dtype of ``x * mask`` (SkyRL's final multiplication by the mask)."""
    return torch.promote_types(x.dtype, mask.dtype)


def _ids(index) -> list:
    """``index`` as a list of hashable ids (a tensor read by value)."""
    if isinstance(index, (torch.Tensor, np.ndarray)):
        return index.reshape(-1).tolist()
    return list(index)


_ARGS = {
    "token_level_rewards": ("``[batch_size, seqlen]`` float tensor of per-token rewards, one row per response; an "
                            "outcome score is its row sum."),
    "response_mask": ("``[batch_size, seqlen]``, nonzero (1) on the tokens that count, 0 elsewhere: bool, integer or "
                      "float; a float mask takes part in the outputs' type promotion, as in SkyRL."),
    "index": ("one prompt id per response (SkyRL's ``uid``): a numpy array or list of hashable ids, or an integer "
              "tensor (read by value)."),
    "kwargs": "not read here (SkyRL's dispatch passes every estimator all of its arguments).",
}


def _skyrl_function(name: str):
    """SkyRL's own function ``name`` for the error path: the one patch() replaced, else the
    module's attribute while ppo_utils is imported; None without SkyRL."""
    module = sys.modules.get(_PPO_UTILS)
    if module is None:
        return None
    fn = _replaced.get(name) or getattr(module, name, None)
    return None if fn is None or fn is _OURS.get(name) else fn


_raises_as_skyrl = raising_as(_skyrl_function)


@_raises_as_skyrl
@documented(
    _ARGS,
    values="``V[t]``, ``[batch_size, seqlen]``, a float tensor.",
    gamma="the discount: a number or a tensor in [0, 1].",
    lambd="the GAE lambda: a number or a tensor in [0, 1].",
)
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lambd, **kwargs):
    """SkyRL's PPO GAE, whitened over the response tokens: ``(advantages, returns)``.

    ``rl_triton.gae(rewards, values, gamma=gamma, lmbda=lambd)`` over every token of the row
    (no mask in the recursion: V = A = 0 past the last token), then
    ``rl_triton.masked_whiten(advantages, response_mask)``:

        delta[t] = r[t] + gamma*V[t+1] - V[t],  A[t] = delta[t] + gamma*lambd*A[t+1]
        returns = A + V;  advantages = (A - mean) / sqrt(var + 1e-8)

    with the mean and the unbiased variance over the valid tokens of the batch, applied to every
    position. Computed in the promoted dtype of rewards and values, as SkyRL's loop. Fewer than
    two valid tokens raise ``ValueError``.
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        v = _tensor(values, "values")
        m = _tensor(response_mask, "response_mask")
        _same_shape(r, m, "token_level_rewards")
        dtype = torch.promote_types(r.dtype, v.dtype)
        _require_two_valid(m)
        adv, returns = gae(r.to(dtype), v.to(dtype), gamma=gamma, lmbda=lambd)
        return masked_whiten(adv, m, out=adv), returns


@_raises_as_skyrl
@documented(
    _ARGS,
    epsilon="GRPO's ``eps`` in ``(s_i - mean_g) / (std_g + epsilon)``, a number >= 0.",
    grpo_norm_by_std="a bool: True divides by ``std_g + epsilon`` (GRPO), False does not (Dr. GRPO).",
)
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, grpo_norm_by_std=True,
                                   **kwargs):
    """SkyRL's GRPO outcome advantage: ``(advantages, advantages)``, ``[batch_size, seqlen]``.

    ``rl_triton.group_advantages(token_level_rewards.sum(-1), index, mode="grpo",
    mask=response_mask, eps=epsilon)`` (``mode="drgrpo"`` without ``grpo_norm_by_std``): per group
    g of responses with the same id, A_i = (s_i - mean_g) / (std_g + epsilon) (unbiased std), or
    s_i - mean_g; a group of one has mean 0 and std 1. A_i on the valid tokens of row i, 0
    elsewhere.
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        m = _tensor(response_mask, "response_mask")
        _same_shape(r, m, "token_level_rewards")
        mode = "grpo" if grpo_norm_by_std else "drgrpo"
        adv = group_advantages(r.sum(dim=-1), _ids(index), mode=mode, mask=m, eps=epsilon)
        adv = adv.to(_promoted(adv, m))
        return adv, adv


@_raises_as_skyrl
@documented(_ARGS)
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, **kwargs):
    """SkyRL's RLOO outcome advantage: ``(advantages, advantages)``, ``[batch_size, seqlen]``.

    ``rl_triton.group_advantages(token_level_rewards.sum(-1), index, mode="rloo", mask=...)``:
    A_i = n/(n-1) * (s_i - mean_g), the score minus the mean of the other scores of its group,
    on the valid tokens of row i; a response alone in its group gets 0 (SkyRL's rule; its rows
    are left out of the mask passed on).
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        m = _tensor(response_mask, "response_mask")
        _same_shape(r, m, "token_level_rewards")
        ids = _ids(index)
        sizes = collections.Counter(ids)
        adv = group_advantages(r.sum(dim=-1), ids, mode="rloo", mask=m)
        alone = [i for i, g in enumerate(ids) if sizes[g] == 1]
        if alone:  # a response alone in its group: 0 on every token, as SkyRL leaves it
            adv[torch.tensor(alone, device=adv.device)] = 0.0
        adv = adv.to(_promoted(adv, m))
        return adv, adv


@_raises_as_skyrl
@documented(_ARGS, gamma="the discount: a number or a tensor in [0, 1].")
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma, **kwargs):
    """SkyRL's REINFORCE++: ``(advantages, returns)``, ``[batch_size, seqlen]``.

    The return restarts where the next token is masked:
    G[t] = r[t] + gamma * m[t+1] * G[t+1] (0 past the last token), that is
    ``rl_triton.discounted_return(rewards, done=..., gamma=gamma)`` with
    ``done[t] = not m[t+1]``. The advantages are ``rl_triton.masked_whiten(returns,
    response_mask)`` on the valid tokens and 0 elsewhere; the returns are kept on every token.
    Fewer than two valid tokens raise ``ValueError``.
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        m = _tensor(response_mask, "response_mask")
        _same_shape(r, m, "token_level_rewards")
        _require_two_valid(m)
        valid = m != 0
        done = torch.zeros_like(valid)
        done[:, :-1] = ~valid[:, 1:]
        returns = discounted_return(r, done=done, gamma=gamma)
        adv = torch.where(valid, masked_whiten(returns, m), 0.0)
        return adv.to(_promoted(adv, m)), returns


_OURS = {name: globals()[name] for name in ESTIMATORS.values()}


def _ppo_utils():
    """SkyRL's ``ppo_utils``, imported now; ``FrameworkNotInstalled`` where SkyRL is not installed,
    an ImportError naming what is missing where SkyRL is but a module it imports is not."""
    requires_framework(__name__, "SkyRL", "skyrl", extra="skyrl")
    try:
        return importlib.import_module(_PPO_UTILS)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing == "skyrl" or missing.startswith("skyrl.") or not missing:
            raise ImportError(f"rl_triton.integrations.skyrl needs skyrl {SKYRL_VERSION} (pip install -e "
                              f"'.[skyrl]') to patch it: {e}") from e
        raise ImportError(f"skyrl is installed but {_PPO_UTILS} cannot be imported: the module {missing!r}, which "
                          f"it imports, is missing ({e}); pip install -e '.[skyrl]' installs it") from e


_module = None  # the ppo_utils module patched now
_replaced = {}  # attribute name -> SkyRL's function that patch() replaced
_saved_attrs = {}  # attribute name -> the module attribute before patch()
_saved_registry = {}  # registry name -> the registry entry before patch()


def _registered(registry) -> dict:
    """The registry's local table (read only; every change goes through register/unregister)."""
    return registry._functions


def _apply() -> None:
    global _module
    module = _ppo_utils()
    registry = module.AdvantageEstimatorRegistry
    for key, name in ESTIMATORS.items():
        ours = _OURS[name]
        if name in vars(module):
            _saved_attrs[name] = getattr(module, name)
            setattr(module, name, ours)
        if key in _registered(registry):
            _saved_registry[key] = _registered(registry)[key]
            registry.unregister(key)
            registry.register(key, ours)
        original = _saved_registry.get(key, _saved_attrs.get(name))
        if original is not None:
            _replaced[name] = original
    _module = module


def _restore() -> None:
    global _module
    module, _module = _module, None
    registry = module.AdvantageEstimatorRegistry
    # only where ours is still in place: what someone else put there since stays
    for name, fn in _saved_attrs.items():
        if getattr(module, name, None) is _OURS[name]:
            setattr(module, name, fn)
    for key, fn in _saved_registry.items():
        if _registered(registry).get(key) is _OURS[ESTIMATORS[key]]:
            registry.unregister(key)
            registry.register(key, fn)
    _saved_attrs.clear()
    _saved_registry.clear()
    _replaced.clear()


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route SkyRL's advantage estimators (``ESTIMATORS``) through rl_triton until
    ``unpatch()``: their entries in ``AdvantageEstimatorRegistry`` (unregistered, then the
    drop-in registered) and the attributes of ``ppo_utils`` of the same names. Imports SkyRL;
    ``ImportError`` where it cannot. Idempotent. Thread-safe.

    Call it in the process that computes the advantages, before training starts (SkyRL's
    trainer calls ``compute_advantages_and_returns``, which looks the estimator up in the
    registry). The patch is shared with ``patched()`` blocks, which may be open in other
    threads: SkyRL is patched while ``patch()`` is in effect or any block is open."""
    _ppo_utils()
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``. SkyRL's own function objects (the same objects) are back in the
    registry and the module at once, or, while ``patched()`` blocks are open (in any thread),
    when the last of them closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether SkyRL's advantage estimators are routed through rl_triton now."""
    return _state.active


def patched():
    """``with patched(): ...``: SkyRL is patched for the block, and the block's hold on the patch
    ends with it. Blocks nest, also across threads: each holds the patch until it closes, and
    SkyRL's own objects come back when the last holder (block or ``patch()``) lets go. Imports
    SkyRL when called (``ImportError`` where it cannot)."""
    _ppo_utils()
    return _state.patched()
