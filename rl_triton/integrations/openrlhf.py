"""OpenRLHF: fused scans for the experience maker's GAE and REINFORCE returns, and its
advantage normalisation across experiences.

    import rl_triton.integrations.openrlhf as rt_openrlhf
    rt_openrlhf.patch()      # in the process that runs RemoteExperienceMaker (docs/openrlhf.md)
    ...
    rt_openrlhf.unpatch()    # OpenRLHF's own methods again, the same function objects

``patch()`` replaces ``RemoteExperienceMaker.get_advantages_and_returns`` and
``.get_cumulative_returns`` (``openrlhf/trainer/ppo_utils/experience_maker.py``, OpenRLHF
0.11) with methods of the same signatures and results. OpenRLHF is imported by ``patch()`` and
``patched()``, not by this module: without it they raise ``ImportError``, and the plain
functions ``get_advantages_and_returns``, ``get_cumulative_returns`` and
``normalize_advantages`` work without it.

Conventions mapped here: ``(batch, num_actions)`` tensors, batch-major; ``action_mask`` (bool or
integer 0/1, any number of spans per row) marks the response tokens. OpenRLHF multiplies
rewards and values by the mask and runs its loops over the whole row with V = 0 and a return of
0 past the end: ``rl_triton.gae(mask=..., mask_mode="pad")`` and ``rl_triton.discounted_return``
over the masked rewards (selected, not multiplied: the same for finite inputs). Its
normalisation is ``rl_triton.masked_whiten(unbiased=False, eps_mode="clamp")`` over all
experiences at once. Like OpenRLHF's methods, everything runs under ``torch.no_grad()``.

With the KL penalty in the reward (``--algo.kl.use_loss`` off), OpenRLHF computes the per-token KL
in ``make_experience``, keeps it for its metrics and subtracts it in ``compute_reward`` before
``get_advantages_and_returns``; ``compute_reward_advantages_and_returns`` does the last two with
the KL estimate formed inside the fused scan (docs/semantics.md section 13.1), for a loop that
calls them itself. ``patch()`` leaves that path to OpenRLHF: the KL it reads was computed and
stored before the methods it replaces run (docs/openrlhf.md, "KL in the reward").
"""

from __future__ import annotations

import importlib
import inspect

import torch

from .. import discounted_return, gae, masked_whiten
from ._patching import PatchState, requires_framework

__all__ = ["compute_reward_advantages_and_returns", "get_advantages_and_returns", "get_cumulative_returns",
           "is_patched", "normalize_advantages", "patch", "patched", "unpatch"]

_MODULE = "openrlhf.trainer.ppo_utils.experience_maker"
_CLASS = "RemoteExperienceMaker"
# each replaced method and the parameters OpenRLHF 0.11 gives it
_SIGNATURES = {
    "get_advantages_and_returns": ("self", "values", "rewards", "action_mask", "gamma", "lambd"),
    "get_cumulative_returns": ("self", "rewards", "action_mask", "gamma"),
}


# -- the plain functions -----------------------------------------------------------------------
def _check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be a (batch, num_actions) tensor, got shape {tuple(x.shape)}")


def _check_mask(action_mask, like: torch.Tensor):
    if action_mask is None:
        return None
    if not isinstance(action_mask, torch.Tensor):
        raise TypeError(f"action_mask must be a torch.Tensor or None, got {type(action_mask).__name__}")
    if action_mask.shape != like.shape:
        raise ValueError(f"action_mask must have the rewards' shape {tuple(like.shape)}, "
                         f"got {tuple(action_mask.shape)}")
    return action_mask


@torch.no_grad()
def get_advantages_and_returns(values, rewards, action_mask, gamma, lambd):
    """``RemoteExperienceMaker.get_advantages_and_returns`` as one fused scan.

    With m = action_mask (1 where None), r' = m * r and V' = m * V:

        A[t] = r'[t] + gamma * V'[t+1] - V'[t] + gamma * lambd * A[t+1],  V'[T] = A[T] = 0

    Returns ``(advantages, returns = A + V')`` in the promoted dtype of values and rewards (and
    of a float mask, which OpenRLHF multiplies by).

    Args:
        values: ``V[t]``, a ``(batch, num_actions)`` float tensor.
        rewards: ``r[t]``, a float tensor of the values' shape.
        action_mask: a tensor of the rewards' shape (0/1: bool, integer or float), nonzero on the
            action tokens; None: every token counts.
        gamma: the discount (``args.algo.advantage.gamma``), a number or a tensor in [0, 1].
        lambd: the GAE lambda (``args.algo.advantage.lambd``), a number or a tensor in [0, 1].
    """
    _check_tensor(values, "values")
    _check_tensor(rewards, "rewards")
    if values.shape != rewards.shape:
        raise ValueError(f"values must have the rewards' shape {tuple(rewards.shape)}, got {tuple(values.shape)}")
    mask = _check_mask(action_mask, rewards)
    dtype = torch.promote_types(values.dtype, rewards.dtype)
    if mask is not None and mask.is_floating_point():  # OpenRLHF multiplies by it
        dtype = torch.promote_types(dtype, mask.dtype)
    values, rewards = values.to(dtype), rewards.to(dtype)
    if mask is None:
        return gae(rewards, values, gamma=gamma, lmbda=lambd)
    return gae(rewards, values, mask=mask, mask_mode="pad", gamma=gamma, lmbda=lambd)


@torch.no_grad()
def get_cumulative_returns(rewards, action_mask, gamma):
    """``RemoteExperienceMaker.get_cumulative_returns`` (REINFORCE and its baselines) as one
    fused scan.

    G[t] = m[t] * r[t] + gamma * G[t+1], G[T] = 0 (m = 1 where None): the discounted sum of the
    masked rewards to the end of the row. Returns a tensor of the rewards' dtype and device,
    accumulated in float32 for 16-bit rewards (as OpenRLHF's float32 running sum).

    Args:
        rewards: ``r[t]``, a ``(batch, num_actions)`` float tensor.
        action_mask: a tensor of the rewards' shape (0/1), nonzero on the action tokens; None:
            every token counts.
        gamma: the discount, a number or a tensor in [0, 1].
    """
    _check_tensor(rewards, "rewards")
    mask = _check_mask(action_mask, rewards)
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else mask != 0
        rewards = torch.where(keep, rewards, 0.0)
    return discounted_return(rewards, gamma=gamma)


KL_ESTIMATORS = ("k1", "k2", "k3")  # OpenRLHF's --algo.kl.estimator
KL_CLAMP = 10.0  # OpenRLHF clamps every estimate to [-10, 10]


@torch.no_grad()
def compute_reward_advantages_and_returns(r, kl_coef, action_log_probs, base_action_log_probs, values,
                                          action_mask, gamma, lambd, kl_estimator="k1", reward_clip_range=None):
    """OpenRLHF's ``compute_approx_kl``, ``compute_reward`` and ``get_advantages_and_returns`` in
    one fused scan: ``(advantages, returns)``.

    With d = action_log_probs - base_action_log_probs, kl = the estimate ``kl_estimator`` of d
    clamped to [-10, 10] (docs/semantics.md section 13.1) and c = max(kl_coef, 0), the rewards are
    ``r[i]`` (clipped to ``reward_clip_range`` where given) at each row's last action token, minus
    ``c * kl[t]`` at every token; then :func:`get_advantages_and_returns` on them:
    ``rl_triton.gae(mask=action_mask, mask_mode="pad", kl=...)``. A row without an action token
    takes its score at the last position, as OpenRLHF's index search gives.

    The estimate and the shaped rewards are formed in float32, as OpenRLHF's (in float64 where
    the values are float64); the outputs have the promoted dtype of float32, the values and a
    float mask.

    Args:
        r: one score per response, a ``(batch,)`` float tensor.
        kl_coef: the KL coefficient (``self.kl_ctl.value``), a number; a value <= 0 counts as 0.
        action_log_probs: the policy's log-probabilities of the action tokens, ``(batch, num_actions)``,
            any float dtype.
        base_action_log_probs: the reference model's, as ``action_log_probs``.
        values: ``V[t]``, a ``(batch, num_actions)`` float tensor.
        action_mask: a tensor of the values' shape (0/1: bool, integer or float), nonzero on the action
            tokens.
        gamma: the discount, a number or a tensor in [0, 1].
        lambd: the GAE lambda, a number or a tensor in [0, 1].
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (``--algo.kl.estimator``); another raises ValueError.
        reward_clip_range: None, or ``(low, high)`` that the scores are clamped to (``--reward.clip_range``).
    """
    _check_tensor(values, "values")
    if not isinstance(r, torch.Tensor) or r.ndim != 1 or r.shape[0] != values.shape[0]:
        raise ValueError(f"r must be a ({values.shape[0]},) tensor of one score per response, got "
                         f"{type(r).__name__ if not isinstance(r, torch.Tensor) else tuple(r.shape)}")
    if action_mask is None:
        raise TypeError("action_mask must be a tensor: the score goes to each row's last action token")
    mask = _check_mask(action_mask, values)
    if not isinstance(kl_estimator, str) or kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS)}, got {kl_estimator!r}")
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)):
        raise TypeError(f"kl_coef must be a number, got {type(kl_coef).__name__}")
    if reward_clip_range:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    T = mask.shape[1]
    last = T - 1 - (mask != 0).long().fliplr().argmax(dim=1, keepdim=True)
    rewards = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    rewards.scatter_(1, last, r.unsqueeze(1).to(torch.float32))
    dtype = torch.promote_types(values.dtype, torch.float32)
    if mask.is_floating_point():  # OpenRLHF multiplies by it
        dtype = torch.promote_types(dtype, mask.dtype)
    kl = dict(log_probs=action_log_probs, ref_log_probs=base_action_log_probs, coef=max(float(kl_coef), 0.0),
              estimator=kl_estimator, clamp=KL_CLAMP)
    return gae(rewards.to(dtype), values.to(dtype), mask=mask, mask_mode="pad", gamma=gamma, lmbda=lambd, kl=kl)


def _as_list(x, name: str):
    if isinstance(x, torch.Tensor):
        return [x], True
    if isinstance(x, (list, tuple)):
        for i, t in enumerate(x):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        return list(x), False
    raise TypeError(f"{name} must be a torch.Tensor or a list of them, got {type(x).__name__}")


@torch.no_grad()
def normalize_advantages(advantages, action_masks, *, no_std=False, group=None):
    """OpenRLHF's normalisation of the advantages across all experiences of a step (estimators
    gae, reinforce, reinforce_baseline).

    Over the valid tokens of all the experiences together (of every rank of ``group``, where
    given):

        mean = sum(a[valid]) / n,  var = sum((a[valid] - mean)**2) / n      (biased)
        rstd = 1 / sqrt(max(var, 1e-8)),  or 1 with no_std (``--algo.advantage.no_std_norm``)
        out  = (a - mean) * rstd  at every position, the masked ones included

    Returns the same structure: a tensor, or a list of tensors of the inputs' shapes and dtypes.
    The statistics accumulate in float32 (OpenRLHF's ``.float()``), in float64 for float64
    advantages. No host synchronisation: no valid token gives NaN, as OpenRLHF's 0/0.

    Args:
        advantages: one float tensor, or a list with one per experience (any shapes).
        action_masks: the same structure as ``advantages``, each mask of its advantages' shape
            (0/1, bool or integer), nonzero on the valid tokens.
        no_std: a bool: True centres only (``rstd = 1``), as ``--algo.advantage.no_std_norm``.
        group: a ``torch.distributed`` ProcessGroup over whose ranks the statistics are taken,
            each rank passing its own experiences; None: this process alone.
    """
    if not isinstance(no_std, bool):
        raise TypeError(f"no_std must be a bool, got {type(no_std).__name__}")
    advs, single = _as_list(advantages, "advantages")
    masks, _ = _as_list(action_masks, "action_masks")
    if len(masks) != len(advs):
        raise ValueError(f"action_masks must hold one mask per advantages tensor ({len(advs)}), got {len(masks)}")
    if not advs:
        return []
    for i, (a, m) in enumerate(zip(advs, masks)):
        where = "" if single else f"[{i}]"
        if not a.is_floating_point():
            raise TypeError(f"advantages{where} must be a floating-point tensor, got {a.dtype}")
        if m.shape != a.shape:
            raise ValueError(f"action_masks{where} must have the shape of advantages{where} {tuple(a.shape)}, "
                             f"got {tuple(m.shape)}")
        if a.device != advs[0].device or m.device != advs[0].device:
            raise ValueError(f"advantages{where} and action_masks{where} must be on {advs[0].device}")
    kw = dict(unbiased=False, eps_mode="clamp", scale=not no_std, group=group)
    if single:
        return masked_whiten(advs[0], masks[0], **kw)
    dtype = advs[0].dtype
    for a in advs[1:]:
        dtype = torch.promote_types(dtype, a.dtype)
    flat = torch.cat([a.reshape(-1) for a in advs]).to(dtype)
    valid = torch.cat([m.reshape(-1) if m.dtype == torch.bool else m.reshape(-1) != 0 for m in masks])
    out = masked_whiten(flat, valid, **kw)
    return [y.view(a.shape).to(a.dtype) for y, a in zip(out.split([a.numel() for a in advs]), advs)]


# -- the patch ---------------------------------------------------------------------------------
def _experience_maker():
    """OpenRLHF's experience maker class, imported now; ImportError where OpenRLHF is missing or
    its methods are not the ones this module replaces (``FrameworkNotInstalled``, an ImportError,
    where it is not installed)."""
    requires_framework(f"{__name__}.patch()", "OpenRLHF 0.11", "openrlhf", requirement="openrlhf==0.11.*")
    try:
        module = importlib.import_module(_MODULE)
    except ImportError as e:
        hint = ""
        if (getattr(e, "name", None) or "").split(".")[0] == "flash_attn":
            hint = (" OpenRLHF's experience maker imports flash-attn (through openrlhf.models), a CUDA build "
                    "that does not install with a CPU-only torch: patch() needs OpenRLHF's GPU environment.")
        raise ImportError(f"rl_triton.integrations.openrlhf.patch() needs OpenRLHF 0.11 (pip install openrlhf): "
                          f"importing {_MODULE} failed: {e}.{hint} The plain functions get_advantages_and_returns, "
                          f"get_cumulative_returns and normalize_advantages work without it.") from e
    cls = getattr(module, _CLASS, None)
    if not isinstance(cls, type):
        raise ImportError(f"{_MODULE} has no class {_CLASS}: this OpenRLHF is not the 0.11 layout that "
                          f"rl_triton.integrations.openrlhf patches")
    for name, params in _SIGNATURES.items():
        method = cls.__dict__.get(name)
        if not callable(method):
            raise ImportError(f"{_MODULE}.{_CLASS} defines no method {name}: this OpenRLHF is not the 0.11 layout "
                              f"that rl_triton.integrations.openrlhf patches")
        got = tuple(inspect.signature(method).parameters)
        if got != params:
            raise ImportError(f"{_MODULE}.{_CLASS}.{name} takes {got}, not {params} as in OpenRLHF 0.11: "
                              f"rl_triton.integrations.openrlhf does not patch this version")
    return cls


class _Methods:
    """The methods that ``patch()`` sets on the experience maker (``self`` is not read)."""

    def get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
        """rl_triton.integrations.openrlhf.get_advantages_and_returns, as a method."""
        return get_advantages_and_returns(values, rewards, action_mask, gamma, lambd)

    def get_cumulative_returns(self, rewards, action_mask, gamma):
        """rl_triton.integrations.openrlhf.get_cumulative_returns, as a method."""
        return get_cumulative_returns(rewards, action_mask, gamma)


_REPLACEMENTS = {name: _Methods.__dict__[name] for name in _SIGNATURES}
_applied = []  # (class, {name: OpenRLHF's function object}) while patched


def _apply() -> None:
    cls = _experience_maker()
    originals = {name: cls.__dict__[name] for name in _REPLACEMENTS}
    for name, method in _REPLACEMENTS.items():
        setattr(cls, name, method)
    _applied.append((cls, originals))


def _restore() -> None:
    cls, originals = _applied.pop()
    for name, method in originals.items():
        setattr(cls, name, method)


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route ``RemoteExperienceMaker.get_advantages_and_returns`` and ``.get_cumulative_returns``
    through rl_triton until ``unpatch()``, in this process. Imports OpenRLHF (``ImportError``
    without it, or where its methods differ from OpenRLHF 0.11's). Idempotent; thread-safe.

    The patch is shared with ``patched()`` blocks, which may be open in other threads: OpenRLHF's
    methods are replaced while ``patch()`` is in effect or any block is open. Takes no
    arguments, so it can be a Ray ``worker_process_setup_hook`` (docs/openrlhf.md)."""
    _experience_maker()  # the import and its errors before the lock is taken
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``. OpenRLHF's own methods (the original function objects) are back at
    once, or, while ``patched()`` blocks are open (in any thread), when the last of them closes.
    Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether OpenRLHF's experience maker is routed through rl_triton now."""
    return _state.active


def patched():
    """``with patched(): ...``: OpenRLHF is patched for the block. Blocks nest, also across
    threads, and OpenRLHF's own methods come back when the last holder (block or ``patch()``)
    lets go. Imports OpenRLHF when the block opens."""
    _experience_maker()
    return _state.patched()
