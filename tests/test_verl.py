"""rl_triton.integrations.verl against verl 0.9.1's advantage estimators.

- exactness of the drop-ins against transcriptions of verl's functions (below), on the "cpu"
  (numba) and "torch" backends: float64 to 1e-12, float32 to 1e-6; masks with holes, all-masked
  rows, observation spans; groups of one; string uids;
- dtypes (verl's type promotion, the mask's dtype included), detached outputs, errors;
- patch()/unpatch()/patched()/is_patched() on a fake ``verl`` package built from the
  transcriptions (idempotent, nested, across threads, the very same objects restored, the
  trainer's calls through module attributes and the registry reaching rl_triton);
- the real verl, where it is importable (tests marked ``framework``: .ci/run's frameworks stage
  installs verl 0.9.1 for them): the transcriptions against verl's functions, each drop-in against
  verl's function, verl's errors, the patched registry, and ``ray_trainer.compute_advantage``
  patched against not.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import subprocess
import sys
import types
import uuid
from collections import defaultdict
from enum import Enum
from typing import Any, Optional

import numpy as np
import pytest
import torch

import rl_triton.integrations.verl as rt_verl
from rl_triton.testing.frameworks import verl_gae, verl_grpo

from helpers import concurrent_patch_use, nested_blocks_across_threads, run_python_block

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-12, F32: 1e-6}
CORE = "verl.trainer.ppo.core_algos"


# ---------------------------------------------------------------------------------------------
# verl 0.9.1, transcribed from the wheel verl-0.9.1-py3-none-any.whl:
#   verl/utils/torch_functional.py: masked_sum, masked_mean, masked_var, masked_whiten
#   verl/utils/groupwise.py: as_torch_index, group_mean_std
#   verl/trainer/ppo/core_algos.py: AdvantageEstimator, ADV_ESTIMATOR_REGISTRY, register_adv_est,
#     get_adv_estimator_fn, compute_gae_advantage_return, compute_grpo_outcome_advantage,
#     compute_grpo_vectorized_outcome_advantage, compute_rloo_outcome_advantage,
#     compute_rloo_vectorized_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
#     compute_reinforce_plus_plus_baseline_outcome_advantage
#   verl/trainer/ppo/ray_trainer.py: compute_advantage (the dispatch, on plain dicts)
# The GAE loop is rl_triton.testing.frameworks.verl_gae (unchanged from verl 0.5 to 0.9.1).
# masked_mean divides by mask.sum() + 1e-8; COUNT_GUARD holds that 1e-8 so that a float64
# comparison at 1e-12 can remove it (it shifts the mean by 1e-8 / n relative), see without_guards().
# ---------------------------------------------------------------------------------------------

COUNT_GUARD = [1e-8]


@contextlib.contextmanager
def without_guards():
    """verl's formulas without its count guard; pass it a float64 mask too, so that its Bessel
    factor n / (n - 1) is not rounded to float32 (an integer mask makes int64 / int64 float32)."""
    COUNT_GUARD[0] = 0.0
    try:
        yield
    finally:
        COUNT_GUARD[0] = 1e-8


def verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + COUNT_GUARD[0])


def verl_masked_var(values, mask, unbiased=True):
    mean = verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_as_torch_index(index, device=None):
    target = torch.device("cpu") if device is None else torch.device(device)  # verl: cpu under pytest
    if isinstance(index, torch.Tensor):
        t = index.reshape(-1)
        if t.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool):
            return t.to(device=target, dtype=torch.long)
        if t.dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
            t64 = t.to(dtype=torch.float64)
            rounded = torch.round(t64)
            if torch.allclose(t64, rounded, rtol=0.0, atol=1e-6):
                return rounded.to(device=target, dtype=torch.long)
            arr = np.array([str(x.item()) for x in t], dtype=object)
        else:
            arr = np.array([str(x.item()) if hasattr(x, "item") else str(x) for x in t], dtype=object)
    else:
        try:
            arr = np.asarray(index)
        except Exception:
            arr = np.array(list(index), dtype=object)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.dtype != object and np.issubdtype(arr.dtype, np.integer):
            return torch.from_numpy(arr.astype(np.int64, copy=False)).to(device=target)
        if arr.dtype != object and np.issubdtype(arr.dtype, np.floating):
            arr64 = arr.astype(np.float64, copy=False)
            rounded = np.rint(arr64)
            if np.allclose(arr64, rounded, rtol=0.0, atol=1e-6):
                return torch.from_numpy(rounded.astype(np.int64)).to(device=target)
        try:
            coerced = arr.astype(np.int64)
            return torch.from_numpy(coerced).to(device=target)
        except Exception:
            pass
        if arr.dtype != object:
            arr = arr.astype(object)
    try:
        _, inv = np.unique(arr, return_inverse=True)
    except Exception:
        sarr = np.array([str(x) for x in arr], dtype=object)
        _, inv = np.unique(sarr, return_inverse=True)
    inv = inv.astype(np.int64, copy=False)
    return torch.from_numpy(inv).to(device=target)


@torch.no_grad()
def verl_group_mean_std(scores, gidx, eps=1e-6, device=None):
    target = torch.device("cpu") if device is None else torch.device(device)
    scores = scores.reshape(-1).to(device=target, dtype=torch.float32)
    gidx = gidx.reshape(-1).to(device=target, dtype=torch.long)
    if scores.numel() != gidx.numel():
        raise ValueError(f"scores and gidx length mismatch: {scores.numel()} vs {gidx.numel()}")
    G = int(torch.max(gidx).item()) + 1 if gidx.numel() > 0 else 0
    if G == 0:
        empty = torch.empty(0, device=target, dtype=torch.float32)
        return empty, empty, empty
    ones = torch.ones_like(scores, dtype=torch.float32)
    count = torch.zeros(G, device=target, dtype=torch.float32).index_add_(0, gidx, ones)
    s1 = torch.zeros(G, device=target, dtype=torch.float32).index_add_(0, gidx, scores)
    mean = s1 / count.clamp_min(1.0)
    centered = scores - mean[gidx]
    var_num = torch.zeros(G, device=target, dtype=torch.float32).index_add_(0, gidx, centered * centered)
    denom = (count - 1.0).clamp_min(1.0)
    var = var_num / denom
    std = torch.sqrt(torch.clamp(var, min=eps))
    single = count <= 1.0
    if torch.any(single):
        mean = mean.clone()
        std = std.clone()
        mean[single] = 0.0
        std[single] = 1.0
    return mean, std, count


class AdvantageEstimator(str, Enum):
    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: torch.Tensor,
    lam: torch.Tensor,
):
    with torch.no_grad():
        advantages, returns = verl_gae(token_level_rewards, values, response_mask, gamma, lam)
        advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the same loop in 0.9.1 as in rl_triton.testing.frameworks.verl_grpo
    scores = verl_grpo(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo)
    return scores, scores


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g = verl_as_torch_index(index, device=scores.device)
        mean_g, std_g, _ = verl_group_mean_std(scores, g, eps=0.0, device=scores.device)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean_g[g]) / (std_g[g] + epsilon)
        else:
            scalars = scores - mean_g[g]
        advantages = scalars.unsqueeze(-1) * response_mask
        return advantages, advantages


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = verl_masked_whiten(scores, response_mask) * response_mask
    return scores, scores


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            response_num = len(id2score[index[i]])
            if response_num > 1:
                scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[index[i]] * response_num / (
                    response_num - 1
                )
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Optional[Any] = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    assert config is not None
    gamma = config.gamma
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = new_running_return * response_mask[:, t]
            running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
        advantages = verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Optional[Any] = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        inv = torch.from_numpy(np.unique(index, return_inverse=True)[1]).to(scores.device)
        c = torch.bincount(inv)[inv].to(scores.dtype)
        adv = ((c * scores - torch.bincount(inv, weights=scores)[inv]) / (c - 1).clamp_min(1)) * (c > 1)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask, config=None, **kwargs):
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


VERL = {  # registry name -> the transcription
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,  # one that stays verl's
}


def verl_compute_advantage(core_algos, batch, non_tensor_batch, adv_estimator, gamma=1.0, lam=1.0,
                           norm_adv_by_std_in_grpo=True, config=None):
    """ray_trainer.compute_advantage's dispatch (the pf_ppo reweighting left out), on dicts."""
    if adv_estimator == AdvantageEstimator.GAE:
        advantages, returns = core_algos.compute_gae_advantage_return(
            token_level_rewards=batch["token_level_rewards"],
            values=batch["values"],
            response_mask=batch["response_mask"],
            gamma=gamma,
            lam=lam,
        )
    elif adv_estimator == AdvantageEstimator.GRPO:
        grpo_calculation_mask = batch["response_mask"]
        advantages, returns = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=batch["token_level_rewards"],
            response_mask=grpo_calculation_mask,
            index=non_tensor_batch["uid"],
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
    else:
        adv_estimator_fn = core_algos.get_adv_estimator_fn(adv_estimator)
        adv_kwargs = {
            "token_level_rewards": batch["token_level_rewards"],
            "response_mask": batch["response_mask"],
            "config": config,
        }
        if "uid" in non_tensor_batch:
            adv_kwargs["index"] = non_tensor_batch["uid"]
        if "reward_baselines" in batch:
            adv_kwargs["reward_baselines"] = batch["reward_baselines"]
        advantages, returns = adv_estimator_fn(**adv_kwargs)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# a fake verl package: the transcriptions behind verl's module layout and registry
# ---------------------------------------------------------------------------------------------

def _counted(fn, calls):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        calls[fn.__name__] += 1
        return fn(*args, **kwargs)

    return call


def _build_core_algos(names=tuple(VERL)):
    """A ``core_algos`` module: verl's registry functions and, for each registry name in
    ``names``, a module attribute and a registry entry (the same object) counting its calls."""
    core = types.ModuleType(CORE)
    core.calls = defaultdict(int)
    core.AdvantageEstimator = AdvantageEstimator
    core.ADV_ESTIMATOR_REGISTRY = registry = {}

    def register_adv_est(name_or_enum):
        def decorator(fn):
            name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
            if name in registry and registry[name] != fn:
                raise ValueError(f"Adv estimator {name} has already been registered: {registry[name]} vs {fn}")
            registry[name] = fn
            return fn

        return decorator

    def get_adv_estimator_fn(name_or_enum):
        name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
        if name not in registry:
            raise ValueError(f"Unknown advantage estimator simply: {name}")
        return registry[name]

    core.register_adv_est, core.get_adv_estimator_fn = register_adv_est, get_adv_estimator_fn
    for key in names:
        fn = register_adv_est(key)(_counted(VERL[key], core.calls))
        setattr(core, fn.__name__, fn)
    return core


def _install(monkeypatch, core):
    parts = {}
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        parts[name] = types.ModuleType(name)
        parts[name].__path__ = []
        monkeypatch.setitem(sys.modules, name, parts[name])
    monkeypatch.setitem(sys.modules, CORE, core)
    parts["verl"].trainer, parts["verl.trainer"].ppo, parts["verl.trainer.ppo"].core_algos = (
        parts["verl.trainer"], parts["verl.trainer.ppo"], core)
    return core


@pytest.fixture
def fake_verl(monkeypatch):
    return _install(monkeypatch, _build_core_algos())


@pytest.fixture
def no_verl(monkeypatch):
    """verl's core_algos not imported: the drop-ins raise their own errors."""
    monkeypatch.delitem(sys.modules, CORE, raising=False)


@pytest.fixture(autouse=True)
def _left_unpatched():
    yield
    leaked = rt_verl.is_patched()
    rt_verl.unpatch()
    assert not leaked and not rt_verl.is_patched(), "a test left verl patched"


@pytest.fixture
def rt_backend(cpu_backend, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", cpu_backend)
    return cpu_backend


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

B, L = 23, 11
MASKS = ("holes", "response", "spans")


def _mask(kind, seed, B=B, L=L):
    """An int64 0/1 mask with all-masked rows (1 and 7)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "holes":
        m = torch.rand(B, L, generator=g) < 0.7
    elif kind == "response":  # a valid prefix of random length per row, 0 included
        m = torch.arange(L) < torch.randint(0, L + 1, (B, 1), generator=g)
    else:  # multi-turn: valid spans and observation spans alternate
        m = torch.zeros(B, L, dtype=torch.bool)
        for i in range(B):
            t, on = 0, bool(torch.randint(0, 2, (), generator=g))
            while t < L:
                n = int(torch.randint(1, 4, (), generator=g))
                m[i, t:t + n] = on
                t, on = t + n, not on
    m[1] = False
    m[7] = False
    m[0, :2] = True
    return m.to(torch.int64)


def _data(dtype, seed, B=B, L=L):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, L, generator=g, dtype=F64).to(dtype)
    v = torch.randn(B, L, generator=g, dtype=F64).to(dtype)
    return r, v


def _uids(seed, B=B, style="str"):
    """One group id per response: groups of 1 to 5 in shuffled order, at least two groups of one."""
    rng = np.random.default_rng(seed)
    sizes = [1, 1, 2, 3, 4, 5]
    while sum(sizes) < B:
        sizes.append(int(rng.integers(1, 6)))
    group = np.repeat(np.arange(len(sizes)), sizes)[:B]
    group = group[rng.permutation(B)]
    keys = [str(uuid.UUID(bytes=rng.bytes(16))) for _ in sizes]
    if style == "str":
        return np.array([keys[k] for k in group], dtype=object)
    if style == "int":
        return rng.choice(10**6, size=len(sizes), replace=False)[group]
    return [keys[k] for k in group]  # a list


def _close(actual, expected, tol):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True)


def _ours(key):
    return getattr(rt_verl, rt_verl.ESTIMATORS[key])


# ---------------------------------------------------------------------------------------------
# signatures
# ---------------------------------------------------------------------------------------------

def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("key", sorted(rt_verl.ESTIMATORS))
def test_signatures_are_verls(key):
    assert _params(_ours(key)) == _params(VERL[key])
    assert _ours(key).__name__ == VERL[key].__name__


# ---------------------------------------------------------------------------------------------
# exactness: GAE and REINFORCE++ (the scans, on both CPU backends)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_gae_matches_verl(rt_backend, no_verl, dtype, kind):
    r, v = _data(dtype, seed=3)
    m = _mask(kind, seed=4)
    for gamma, lam in ((0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (torch.tensor(0.97, dtype=F64), torch.tensor(0.9))):
        adv, ret = rt_verl.compute_gae_advantage_return(r, v, m, gamma, lam)
        want_adv, want_ret = compute_gae_advantage_return(r, v, m, gamma, lam)
        assert adv.dtype == want_adv.dtype == dtype and ret.dtype == want_ret.dtype == dtype
        _close(ret, want_ret, TOL[dtype])
        if dtype == F64:
            # verl's count guard and float32 Bessel factor move it off the formula by < 1e-7 relative
            _close(adv, want_adv, 1e-7)
            with without_guards():
                want_adv, _ = compute_gae_advantage_return(r, v, m.to(F64), gamma, lam)
        _close(adv, want_adv, TOL[dtype])


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_reinforce_plus_plus_matches_verl(rt_backend, no_verl, dtype, kind):
    r, _ = _data(dtype, seed=5)
    m = _mask(kind, seed=6)
    for gamma in (0.99, 1.0, 0.0):
        config = types.SimpleNamespace(gamma=gamma)
        adv, ret = rt_verl.compute_reinforce_plus_plus_outcome_advantage(r, m, config=config, index=None)
        want_adv, want_ret = compute_reinforce_plus_plus_outcome_advantage(r, m, config=config)
        assert adv.dtype == want_adv.dtype and ret.dtype == want_ret.dtype == dtype
        _close(ret, want_ret, TOL[dtype])
        assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()
        if dtype == F64:
            _close(adv, want_adv, 1e-7)
            with without_guards():
                want_adv, _ = compute_reinforce_plus_plus_outcome_advantage(r, m.to(F64), config=config)
        _close(adv, want_adv, TOL[dtype])


# ---------------------------------------------------------------------------------------------
# exactness: the group estimators
# ---------------------------------------------------------------------------------------------

GROUP_KEYS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline")


@pytest.mark.parametrize("style", ["str", "int", "list"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("key", GROUP_KEYS)
def test_group_estimators_match_verl(no_verl, key, dtype, kind, style):
    seed = 11 + MASKS.index(kind)
    r, _ = _data(dtype, seed=seed)
    m = _mask(kind, seed=seed + 1)
    index = _uids(seed + 2, style=style)
    extra = [{}]
    if key in ("grpo", "grpo_vectorized"):
        extra = [{}, {"norm_adv_by_std_in_grpo": False}, {"epsilon": 1e-3}]
    for kw in extra:
        adv, ret = _ours(key)(r, m, index, **kw)
        want, want_ret = VERL[key](r.clone(), m, index, **kw)
        assert adv is ret and want is want_ret
        assert adv.dtype == want.dtype == dtype and adv.shape == (B, L)
        assert (adv[m == 0] == 0).all()
        if dtype == F64 and key == "grpo_vectorized":
            _close(adv, want, 1e-6)  # verl's vectorized statistics are float32
            want, _ = compute_grpo_outcome_advantage(r.clone(), m, index, **kw)  # the same formula in float64
        if dtype == F64 and key == "reinforce_plus_plus_baseline":
            _close(adv, want, 1e-7)
            with without_guards():
                want, _ = VERL[key](r.clone(), m.to(F64), index)
        _close(adv, want, TOL[dtype])


def test_groups_of_one():
    """GRPO: mean 0, std 1 (the divisor 1 + eps in float32); RLOO keeps the raw score, vectorized
    RLOO gives 0; REINFORCE++ baseline subtracts nothing before the whitening."""
    r = torch.tensor([[1.5, 0.0], [2.0, 0.0], [-1.0, 0.0], [4.0, 0.0]], dtype=F64)
    m = torch.ones(4, 2, dtype=torch.int64)
    index = np.array(["a", "b", "b", "c"], dtype=object)
    for key in GROUP_KEYS:
        # vectorized GRPO's float32 statistics and the whitening's float32 Bessel factor: 1e-7
        tol = 1e-12 if key in ("grpo", "rloo", "rloo_vectorized") else 1e-7
        _close(_ours(key)(r, m, index)[0], VERL[key](r.clone(), m, index)[0], tol)
    assert _ours("rloo")(r, m, index)[0][0, 0] == 1.5
    assert _ours("rloo_vectorized")(r, m, index)[0][0, 0] == 0.0
    assert _ours("grpo")(r, m, index)[0][0, 0] == 1.5 / float(torch.tensor(1.0) + 1e-6)


# ---------------------------------------------------------------------------------------------
# dtypes, devices, autograd, non-finite masked tokens
# ---------------------------------------------------------------------------------------------

MASK_DTYPES = [torch.int64, torch.bool, torch.float32, torch.float64]


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
@pytest.mark.parametrize("dtype", [F32, F64, torch.bfloat16])
@pytest.mark.parametrize("key", sorted(rt_verl.ESTIMATORS))
def test_dtypes_follow_verls_promotion(no_verl, key, dtype, mask_dtype):
    r, v = _data(dtype, seed=21)
    m = _mask("holes", seed=22).to(mask_dtype)
    index = _uids(23)
    args = {"gae": (r, v, m, 0.99, 0.95)}.get(key, (r, m) if key == "reinforce_plus_plus" else (r, m, index))
    kw = {"config": types.SimpleNamespace(gamma=0.99)} if key == "reinforce_plus_plus" else {}
    ours = _ours(key)(*args, **kw)
    try:
        theirs = VERL[key](*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kw)
    except RuntimeError:  # verl's scans compute 1 - mask, which a bool mask cannot do
        assert mask_dtype == torch.bool and key in ("gae", "reinforce_plus_plus")
        return
    assert [t.dtype for t in ours] == [t.dtype for t in theirs]
    assert all(t.device == r.device and not t.requires_grad for t in ours)
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(ours, theirs):
        _close(a.to(F64), b.to(F64), tol)


@pytest.mark.parametrize("key", sorted(rt_verl.ESTIMATORS))
def test_outputs_are_detached(no_verl, key):
    r, v = _data(F32, seed=31)
    r.requires_grad_(True)
    v.requires_grad_(True)
    m = _mask("holes", seed=32)
    args = {"gae": (r, v, m, 0.99, 0.95)}.get(key, (r, m) if key == "reinforce_plus_plus" else (r, m, _uids(33)))
    kw = {"config": types.SimpleNamespace(gamma=0.99)} if key == "reinforce_plus_plus" else {}
    assert not any(t.requires_grad for t in _ours(key)(*args, **kw))


def test_non_finite_masked_tokens_stay_there(rt_backend, no_verl):
    """A NaN reward and an inf value at a masked token: selected away here, where verl multiplies
    them by 0 and so spreads NaN over its whole whitening."""
    r, v = _data(F64, seed=41)
    m = _mask("spans", seed=42)
    hole = tuple((m == 0).nonzero()[3].tolist())
    r[hole], v[hole] = float("nan"), float("inf")
    config = types.SimpleNamespace(gamma=0.99)
    for ours, theirs in ((rt_verl.compute_gae_advantage_return(r, v, m, 0.99, 0.95),
                          compute_gae_advantage_return(r, v, m, 0.99, 0.95)),
                         (rt_verl.compute_reinforce_plus_plus_outcome_advantage(r, m, config=config),
                          compute_reinforce_plus_plus_outcome_advantage(r, m, config=config))):
        assert torch.isfinite(ours[0][m != 0]).all() and torch.isfinite(ours[1][m != 0]).all()
        assert torch.isnan(theirs[0][m != 0]).all()
    # a NaN score (verl sums every token of the row, masked ones included) stays off the masked tokens
    adv, _ = rt_verl.compute_grpo_outcome_advantage(r, m, _uids(43))
    assert (adv[m == 0] == 0).all() and torch.isnan(adv[hole[0]][m[hole[0]] != 0]).all()
    assert torch.isnan(compute_grpo_outcome_advantage(r.clone(), m, _uids(43))[0][hole[0]]).all()


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

WHITENING = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _call(fn, key, r, v, m, index):
    if key == "gae":
        return fn(r, v, m, 0.99, 0.95)
    if key == "reinforce_plus_plus":
        return fn(r, m, config=types.SimpleNamespace(gamma=0.99))
    return fn(r, m, index)


@pytest.mark.parametrize("valid", [0, 1])
@pytest.mark.parametrize("key", WHITENING)
def test_whitening_needs_two_valid_tokens(no_verl, key, valid):
    r, v = _data(F32, seed=51)
    m = torch.zeros(B, L, dtype=torch.int64)
    m.view(-1)[:valid] = 1
    with pytest.raises(ValueError, match="at least 2"):
        _call(_ours(key), key, r, v, m, _uids(52))
    with pytest.raises(ValueError):
        _call(VERL[key], key, r.clone(), v, m, _uids(52))


def test_outcome_estimators_accept_an_empty_mask(no_verl):
    r, _ = _data(F32, seed=53)
    m = torch.zeros(B, L, dtype=torch.int64)
    for key in ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized"):
        adv, _ = _ours(key)(r, m, _uids(54))
        assert (adv == 0).all()


def test_reinforce_plus_plus_needs_config(no_verl):
    r, _ = _data(F32, seed=55)
    m = _mask("holes", seed=56)
    with pytest.raises(ValueError, match="config"):
        rt_verl.compute_reinforce_plus_plus_outcome_advantage(r, m)
    with pytest.raises(AssertionError):  # as verl's assert
        rt_verl.compute_reinforce_plus_plus_outcome_advantage(r, m, config=None)
    with pytest.raises(AssertionError):
        compute_reinforce_plus_plus_outcome_advantage(r, m)


def test_errors_are_verls_while_verl_is_imported(fake_verl):
    """With verl's core_algos imported (patched or not), a failing call raises verl's own error."""
    r, v = _data(F32, seed=57)
    zeros = torch.zeros(B, L, dtype=torch.int64)
    for holder in (contextlib.nullcontext, rt_verl.patched):
        with holder():
            with pytest.raises(ValueError, match=r"^At least one element in the mask has to be 1\.$"):
                rt_verl.compute_gae_advantage_return(r, v, zeros, 0.99, 0.95)
            with pytest.raises(AssertionError) as info:
                rt_verl.compute_reinforce_plus_plus_outcome_advantage(r, zeros)
            assert type(info.value) is AssertionError
            with pytest.raises(TypeError, match="reward_baselines"):  # no **kwargs in verl's signature
                rt_verl.compute_grpo_vectorized_outcome_advantage(r, zeros, _uids(58), reward_baselines=r[:, 0])
            # where verl accepts the arguments, ours raises its own: gamma outside [0, 1]
            with pytest.raises(ValueError, match="gamma"):
                rt_verl.compute_gae_advantage_return(r, v, _mask("holes", 59), 1.5, 0.95)


# ---------------------------------------------------------------------------------------------
# patching (the fake verl)
# ---------------------------------------------------------------------------------------------

def _snapshot(core):
    return {name: getattr(core, name) for name in rt_verl.ESTIMATORS.values()}, dict(core.ADV_ESTIMATOR_REGISTRY)


def _assert_verls(core, before):
    attrs, registry = before
    for name, fn in attrs.items():
        assert getattr(core, name) is fn
    assert core.ADV_ESTIMATOR_REGISTRY.keys() == registry.keys()
    assert all(core.ADV_ESTIMATOR_REGISTRY[k] is registry[k] for k in registry)


def _routes_ours(core):
    return (rt_verl.is_patched()
            and all(getattr(core, name) is _ours(key) for key, name in rt_verl.ESTIMATORS.items())
            and all(core.ADV_ESTIMATOR_REGISTRY[key] is _ours(key) for key in rt_verl.ESTIMATORS))


def test_patch_unpatch_round_trip(fake_verl):
    core = fake_verl
    before = _snapshot(core)
    remax = core.ADV_ESTIMATOR_REGISTRY["remax"]
    assert not rt_verl.is_patched()
    rt_verl.patch()
    rt_verl.patch()  # idempotent
    assert _routes_ours(core)
    grpo_vectorized = core.get_adv_estimator_fn(AdvantageEstimator.GRPO_VECTORIZED)
    assert grpo_vectorized is rt_verl.compute_grpo_vectorized_outcome_advantage
    assert core.ADV_ESTIMATOR_REGISTRY["remax"] is remax  # not ours: left alone
    assert core.ADV_ESTIMATOR_REGISTRY.keys() == before[1].keys()
    rt_verl.unpatch()
    rt_verl.unpatch()  # idempotent
    assert not rt_verl.is_patched()
    _assert_verls(core, before)
    with rt_verl.patched():
        assert _routes_ours(core)
        with rt_verl.patched():
            assert _routes_ours(core)
        assert _routes_ours(core)
    assert not rt_verl.is_patched()
    _assert_verls(core, before)
    rt_verl.patch()  # the same objects again
    assert _routes_ours(core)
    rt_verl.unpatch()
    _assert_verls(core, before)


def test_patch_and_unpatch_inside_patched_blocks(fake_verl):
    core = fake_verl
    before = _snapshot(core)
    with rt_verl.patched():
        rt_verl.patch()
        rt_verl.unpatch()
        assert _routes_ours(core)  # the block still holds it
    _assert_verls(core, before)
    with rt_verl.patched():
        rt_verl.patch()
    assert _routes_ours(core)  # patch() outlives the block
    rt_verl.unpatch()
    assert not rt_verl.is_patched()
    _assert_verls(core, before)


def _batch(seed, dtype=F32):
    r, v = _data(dtype, seed=seed)
    m = _mask("spans", seed=seed + 1)
    return {"token_level_rewards": r, "values": v, "response_mask": m}, {"uid": _uids(seed + 2)}


class AlgoConfig(dict):
    """Attribute and ``get`` access, as verl's AlgoConfig / DictConfig."""

    __getattr__ = dict.__getitem__


@pytest.mark.parametrize("estimator", [AdvantageEstimator(k) for k in rt_verl.ESTIMATORS])
def test_trainer_calls_reach_rl_triton(fake_verl, estimator):
    """ray_trainer.compute_advantage's calls (module attributes for GAE and GRPO, the registry
    for the others) run rl_triton while patched and verl's functions otherwise."""
    core = fake_verl
    batch, non_tensor = _batch(61)
    kw = dict(gamma=0.99, lam=0.95, config=AlgoConfig(gamma=0.99, lam=0.95))
    theirs = verl_compute_advantage(core, {k: x.clone() for k, x in batch.items()}, non_tensor, estimator, **kw)
    assert sum(core.calls.values()) == 1
    core.calls.clear()
    with rt_verl.patched():
        ours = verl_compute_advantage(core, batch, non_tensor, estimator, **kw)
    assert not core.calls  # verl's functions did not run
    for a, b in zip(ours, theirs):
        _close(a, b, 1e-6)
    # a registry entry that stays verl's still runs verl's
    batch["reward_baselines"] = torch.zeros(B)
    with rt_verl.patched():
        verl_compute_advantage(core, batch, non_tensor, "remax", config=kw["config"])
    assert core.calls == {"compute_remax_outcome_advantage": 1}


def test_older_verl_without_some_estimators(monkeypatch):
    """Only the attributes and registry entries the installed verl has are replaced, and no
    registry entry is added."""
    core = _install(monkeypatch, _build_core_algos(names=("gae", "grpo", "rloo", "remax")))
    before = _snapshot_present(core)
    with rt_verl.patched():
        assert sorted(core.ADV_ESTIMATOR_REGISTRY) == ["gae", "grpo", "remax", "rloo"]
        assert core.ADV_ESTIMATOR_REGISTRY["rloo"] is rt_verl.compute_rloo_outcome_advantage
        assert core.compute_gae_advantage_return is rt_verl.compute_gae_advantage_return
        assert not hasattr(core, "compute_rloo_vectorized_outcome_advantage")
    attrs, registry = before
    assert all(getattr(core, name) is fn for name, fn in attrs.items())
    assert core.ADV_ESTIMATOR_REGISTRY == registry and all(core.ADV_ESTIMATOR_REGISTRY[k] is registry[k]
                                                           for k in registry)


def _snapshot_present(core):
    names = [n for n in rt_verl.ESTIMATORS.values() if hasattr(core, n)]
    return {n: getattr(core, n) for n in names}, dict(core.ADV_ESTIMATOR_REGISTRY)


def test_unpatch_leaves_objects_set_by_others(fake_verl):
    core = fake_verl

    def custom(**kwargs):
        return None

    with rt_verl.patched():
        core.compute_grpo_outcome_advantage = custom
        core.ADV_ESTIMATOR_REGISTRY["rloo"] = custom
    assert core.compute_grpo_outcome_advantage is custom and core.ADV_ESTIMATOR_REGISTRY["rloo"] is custom
    assert core.compute_gae_advantage_return is not rt_verl.compute_gae_advantage_return


def test_patched_blocks_nest_across_threads(fake_verl):
    core = fake_verl
    before = _snapshot(core)
    assert nested_blocks_across_threads(rt_verl.patched, lambda: _routes_ours(core)) == [True]
    assert not rt_verl.is_patched()
    _assert_verls(core, before)


def test_patch_state_under_concurrent_use(fake_verl):
    core = fake_verl
    before = _snapshot(core)
    assert not concurrent_patch_use(rt_verl.patched, rt_verl.patch, rt_verl.unpatch, lambda: _routes_ours(core))
    assert not rt_verl.is_patched()
    _assert_verls(core, before)


def test_patch_without_verl_raises_import_error(monkeypatch):
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verl", None)  # not importable
    with pytest.raises(ImportError, match="needs verl"):
        rt_verl.patch()
    with pytest.raises(ImportError, match="needs verl"):
        rt_verl.patched()
    assert not rt_verl.is_patched()
    rt_verl.unpatch()  # nothing to withdraw


def test_patch_names_a_missing_dependency_of_verl(monkeypatch, tmp_path):
    (tmp_path / "core_algos.py").write_text("import rl_triton_test_absent_dependency\n")
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        module = types.ModuleType(name)
        module.__path__ = [str(tmp_path)] if name == "verl.trainer.ppo" else []
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, CORE, raising=False)
    with pytest.raises(ImportError, match="'rl_triton_test_absent_dependency', which verl imports, is missing"):
        rt_verl.patch()
    assert not rt_verl.is_patched()


def test_importing_the_integration_does_not_import_verl():
    code = ("import sys, rl_triton, rl_triton.integrations.verl as v; "
            "assert not any(n == 'verl' or n.startswith('verl.') for n in sys.modules); print(v.ESTIMATORS['gae'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "compute_gae_advantage_return"


# ---------------------------------------------------------------------------------------------
# the real verl, where it is importable (.ci/run's frameworks stage installs verl 0.9.1)
# ---------------------------------------------------------------------------------------------

def _real_core_algos():
    return pytest.importorskip(CORE, reason="verl (and what verl.trainer.ppo.core_algos imports) not installed")


def _args(key, r, v, m, uid, config, **extra):
    """The keyword arguments of one estimator, as ray_trainer.compute_advantage passes them."""
    if key == "gae":
        return dict(token_level_rewards=r, values=v, response_mask=m, gamma=config.gamma, lam=config.lam)
    kw = dict(token_level_rewards=r.clone(), response_mask=m, config=config, **extra)
    if key != "reinforce_plus_plus":
        kw["index"] = uid
    return kw


def _real_tol(key, dtype):
    """Drop-in against verl verbatim: float32 rounding; in float64 verl's count guard and float32
    Bessel factor (2e-7), and vectorized GRPO's float32 group statistics (docs/verl.md, Rounding)."""
    return 1e-6 if dtype == F32 or key == "grpo_vectorized" else 2e-7


@pytest.fixture
def rl_triton_calls(monkeypatch):
    """Counts the rl_triton calls of the drop-ins (the functions they call, by module global)."""
    calls = []
    for name in ("gae", "group_advantages"):
        inner = getattr(rt_verl, name)
        monkeypatch.setattr(rt_verl, name, lambda *a, _inner=inner, _name=name, **k: calls.append(_name) or
                            _inner(*a, **k))
    return calls


@pytest.mark.framework
def test_real_verl_signatures():
    core = _real_core_algos()
    for key, name in rt_verl.ESTIMATORS.items():
        assert _params(_ours(key)) == _params(getattr(core, name)), name
        assert _params(VERL[key]) == _params(getattr(core, name)), name


@pytest.mark.framework
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_real_verl_is_the_transcription(dtype, kind):
    """This file's transcriptions (the oracle of the tests above) give the real verl's results,
    verl's count guard and roundings included, for every estimator they stand for."""
    core = _real_core_algos()
    r, v = _data(dtype, seed=91)
    m = _mask(kind, seed=92)
    uid = _uids(93)
    config = AlgoConfig(gamma=0.97, lam=0.9, use_pf_ppo=False)
    for key, fn in VERL.items():
        extra = {"reward_baselines": torch.randn(B, dtype=dtype)} if key == "remax" else {}
        theirs = getattr(core, fn.__name__)(**_args(key, r, v, m, uid, config, **extra))
        want = fn(**_args(key, r, v, m, uid, config, **extra))
        for a, b in zip(theirs, want):
            assert a.dtype == b.dtype, key
            _close(a, b, TOL[dtype])


@pytest.mark.framework
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_real_verl_functions_match_the_drop_ins(rt_backend, dtype, kind, rl_triton_calls):
    """Each drop-in against verl's own function (not patched) on random data (tolerances: _real_tol)."""
    core = _real_core_algos()
    r, v = _data(dtype, seed=101)
    m = _mask(kind, seed=102)
    uid = _uids(103)
    for gamma, lam in ((0.99, 0.95), (1.0, 1.0)):
        config = AlgoConfig(gamma=gamma, lam=lam, use_pf_ppo=False)
        for key, name in rt_verl.ESTIMATORS.items():
            variants = [{}] + ([{"norm_adv_by_std_in_grpo": False}, {"epsilon": 1e-3}] if "grpo" in key else [])
            for extra in variants:
                del rl_triton_calls[:]
                ours = _ours(key)(**_args(key, r, v, m, uid, config, **extra))
                assert rl_triton_calls, key
                theirs = getattr(core, name)(**_args(key, r, v, m, uid, config, **extra))
                for a, b in zip(ours, theirs):
                    assert a.dtype == b.dtype and a.shape == b.shape, (key, extra)
                    _close(a, b, _real_tol(key, dtype))


@pytest.mark.framework
def test_real_verl_errors_are_verls():
    """While verl is imported, a drop-in's error is verl's own, word for word."""
    core = _real_core_algos()
    r, v = _data(F32, seed=111)
    one = torch.zeros(B, L, dtype=torch.int64)
    one[3, 4] = 1
    for key in ("gae", "reinforce_plus_plus"):
        kw = _args(key, r, v, one, None, AlgoConfig(gamma=1.0, lam=0.95))
        with pytest.raises(ValueError) as theirs:
            getattr(core, rt_verl.ESTIMATORS[key])(**kw)
        with pytest.raises(ValueError) as ours:
            _ours(key)(**kw)
        assert str(ours.value) == str(theirs.value) and "division by zero" in str(ours.value)


@pytest.mark.framework
@pytest.mark.parametrize("dtype", [F64, F32])
def test_real_verl_patched_matches_unpatched(dtype, rl_triton_calls):
    core = _real_core_algos()
    attrs = {name: getattr(core, name) for name in rt_verl.ESTIMATORS.values()}
    registry = dict(core.ADV_ESTIMATOR_REGISTRY)
    batch, non_tensor = _batch(71, dtype)
    config = AlgoConfig(gamma=0.99, lam=0.95, use_pf_ppo=False)

    def run(key):
        kw = {"config": config} if key != "gae" else {}
        if key == "gae":
            args = (batch["token_level_rewards"], batch["values"], batch["response_mask"], 0.99, 0.95)
        elif key == "reinforce_plus_plus":
            args = (batch["token_level_rewards"].clone(), batch["response_mask"])
        else:
            args = (batch["token_level_rewards"].clone(), batch["response_mask"], non_tensor["uid"])
        return core.get_adv_estimator_fn(key)(*args, **kw)

    theirs = {key: run(key) for key in rt_verl.ESTIMATORS}
    assert not rl_triton_calls
    with rt_verl.patched():
        assert _routes_ours(core)
        ours = {key: run(key) for key in rt_verl.ESTIMATORS}
    assert len(rl_triton_calls) >= len(rt_verl.ESTIMATORS)
    for key in rt_verl.ESTIMATORS:
        for a, b in zip(ours[key], theirs[key]):
            assert a.dtype == b.dtype
            _close(a, b, _real_tol(key, dtype))
        assert _params(VERL[key]) == _params(registry[key])
    assert all(getattr(core, name) is fn for name, fn in attrs.items())
    assert dict(core.ADV_ESTIMATOR_REGISTRY).keys() == registry.keys()
    assert all(core.ADV_ESTIMATOR_REGISTRY[k] is registry[k] for k in registry)


@pytest.mark.framework
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("estimator,norm", [(k, True) for k in rt_verl.ESTIMATORS] + [("grpo", False)])
def test_real_verl_compute_advantage(estimator, norm, dtype, rl_triton_calls):
    """verl.trainer.ppo.ray_trainer.compute_advantage on a DataProto, patched against not: the
    trainer's own dispatch (module attributes for GAE and GRPO, the registry for the others)
    reaches rl_triton and gives verl's results."""
    ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer", reason="verl's trainer not importable")
    from verl.protocol import DataProto

    batch, non_tensor = _batch(81, dtype)
    config = AlgoConfig(gamma=0.99, lam=0.95, use_pf_ppo=False)

    def run():
        data = DataProto.from_dict(tensors={k: x.clone() for k, x in batch.items()},
                                   non_tensors={"uid": non_tensor["uid"]})
        out = ray_trainer.compute_advantage(data, adv_estimator=estimator, gamma=0.99, lam=0.95,
                                            norm_adv_by_std_in_grpo=norm, config=config)
        return out.batch["advantages"], out.batch["returns"]

    theirs = run()
    assert not rl_triton_calls
    with rt_verl.patched():
        ours = run()
    assert rl_triton_calls
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        _close(a, b, _real_tol(estimator, dtype))


@pytest.mark.framework
@pytest.mark.parametrize("page", ["verl"])
def test_framework_page_first_snippet_runs(page, tmp_path):
    """docs/verl.md's first ```python block (patch, unpatch, a patched block) runs as written in a
    fresh process with the real verl (tests/test_docs.py runs the other framework pages')."""
    _real_core_algos()
    done = run_python_block(f"docs/{page}.md", tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.framework
@pytest.mark.parametrize("penalty", ["kl", "abs", "mse", "low_var_kl", "k3+", "k1"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_real_verl_kl_penalty_then_gae(rt_backend, dtype, kind, penalty):
    """compute_gae_advantage_return_with_kl against verl's own steps: kl_penalty times the mask
    subtracted from the scores (what ray_trainer.apply_kl_penalty does), then verl's GAE."""
    core = _real_core_algos()
    scores, v = _data(dtype, seed=111)
    m = _mask(kind, seed=112).to(dtype)
    g = torch.Generator().manual_seed(113)
    lp = (-6 * torch.rand(B, L, generator=g, dtype=F64)).to(dtype)
    ref = (-6 * torch.rand(B, L, generator=g, dtype=F64)).to(dtype)
    lp[0, :3] = torch.tensor([-30.0, 0.0, 25.0], dtype=dtype)  # past k3's bounds both ways
    beta = 0.07
    kld = core.kl_penalty(lp, ref, kl_penalty=penalty) * m
    want = core.compute_gae_advantage_return(scores - beta * kld, v, m, 0.99, 0.95)
    got = rt_verl.compute_gae_advantage_return_with_kl(scores, v, m, lp, ref, beta, penalty, 0.99, 0.95)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        _close(a, b, _real_tol("gae", dtype))
