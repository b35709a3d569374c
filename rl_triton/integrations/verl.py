"""verl: drop-ins for the advantage estimators of ``verl.trainer.ppo.core_algos`` (written
against verl 0.9.1), each one call to rl_triton.

    import rl_triton.integrations.verl as rt_verl
    rt_verl.patch()           # in the process that runs the trainer's fit(), before it starts
    ...                       # compute_advantage(...) now runs rl_triton for the estimators below
    rt_verl.unpatch()         # verl's own function objects, in the module and the registry

or without patching, with verl's signatures (verl itself need not be installed)::

    adv, returns = rt_verl.compute_gae_advantage_return(token_level_rewards, values, response_mask,
                                                        gamma=1.0, lam=0.95)
    adv, _ = rt_verl.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index=uids)

and, for a trainer with ``algorithm.use_kl_in_reward``, verl's ``apply_kl_penalty`` and GAE in one
fused scan (the KL estimate formed inside it, docs/semantics.md section 13.1)::

    adv, returns = rt_verl.compute_gae_advantage_return_with_kl(
        token_level_scores, values, response_mask, old_log_probs, ref_log_prob,
        kl_coef=kl_ctrl.value, kl_penalty="low_var_kl", gamma=1.0, lam=0.95)

``patch()`` does not route ``apply_kl_penalty`` here: verl applies the penalty in the trainer's
``fit()``, apart from the estimator call, and keeps the shaped ``token_level_rewards`` and the
KL metric (which needs the per-token estimate) for later steps, so deferring it would change what
the trainer records (docs/verl.md, "KL in the reward").

``patch()`` sets the module attributes of ``verl.trainer.ppo.core_algos`` named in
``ESTIMATORS`` (verl's trainer calls GAE and GRPO through them) and the entries of
``ADV_ESTIMATOR_REGISTRY`` under those names (every other estimator is reached through
``get_adv_estimator_fn``). verl is imported by ``patch()``/``patched()`` only.

Conventions mapped here (docs/verl.md): one row per response, tokens along the last dim,
``response_mask`` nonzero on the tokens the policy generated; an outcome score is the row sum of
``token_level_rewards``; ``index`` holds one group id (verl's ``uid``) per response. Masked
tokens are selected away (``torch.where``), where verl multiplies by the mask: for finite inputs
the results agree, and a NaN/inf at a masked token stays there. Outputs have the dtype verl's
type promotion gives them (the mask's dtype included), never require grad, and lie on the
inputs' device. A whitening over fewer than two valid tokens raises ``ValueError``, as verl's
``masked_var`` does (one host sync, as in verl). Where a function here raises while verl's
``core_algos`` is imported, it raises what verl's own function raises on the same arguments,
if that raises at all.
"""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import torch

from .. import gae, group_advantages, masked_whiten
from ..core.docstrings import documented
from ._llm import require_two_valid as _require_two_valid, tensor_arg as _tensor
from ._patching import PatchState, raising_as, requires_framework

__all__ = [
    "ESTIMATORS",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_gae_advantage_return_with_kl",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "is_patched",
    "patch",
    "patched",
    "unpatch",
]

_CORE_ALGOS = "verl.trainer.ppo.core_algos"
VERL_VERSION = "0.9.1"  # the version these drop-ins were written and checked against

# verl's registry name -> the core_algos attribute (and the function of that name here)
ESTIMATORS = types.MappingProxyType({
    "gae": "compute_gae_advantage_return",
    "grpo": "compute_grpo_outcome_advantage",
    "grpo_vectorized": "compute_grpo_vectorized_outcome_advantage",
    "rloo": "compute_rloo_outcome_advantage",
    "rloo_vectorized": "compute_rloo_vectorized_outcome_advantage",
    "reinforce_plus_plus": "compute_reinforce_plus_plus_outcome_advantage",
    "reinforce_plus_plus_baseline": "compute_reinforce_plus_plus_baseline_outcome_advantage",
})


# ---------------------------------------------------------------------------------------------
# argument mapping
# ---------------------------------------------------------------------------------------------

def _promoted(*dtypes: torch.dtype) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """One outcome score per response: the row sum of the token-level rewards."""
    return token_level_rewards.sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# the drop-ins: verl 0.9.1 signatures
# ---------------------------------------------------------------------------------------------

# the drop-ins' arguments (verl's names)
_ARGS = {
    "token_level_rewards": ("``[bs, response_length]`` float tensor of per-token rewards, one row per response; "
                            "an outcome score is its row sum."),
    "response_mask": ("``[bs, response_length]``, nonzero on the tokens the policy generated: bool, integer or "
                      "float (0/1); its dtype takes part in the outputs' type promotion, as in verl."),
    "index": ("one group id per response (verl's ``uid``, the prompt it answers): a numpy array or list of "
              "hashable ids, or an integer tensor."),
    "epsilon": "not read here (as in verl).",
    "config": "not read here (as in verl).",
    "kwargs": "not read here (as in verl).",
}
_GRPO = dict(
    epsilon="GRPO's ``eps`` in ``(s_i - mean_g) / (std_g + epsilon)``, a number >= 0.",
    norm_adv_by_std_in_grpo="a bool: True divides by ``std_g + epsilon`` (GRPO), False does not (Dr. GRPO).",
)

def _verl_function(name: str):
    """verl's own function ``name`` for the error path: the one patch() replaced, else the
    module's attribute while verl's core_algos is imported; None without verl."""
    module = sys.modules.get(_CORE_ALGOS)
    if module is None:
        return None
    fn = _replaced.get(name) or getattr(module, name, None)
    return None if fn is None or fn is _OURS.get(name) else fn


_raises_as_verl = raising_as(_verl_function)


@_raises_as_verl
@documented(
    _ARGS,
    values="``V[t]``, ``[bs, response_length]``, a float tensor.",
    gamma="the discount: a number or a tensor in [0, 1].",
    lam="the GAE lambda: a number or a tensor in [0, 1].",
)
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """verl's PPO GAE over response tokens, whitened: ``(advantages, returns)``.

    ``rl_triton.gae(rewards, values, mask=response_mask, mask_mode="skip", gamma=gamma,
    lmbda=lam, whiten=True)``. Per row, backwards over t, with nv = A = 0 past the last token:
    delta = r[t] + gamma*nv - V[t], A' = delta + gamma*lam*A; at a valid token nv = V[t],
    A = A', at a masked token both carry over; then returns = A + V and the advantages are
    whitened over the valid tokens of the batch: (A - mean) / sqrt(var + 1e-8), var unbiased.

    Computed in the promoted dtype of rewards, values and mask, as verl's loop promotes them.
    Fewer than two valid tokens in the batch raise ``ValueError``.
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        v = _tensor(values, "values")
        m = _tensor(response_mask, "response_mask")
        dtype = _promoted(r.dtype, v.dtype, m.dtype)
        _require_two_valid(m)
        return gae(_as(r, dtype), _as(v, dtype), mask=m, mask_mode="skip", gamma=gamma, lmbda=lam, whiten=True)


# verl's kl_penalty names (core_algos.kl_penalty_forward) -> rl_triton's estimators; a trailing
# "+" (verl's straight-through gradient variants) leaves the values unchanged
KL_PENALTIES = types.MappingProxyType({"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
                                       "low_var_kl": "k3", "k3": "k3"})


class _UnknownKLPenalty(ValueError, NotImplementedError):
    """A ``kl_penalty`` verl does not compute: a ValueError that an ``except NotImplementedError``
    (verl raises that for "full" and unknown names) also catches."""


def _kl_estimator(kl_penalty) -> str:
    base = kl_penalty[:-1] if isinstance(kl_penalty, str) and kl_penalty.endswith("+") else kl_penalty
    if not isinstance(base, str) or base not in KL_PENALTIES:
        raise _UnknownKLPenalty(f"kl_penalty must be one of {sorted(KL_PENALTIES)} (a trailing '+' allowed), got "
                                f"{kl_penalty!r}; verl computes no other ('full' raises NotImplementedError there)")
    return KL_PENALTIES[base]


@documented(
    _ARGS,
    token_level_scores=("``[bs, response_length]`` float tensor of the reward model's per-token scores, before the "
                        "KL penalty (verl's ``data.batch[\"token_level_scores\"]``)."),
    values="``V[t]``, ``[bs, response_length]``, a float tensor.",
    old_log_probs="log-probabilities of the response tokens under the rollout policy, ``[bs, response_length]``, "
                  "any float dtype (verl's ``data.batch[\"old_log_probs\"]``).",
    ref_log_prob="the reference policy's, as ``old_log_probs`` (verl's ``data.batch[\"ref_log_prob\"]``).",
    kl_coef="the KL coefficient beta, a finite number (verl's ``kl_ctrl.value``).",
    kl_penalty=("verl's ``algorithm.kl_penalty``: ``\"kl\"``/``\"k1\"``, ``\"abs\"``, ``\"mse\"``/``\"k2\"``, "
                "``\"low_var_kl\"``/``\"k3\"``, each with an optional trailing ``+``; another name raises "
                "ValueError (also a NotImplementedError, as in verl)."),
    gamma="the discount: a number or a tensor in [0, 1].",
    lam="the GAE lambda: a number or a tensor in [0, 1].",
)
def compute_gae_advantage_return_with_kl(token_level_scores, values, response_mask, old_log_probs, ref_log_prob,
                                         kl_coef, kl_penalty="kl", gamma=1.0, lam=1.0):
    """verl's ``apply_kl_penalty`` followed by its GAE (:func:`compute_gae_advantage_return`), in one
    fused scan: ``(advantages, returns)``.

    ``rl_triton.gae(scores, values, mask=response_mask, mask_mode="skip", gamma=gamma, lmbda=lam,
    whiten=True, kl=dict(log_probs=old_log_probs, ref_log_probs=ref_log_prob, coef=kl_coef,
    estimator=...))``: the rewards are ``token_level_scores - kl_coef * kld`` with verl's estimate
    kld of ``old_log_probs - ref_log_prob`` (docs/semantics.md section 13.1), read only on the
    response tokens, as verl multiplies kld by the mask; then verl's skip-masked GAE and whitening.

    Computed in the promoted dtype of the scores, values, mask and log-probs, as verl's tensors
    promote (the estimate in float32 for 16- and 32-bit inputs, where verl forms it in the
    log-probs' dtype). The KL metric and the adaptive controller's update that verl's
    ``apply_kl_penalty`` also makes stay the caller's. Fewer than two valid tokens in the batch
    raise ``ValueError``.
    """
    with torch.no_grad():
        estimator = _kl_estimator(kl_penalty)
        r = _tensor(token_level_scores, "token_level_scores")
        v = _tensor(values, "values")
        m = _tensor(response_mask, "response_mask")
        lp = _tensor(old_log_probs, "old_log_probs")
        ref = _tensor(ref_log_prob, "ref_log_prob")
        dtype = _promoted(r.dtype, v.dtype, m.dtype, lp.dtype, ref.dtype)
        _require_two_valid(m)
        kl = dict(log_probs=lp, ref_log_probs=ref, coef=kl_coef, estimator=estimator)
        return gae(_as(r, dtype), _as(v, dtype), mask=m, mask_mode="skip", gamma=gamma, lmbda=lam, whiten=True, kl=kl)


def _grpo(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, compute_dtype=None):
    r = _tensor(token_level_rewards, "token_level_rewards")
    m = _tensor(response_mask, "response_mask")
    scores = _scores(r)
    if compute_dtype is not None:
        scores = _as(scores, _promoted(scores.dtype, compute_dtype))
    mode = "grpo" if norm_adv_by_std_in_grpo else "drgrpo"
    adv = group_advantages(scores, index, mode=mode, mask=m, eps=epsilon)
    adv = _as(adv, _promoted(scores.dtype, m.dtype))
    return adv, adv


@_raises_as_verl
@documented(_ARGS, **_GRPO)
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None):
    """verl's GRPO outcome advantage: ``(advantages, advantages)``, ``[bs, response_length]``.

    ``rl_triton.group_advantages(token_level_rewards.sum(-1), index, mode="grpo", mask=response_mask,
    eps=epsilon)``; ``mode="drgrpo"`` when ``norm_adv_by_std_in_grpo`` is false. Per group g of
    responses with the same ``index`` id: A_i = (s_i - mean_g) / (std_g + epsilon) (torch's
    unbiased std), or s_i - mean_g; a group of one has mean 0 and std 1. A_i on the valid tokens of
    row i, 0 elsewhere.
    """
    with torch.no_grad():
        return _grpo(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo)


@_raises_as_verl
@documented(_ARGS, **_GRPO)
def compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              norm_adv_by_std_in_grpo=True, config=None):
    """verl's vectorized GRPO: the same advantages as :func:`compute_grpo_outcome_advantage`.

    verl's vectorized form takes its group statistics in float32, so half-precision rewards give
    float32 advantages here too; float64 rewards keep float64 statistics (verl's agree with them
    to float32 rounding).
    """
    with torch.no_grad():
        return _grpo(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo,
                     compute_dtype=torch.float32)


@_raises_as_verl
@documented(_ARGS)
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None,
                                   **kwargs):
    """verl's RLOO outcome advantage: ``(advantages, advantages)``, ``[bs, response_length]``.

    ``rl_triton.group_advantages(token_level_rewards.sum(-1), index, mode="rloo", mask=response_mask)``:
    A_i = s_i - (the mean of the other scores of its group) = n/(n-1) * (s_i - mean_g); a group of
    one keeps its raw score.
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        m = _tensor(response_mask, "response_mask")
        scores = _scores(r)
        adv = group_advantages(scores, index, mode="rloo", mask=m)
        adv = _as(adv, _promoted(scores.dtype, m.dtype))
        return adv, adv


@_raises_as_verl
@documented(_ARGS)
def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              config=None, **kwargs):
    """verl's vectorized RLOO: as :func:`compute_rloo_outcome_advantage`, except that a group of
    one gets advantage 0 (verl's vectorized form), not its raw score.

    Groups are ``numpy.unique(index)``'s, as verl factorises them; the rows of groups of one are
    left out of the broadcast mask, so they come out 0. Half-precision rewards give float64
    advantages, as verl's group sums do.
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        m = _tensor(response_mask, "response_mask")
        scores = _scores(r)
        if scores.dtype not in (torch.float32, torch.float64):
            scores = scores.to(torch.float64)  # verl's group sums (bincount weights) are float64 for half types
        _, codes, sizes = np.unique(index, return_inverse=True, return_counts=True)
        codes = codes.reshape(-1)
        ids = torch.from_numpy(codes.astype(np.int64, copy=False))
        shared = torch.from_numpy(sizes[codes] > 1).to(m.device)
        adv = group_advantages(scores, ids, mode="rloo", mask=(m != 0) & shared[:, None])
        adv = _as(adv, _promoted(scores.dtype, m.dtype))
        return adv, adv


class _MissingConfig(ValueError, AssertionError):
    """``config`` is None where verl asserts it is given: a ValueError that an ``except
    AssertionError`` (verl's behaviour) also catches."""


@_raises_as_verl
@documented(
    _ARGS,
    config=("verl's algorithm config, whose ``gamma`` (a number in [0, 1]) discounts the return; required "
            "(``ValueError``, also an ``AssertionError`` as verl's assert)."),
)
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, config=None, **kwargs):
    """verl's REINFORCE++: ``(advantages, returns)``, ``[bs, response_length]``.

    The return is discounted over the valid tokens only (masked tokens neither add a reward nor
    a discount): G[t] = r[t] + gamma * G[next valid token after t] (0 past the last) on valid
    tokens, 0 on masked ones, with ``gamma = config.gamma``. That is the skip-masked GAE of zero
    values with lambda 1: ``rl_triton.gae(r, 0, mask=response_mask, gamma=gamma, lmbda=1)``.
    The advantages are ``rl_triton.masked_whiten(returns, response_mask)`` on the valid tokens and
    0 elsewhere; fewer than two valid tokens raise ``ValueError``.
    """
    if config is None:
        raise _MissingConfig("config is required: REINFORCE++ reads its discount from config.gamma")
    gamma = config.gamma
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        m = _tensor(response_mask, "response_mask")
        _require_two_valid(m)
        valid = m != 0
        g, _ = gae(r, torch.zeros_like(r), mask=m, mask_mode="skip", gamma=gamma, lmbda=1.0)
        returns = torch.where(valid, g, 0.0)
        adv = torch.where(valid, masked_whiten(returns, m), 0.0)
        return _as(adv, _promoted(r.dtype, m.dtype)), returns


@_raises_as_verl
@documented(_ARGS)
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index,
                                                           epsilon=1e-6, config=None, **kwargs):
    """verl's REINFORCE++ with baseline: ``(advantages, advantages)``, ``[bs, response_length]``.

    ``rl_triton.group_advantages(token_level_rewards.sum(-1), index,
    mode="reinforce_plus_plus_baseline", mask=response_mask)``: a_i = s_i - mean_g (a group of one
    has mean 0), then whitened over the valid tokens of the batch (row i counted once per valid
    token, unbiased variance, + 1e-8), on the valid tokens and 0 elsewhere. Fewer than two valid
    tokens raise ``ValueError``.
    """
    with torch.no_grad():
        r = _tensor(token_level_rewards, "token_level_rewards")
        m = _tensor(response_mask, "response_mask")
        _require_two_valid(m)
        scores = _scores(r)
        adv = group_advantages(scores, index, mode="reinforce_plus_plus_baseline", mask=m)
        adv = _as(adv, _promoted(scores.dtype, m.dtype))
        return adv, adv


_OURS = {name: globals()[name] for name in ESTIMATORS.values()}


# ---------------------------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------------------------

def _core_algos():
    """``verl.trainer.ppo.core_algos``, imported now; ``FrameworkNotInstalled`` where verl is not
    installed, an ImportError naming what is missing where verl is but a module it imports is not."""
    requires_framework(__name__, "verl", "verl", extra="verl")
    try:
        return importlib.import_module(_CORE_ALGOS)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing == "verl" or missing.startswith("verl.") or not missing:
            raise ImportError(f"rl_triton.integrations.verl needs verl (pip install verl; written against verl "
                              f"{VERL_VERSION}) to patch it: {e}") from e
        raise ImportError(f"verl is installed but {_CORE_ALGOS} cannot be imported: the module {missing!r}, which "
                          f"verl imports, is missing ({e})") from e


_module = None  # the core_algos module patched now
_replaced = {}  # attribute name -> verl's function that patch() replaced (module attribute or registry entry)
_saved_attrs = {}  # attribute name -> the module attribute before patch()
_saved_registry = {}  # registry name -> the registry entry before patch()


def _apply() -> None:
    global _module
    module = _core_algos()
    registry = getattr(module, "ADV_ESTIMATOR_REGISTRY", None)
    if not isinstance(registry, dict):
        registry = None
    for key, name in ESTIMATORS.items():
        ours = _OURS[name]
        if name in vars(module):
            _saved_attrs[name] = getattr(module, name)
            setattr(module, name, ours)
        if registry is not None and key in registry:
            _saved_registry[key] = registry[key]
            registry[key] = ours
        original = _saved_attrs.get(name, _saved_registry.get(key))
        if original is not None:
            _replaced[name] = original
    _module = module


def _restore() -> None:
    global _module
    module, _module = _module, None
    registry = getattr(module, "ADV_ESTIMATOR_REGISTRY", None)
    # only where ours is still in place: an object set there since (by someone else) stays
    for name, fn in _saved_attrs.items():
        if getattr(module, name, None) is _OURS[name]:
            setattr(module, name, fn)
    for key, fn in _saved_registry.items():
        if isinstance(registry, dict) and registry.get(key) is _OURS[ESTIMATORS[key]]:
            registry[key] = fn
    _saved_attrs.clear()
    _saved_registry.clear()
    _replaced.clear()


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route verl's advantage estimators (``ESTIMATORS``) through rl_triton until
    ``unpatch()``: the attributes of ``verl.trainer.ppo.core_algos`` and the entries of its
    ``ADV_ESTIMATOR_REGISTRY`` under those names (those that exist in the installed verl).
    Imports verl; ``ImportError`` where it cannot. Idempotent. Thread-safe.

    Call it in the process that runs the trainer's ``compute_advantage`` (the driver; with
    ``verl.trainer.main_ppo`` that is the ``TaskRunner`` Ray actor, see docs/verl.md). The patch is
    shared with ``patched()`` blocks, which may be open in other threads: verl is patched while
    ``patch()`` is in effect or any block is open."""
    _core_algos()
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``. verl's own function objects (the same objects) are back in the
    module and the registry at once, or, while ``patched()`` blocks are open (in any thread),
    when the last of them closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether verl's advantage estimators are routed through rl_triton now."""
    return _state.active


def patched():
    """``with patched(): ...``: verl is patched for the block, and the block's hold on the patch
    ends with it. Blocks nest, also across threads: each holds the patch until it closes, and
    verl's own objects come back when the last holder (block or ``patch()``) lets go. Imports
    verl when called (``ImportError`` where it cannot)."""
    _core_algos()
    return _state.patched()
