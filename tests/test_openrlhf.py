"""OpenRLHF's experience maker (transcribed below) against rl_triton.integrations.openrlhf: the
plain functions, the patch (on a stand-in openrlhf module tree, and on the real package where
it is installed), and the advantage normalisation across experiences, over gloo ranks too."""

from __future__ import annotations

import socket
import sys
import threading
import types

import pytest
import torch

import rl_triton.integrations.openrlhf as rt_openrlhf
from rl_triton.core import kernels
from rl_triton.integrations.openrlhf import get_advantages_and_returns, get_cumulative_returns, normalize_advantages
from rl_triton.testing import frameworks

from helpers import leave_rank_process

F64, F32 = torch.float64, torch.float32
BACKENDS = ["cpu", "torch"] + (["triton"] if kernels.AVAILABLE and kernels.INTERPRET else [])
MODULE = "openrlhf.trainer.ppo_utils.experience_maker"


# -- OpenRLHF, transcribed ----------------------------------------------------------------------
# OpenRLHF 0.11.2 (the PyPI wheel), openrlhf/trainer/ppo_utils/experience_maker.py, class
# RemoteExperienceMaker: get_advantages_and_returns and get_cumulative_returns (instance methods
# under @torch.no_grad(); self is not read), and in compute_advantages_and_returns the
# normalisation across experiences for the gae / reinforce / reinforce_baseline estimators.
# Upstream casts the concatenated advantages with .float(); `stat_dtype` keeps that float32 by
# default and lets a float64 test keep float64 statistics.
class ExperienceMaker:
    @torch.no_grad()
    def get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
        return frameworks.openrlhf_gae(values, rewards, action_mask, gamma, lambd)

    @torch.no_grad()
    def get_cumulative_returns(self, rewards, action_mask, gamma):
        response_length = rewards.size(1)
        returns = torch.zeros_like(rewards)
        cumulative_return = torch.zeros(rewards.size(0), device=rewards.device)
        if action_mask is not None:
            rewards = action_mask * rewards
        for t in reversed(range(response_length)):
            cumulative_return = rewards[:, t] + gamma * cumulative_return
            returns[:, t] = cumulative_return
        return returns


ORIGINAL_GAE = ExperienceMaker.__dict__["get_advantages_and_returns"]
ORIGINAL_RETURNS = ExperienceMaker.__dict__["get_cumulative_returns"]
TRANSCRIPTION = ExperienceMaker()


def openrlhf_normalize(advantages, action_masks, no_std_norm=False, stat_dtype=F32):
    all_advantages = torch.cat([a.flatten() for a in advantages], dim=0).to(stat_dtype)
    all_action_masks = torch.cat([m.flatten() for m in action_masks], dim=0)
    num_actions = all_action_masks.sum()
    mean = (all_advantages * all_action_masks).sum() / num_actions
    if not no_std_norm:
        var = ((all_advantages - mean).pow(2) * all_action_masks).sum() / num_actions
        rstd = var.clamp(min=1e-8).rsqrt()
    else:
        rstd = 1
    return [(a - mean) * rstd for a in advantages]


# -- data ---------------------------------------------------------------------------------------
def experience(B, dtype, seed, mask_dtype=torch.long, max_prompt=5, max_response=20, turns=1):
    """One micro-batch as OpenRLHF's samples generator builds it: per sample, the action mask over
    prompt + response tokens shifted by one ([1:]) with 1 on each action span (``turns`` spans:
    agent turns with observation tokens between them), right-padded with 0 to the longest; one
    sample with no action token (a response cut away by the length limit)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(B):
        prompt = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        mask = [0] * prompt
        for _ in range(turns):
            mask += [1] * int(torch.randint(1, max_response + 1, (1,), generator=g))
            mask += [0] * int(torch.randint(0, 4, (1,), generator=g))
        if i == 1:
            mask = [0] * len(mask)
        rows.append(torch.tensor(mask[1:], dtype=torch.long))
    width = max(len(r) for r in rows)
    action_mask = torch.zeros(B, width, dtype=torch.long)
    for i, r in enumerate(rows):
        action_mask[i, :len(r)] = r
    values = torch.randn(B, width, generator=g, dtype=F64).to(dtype)
    rewards = (torch.randn(B, width, generator=g, dtype=F64) * 0.1).to(dtype)
    eos = width - 1 - action_mask.fliplr().argmax(dim=1)  # compute_reward's last action token
    rewards[torch.arange(B), eos] += torch.randn(B, generator=g, dtype=F64).to(dtype)
    return values, rewards, action_mask.to(mask_dtype)


def _close(actual, expected, dtype):
    tol = 1e-12 if dtype == F64 else 1e-6
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True)


@pytest.fixture
def use_backend(request, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _unpatched():
    yield
    while rt_openrlhf.is_patched():
        rt_openrlhf.unpatch()


CASES = [  # (B, turns, max_response); T = 1 included
    (1, 1, 1), (6, 1, 1), (8, 1, 24), (5, 3, 6),
]


# -- the plain functions -------------------------------------------------------------------------
@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("B,turns,max_response", CASES)
@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool])
def test_gae_matches_openrlhf(use_backend, dtype, B, turns, max_response, mask_dtype):
    values, rewards, mask = experience(B, dtype, seed=B + turns, mask_dtype=mask_dtype, max_prompt=1 if
                                       max_response == 1 else 5, max_response=max_response, turns=turns)
    for gamma, lambd in ((1.0, 0.95), (0.99, 1.0), (0.9, 0.0)):
        want_adv, want_ret = TRANSCRIPTION.get_advantages_and_returns(values, rewards, mask, gamma, lambd)
        adv, ret = get_advantages_and_returns(values, rewards, mask, gamma, lambd)
        assert adv.dtype == ret.dtype == dtype and adv.shape == rewards.shape
        _close(adv, want_adv, dtype)
        _close(ret, want_ret, dtype)
    want = TRANSCRIPTION.get_advantages_and_returns(values, rewards, None, 0.99, 0.95)
    for got, w in zip(get_advantages_and_returns(values, rewards, None, 0.99, 0.95), want):
        _close(got, w, dtype)


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("B,turns,max_response", CASES)
def test_cumulative_returns_match_openrlhf(use_backend, dtype, B, turns, max_response):
    _, rewards, mask = experience(B, dtype, seed=10 + B, max_response=max_response, turns=turns)
    for gamma in (1.0, 0.97, 0.0):
        for m in (mask, mask.bool(), None):
            want = TRANSCRIPTION.get_cumulative_returns(rewards, m, gamma)
            got = get_cumulative_returns(rewards, m, gamma)
            assert got.dtype == dtype and got.shape == rewards.shape
            _close(got, want, dtype)


def test_dtypes_follow_openrlhf():
    values, rewards, mask = experience(4, F32, seed=3)
    # float32 rewards with float64 values: the loop promotes, and so does the call
    want_adv, want_ret = TRANSCRIPTION.get_advantages_and_returns(values.double(), rewards, mask, 1.0, 0.95)
    adv, ret = get_advantages_and_returns(values.double(), rewards, mask, 1.0, 0.95)
    assert adv.dtype == ret.dtype == F64
    _close(adv, want_adv, F32)
    _close(ret, want_ret, F32)
    # 16-bit rewards: OpenRLHF's running sum is float32, rounded into the rewards' dtype at each
    # step; the scan accumulates in float32 too
    for dtype in (torch.bfloat16, torch.float16):
        want = TRANSCRIPTION.get_cumulative_returns(rewards.to(dtype), mask, 0.99)
        got = get_cumulative_returns(rewards.to(dtype), mask, 0.99)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    # no gradients, as under OpenRLHF's @torch.no_grad()
    adv, ret = get_advantages_and_returns(values.requires_grad_(), rewards, mask, 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


def test_does_not_write_its_inputs():
    values, rewards, mask = experience(5, F32, seed=4, turns=2)
    copies = [t.clone() for t in (values, rewards, mask)]
    get_advantages_and_returns(values, rewards, mask, 1.0, 0.95)
    get_cumulative_returns(rewards, mask, 1.0)
    normalize_advantages([rewards, values], [mask, mask])
    for t, c in zip((values, rewards, mask), copies):
        assert torch.equal(t, c)


def test_bad_inputs():
    x = torch.zeros(3, 5)
    m = torch.ones(3, 5, dtype=torch.long)
    with pytest.raises(TypeError, match="values"):
        get_advantages_and_returns(x.numpy(), x, m, 1.0, 0.95)
    with pytest.raises(ValueError, match="rewards"):
        get_advantages_and_returns(x, torch.zeros(5), m, 1.0, 0.95)
    with pytest.raises(ValueError, match="values"):
        get_advantages_and_returns(torch.zeros(3, 4), x, m, 1.0, 0.95)
    with pytest.raises(ValueError, match="action_mask"):
        get_advantages_and_returns(x, x, m[:, :4], 1.0, 0.95)
    with pytest.raises(TypeError, match="action_mask"):
        get_cumulative_returns(x, [1, 0], 1.0)
    with pytest.raises(ValueError, match="gamma"):
        get_cumulative_returns(x, m, -0.5)
    with pytest.raises(TypeError, match="advantages"):
        normalize_advantages("adv", m)
    with pytest.raises(TypeError, match=r"advantages\[1\]"):
        normalize_advantages([x, None], [m, m])
    with pytest.raises(ValueError, match="action_masks"):
        normalize_advantages([x, x], [m])
    with pytest.raises(ValueError, match=r"action_masks\[0\]"):
        normalize_advantages([x], [m[:, :2]])
    with pytest.raises(TypeError, match="advantages"):
        normalize_advantages(m, m)
    with pytest.raises(TypeError, match="no_std"):
        normalize_advantages(x, m, no_std=1)


# -- normalize_advantages ------------------------------------------------------------------------
def _experiences(dtype, seed=0):
    """A step's experiences: micro-batches of different widths, action masks with holes, one
    micro-batch with a single sample."""
    out = [experience(B, dtype, seed=seed + B, turns=turns) for B, turns in ((4, 1), (1, 1), (6, 3), (3, 2))]
    advantages = [get_advantages_and_returns(v, r, m, 1.0, 0.95)[0] for v, r, m in out]
    return advantages, [m for _, _, m in out]


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("no_std", [False, True])
def test_normalize_matches_openrlhf(use_backend, no_std):
    for dtype, stat_dtype in ((F64, F64), (F32, F32)):
        advantages, masks = _experiences(dtype)
        want = openrlhf_normalize(advantages, masks, no_std_norm=no_std, stat_dtype=stat_dtype)
        got = normalize_advantages(advantages, masks, no_std=no_std)
        assert isinstance(got, list) and len(got) == len(want)
        for g, w, a in zip(got, want, advantages):
            assert g.shape == a.shape and g.dtype == dtype
            _close(g, w, dtype)
        # one tensor: the same as a list of one
        (w,) = openrlhf_normalize(advantages[:1], masks[:1], no_std_norm=no_std, stat_dtype=stat_dtype)
        _close(normalize_advantages(advantages[0], masks[0], no_std=no_std), w, dtype)


def test_normalize_dtypes_and_edges():
    advantages, masks = _experiences(F64)
    # OpenRLHF keeps float32 statistics for float64 advantages; the call keeps float64 (closer)
    want = openrlhf_normalize(advantages, masks)
    got = normalize_advantages(advantages, masks)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # 16-bit advantages: float32 statistics, the result in the advantages' dtype (OpenRLHF's 0-d
    # float32 mean and rstd do not promote them), rounded once here rather than at each operation
    half = [a.to(torch.bfloat16) for a in advantages]
    for g, w in zip(normalize_advantages(half, masks), openrlhf_normalize(half, masks)):
        assert g.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=1.6e-2, atol=1.6e-2)
    # bool and integer masks, mixed
    mixed = [m.bool() if i % 2 else m for i, m in enumerate(masks)]
    for g, w in zip(normalize_advantages(advantages, mixed), normalize_advantages(advantages, masks)):
        assert torch.equal(g, w)
    assert normalize_advantages([], []) == []
    # no action token in the whole step: NaN, as OpenRLHF's 0/0
    zero = [torch.zeros_like(m) for m in masks]
    assert all(torch.isnan(g).all() for g in normalize_advantages(advantages, zero))
    assert all(torch.isnan(w).all() for w in openrlhf_normalize(advantages, zero, stat_dtype=F64))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _normalize_worker(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        advantages, masks = _experiences(F64, seed=5)
        mine = slice(rank, None, world)  # each rank holds every world-th experience
        for no_std in (False, True):
            want = normalize_advantages(advantages, masks, no_std=no_std)[mine]
            got = normalize_advantages(advantages[mine], masks[mine], no_std=no_std, group=dist.group.WORLD)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()
    leave_rank_process()


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_normalize_over_ranks_matches_one_process():
    import torch.multiprocessing as mp

    mp.spawn(_normalize_worker, args=(2, _free_port()), nprocs=2, join=True)


# -- REINFORCE++ with baseline (estimator "reinforce_baseline") as a composition -----------------
# OpenRLHF 0.11.0 (the PyPI wheel), transcribed in float64: openrlhf/models/utils.py
# compute_reward (the shaped score at each row's last action token, minus kl_coef * kl), and in
# openrlhf/trainer/ppo_utils/experience_maker.py RemoteExperienceMaker.compute_advantages_and_returns
# the steps of estimator "reinforce_baseline": the scores put in prompt order by the experiences'
# index, each prompt's n samples minus their mean, split back; compute_reward per experience; the
# cumulative returns with gamma = 1; the normalisation across experiences.
def openrlhf_compute_reward(score, kl_coef, kl, action_mask, clip=None):
    kl_coef = max(kl_coef, 0.0)
    if clip:
        score = score.clamp(min=clip[0], max=clip[1])
    last = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    placed = torch.zeros_like(kl).scatter_(1, last, score.unsqueeze(1).to(kl.dtype))
    return placed + (-kl_coef * kl)


def openrlhf_reinforce_baseline(scores, indices, kls, masks, n, kl_coef, clip=None, stat_dtype=F64):
    lengths = [len(k) for k in kls]
    flat = torch.cat(scores)
    ordered = torch.empty_like(flat)
    ordered[indices] = flat
    grouped = ordered.reshape(-1, n)
    shaped = (grouped - grouped.mean(-1, keepdim=True)).reshape(-1)[indices].split(lengths)
    returns = [TRANSCRIPTION.get_cumulative_returns(openrlhf_compute_reward(s, kl_coef, k, m, clip), m, 1.0)
               for s, k, m in zip(shaped, kls, masks)]
    return openrlhf_normalize(returns, masks, stat_dtype=stat_dtype)


def reinforce_baseline_recipe(scores, indices, kls, masks, n, kl_coef, clip=None):
    """docs/openrlhf.md, "REINFORCE++ with baseline": group_advantages(mode="drgrpo") for the
    baseline, OpenRLHF's own compute_reward, get_cumulative_returns (discounted_return) with
    gamma = 1, normalize_advantages (masked_whiten) across the experiences."""
    import rl_triton

    flat, lengths = torch.cat(scores), [len(s) for s in scores]
    shaped = rl_triton.group_advantages(flat, indices // n, mode="drgrpo").split(lengths)
    returns = [get_cumulative_returns(openrlhf_compute_reward(s, kl_coef, k, m, clip), m, 1.0)
               for s, k, m in zip(shaped, kls, masks)]
    return normalize_advantages(returns, masks)


def _reinforce_baseline_step(dtype, n, seed):
    """A step of 3 prompts x n samples, shuffled over experiences of 5, 4 and the rest, with the
    action masks of ``experience`` (one row without an action token) and per-token KL."""
    g = torch.Generator().manual_seed(seed)
    total = 3 * n
    indices = torch.randperm(total, generator=g)
    sizes = [5, 4, total - 9]
    masks = [experience(B, dtype, seed=seed + B, turns=1 + B % 2)[2] for B in sizes]
    kls = [(torch.rand(m.shape, generator=g, dtype=F64) * 0.2).to(dtype) for m in masks]
    scores = list(torch.randn(total, generator=g, dtype=F64).to(dtype).split(sizes))
    scores[0][1] = scores[0][0]  # ties within and across prompts
    return scores, indices, kls, masks


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("n,kl_coef,clip", [(4, 0.05, None), (8, 0.0, (-0.5, 0.5)), (5, -1.0, None)])
def test_reinforce_baseline_recipe_matches_openrlhf(use_backend, n, kl_coef, clip):
    for dtype in (F64, F32):
        scores, indices, kls, masks = _reinforce_baseline_step(dtype, n, seed=n)
        want = openrlhf_reinforce_baseline(scores, indices, kls, masks, n, kl_coef, clip, stat_dtype=dtype)
        got = reinforce_baseline_recipe(scores, indices, kls, masks, n, kl_coef, clip)
        for g_, w in zip(got, want, strict=True):
            assert g_.dtype == dtype and g_.shape == w.shape
            _close(g_, w, dtype)
    # the baseline matters here: without it the advantages differ
    plain = openrlhf_reinforce_baseline(scores, indices, kls, masks, 1, kl_coef, clip, stat_dtype=F32)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(plain, want))


# -- the patch, on a stand-in openrlhf -----------------------------------------------------------
@pytest.fixture
def fake_openrlhf(monkeypatch):
    """``openrlhf.trainer.ppo_utils.experience_maker`` in sys.modules, with a RemoteExperienceMaker
    holding the transcribed methods; OpenRLHF itself is not imported."""
    cls = type("RemoteExperienceMaker", (), {"get_advantages_and_returns": ORIGINAL_GAE,
                                             "get_cumulative_returns": ORIGINAL_RETURNS})
    parts = MODULE.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        if i > 1:
            setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], module)
    sys.modules[MODULE].RemoteExperienceMaker = cls
    return cls


def _routed(cls) -> bool:
    d = cls.__dict__
    return (d["get_advantages_and_returns"] is not ORIGINAL_GAE and
            d["get_cumulative_returns"] is not ORIGINAL_RETURNS)


def _originals_back(cls) -> bool:
    d = cls.__dict__
    return d["get_advantages_and_returns"] is ORIGINAL_GAE and d["get_cumulative_returns"] is ORIGINAL_RETURNS


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
def test_patched_methods_give_openrlhfs_results(fake_openrlhf, use_backend, monkeypatch):
    maker = fake_openrlhf()
    values, rewards, mask = experience(6, F64, seed=2, turns=2)
    want_adv, want_ret = maker.get_advantages_and_returns(values, rewards, mask, 1.0, 0.95)
    want_returns = maker.get_cumulative_returns(rewards, mask, 0.99)
    calls = []
    for name in ("gae", "discounted_return"):
        inner = getattr(rt_openrlhf, name)
        monkeypatch.setattr(rt_openrlhf, name, lambda *a, _inner=inner, **k: calls.append(1) or _inner(*a, **k))
    rt_openrlhf.patch()
    assert _routed(fake_openrlhf)
    adv, ret = maker.get_advantages_and_returns(values, rewards, mask, 1.0, 0.95)
    returns = maker.get_cumulative_returns(rewards, mask, 0.99)
    assert len(calls) == 2  # both went through rl_triton
    _close(adv, want_adv, F64)
    _close(ret, want_ret, F64)
    _close(returns, want_returns, F64)
    rt_openrlhf.unpatch()
    assert _originals_back(fake_openrlhf) and not rt_openrlhf.is_patched()


def test_patch_roundtrip_and_idempotence(fake_openrlhf):
    assert not rt_openrlhf.is_patched()
    rt_openrlhf.patch()
    rt_openrlhf.patch()
    assert rt_openrlhf.is_patched() and _routed(fake_openrlhf)
    rt_openrlhf.unpatch()
    rt_openrlhf.unpatch()
    assert not rt_openrlhf.is_patched() and _originals_back(fake_openrlhf)
    with rt_openrlhf.patched():
        assert rt_openrlhf.is_patched() and _routed(fake_openrlhf)
    assert not rt_openrlhf.is_patched() and _originals_back(fake_openrlhf)


def test_nested_holders(fake_openrlhf):
    with rt_openrlhf.patched():
        with rt_openrlhf.patched():
            assert _routed(fake_openrlhf)
        assert _routed(fake_openrlhf)  # the outer block still holds it
        rt_openrlhf.patch()
        rt_openrlhf.unpatch()  # withdraws patch() only
        assert _routed(fake_openrlhf)
        rt_openrlhf.patch()  # outlives the block
    assert _routed(fake_openrlhf)
    rt_openrlhf.unpatch()
    assert _originals_back(fake_openrlhf)


def test_patch_is_thread_safe(fake_openrlhf):
    values, rewards, mask = experience(3, F64, seed=9)
    want_adv, _ = TRANSCRIPTION.get_advantages_and_returns(values, rewards, mask, 1.0, 0.95)
    errors, start = [], threading.Barrier(8)

    def worker(i):
        try:
            start.wait(5)
            for _ in range(25):
                if i % 2:
                    with rt_openrlhf.patched():
                        assert rt_openrlhf.is_patched() and _routed(fake_openrlhf)
                        adv, _ = fake_openrlhf().get_advantages_and_returns(values, rewards, mask, 1.0, 0.95)
                        _close(adv, want_adv, F64)
                else:
                    rt_openrlhf.patch()
                    rt_openrlhf.unpatch()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not rt_openrlhf.is_patched() and _originals_back(fake_openrlhf)


def test_patch_without_openrlhf(monkeypatch):
    monkeypatch.setitem(sys.modules, "openrlhf", None)  # import openrlhf raises ImportError
    with pytest.raises(ImportError, match="needs OpenRLHF"):
        rt_openrlhf.patch()
    with pytest.raises(ImportError, match="needs OpenRLHF"):
        with rt_openrlhf.patched():
            pass
    assert not rt_openrlhf.is_patched()
    adv, _ = get_advantages_and_returns(torch.ones(1, 3), torch.ones(1, 3), None, 1.0, 1.0)  # still works
    assert adv.shape == (1, 3)


def test_patch_without_flash_attn_says_so(monkeypatch, tmp_path):
    """OpenRLHF 0.11.2's experience maker imports flash_attn (openrlhf.models.ring_attn_utils),
    which a CPU-only torch cannot have: the ImportError names it and what still works."""
    package = tmp_path / "openrlhf" / "trainer" / "ppo_utils"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent, package):
        (folder / "__init__.py").write_text("")
    (package / "experience_maker.py").write_text("from flash_attn.bert_padding import pad_input\n")
    for name in [n for n in sys.modules if n == "openrlhf" or n.startswith("openrlhf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable, whatever is installed
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as raised:
        rt_openrlhf.patch()
    message = str(raised.value)
    assert "flash-attn" in message and "CUDA build" in message and "CPU-only torch" in message, message
    assert "get_advantages_and_returns, get_cumulative_returns and normalize_advantages work without it" in message
    assert not rt_openrlhf.is_patched()


def test_patch_refuses_other_layouts(fake_openrlhf):
    def other(self, values, rewards, mask, gamma, lam):  # renamed parameters: another OpenRLHF
        return None

    fake_openrlhf.get_advantages_and_returns = other
    with pytest.raises(ImportError, match="get_advantages_and_returns"):
        rt_openrlhf.patch()
    del fake_openrlhf.get_advantages_and_returns
    with pytest.raises(ImportError, match="no method get_advantages_and_returns"):
        rt_openrlhf.patch()
    del sys.modules[MODULE].RemoteExperienceMaker
    with pytest.raises(ImportError, match="RemoteExperienceMaker"):
        rt_openrlhf.patch()
    assert not rt_openrlhf.is_patched()


# -- the patch, on the real OpenRLHF --------------------------------------------------------------
def test_real_openrlhf():
    module = pytest.importorskip(MODULE)
    cls = module.RemoteExperienceMaker
    originals = {name: cls.__dict__[name] for name in ("get_advantages_and_returns", "get_cumulative_returns")}
    maker = object.__new__(cls)  # the methods read no state
    values, rewards, mask = experience(5, F32, seed=6, turns=2)
    want_adv, want_ret = maker.get_advantages_and_returns(values, rewards, mask, 1.0, 0.95)
    want_returns = maker.get_cumulative_returns(rewards, mask, 1.0)
    with rt_openrlhf.patched():
        assert all(cls.__dict__[name] is not fn for name, fn in originals.items())
        adv, ret = maker.get_advantages_and_returns(values, rewards, mask, 1.0, 0.95)
        returns = maker.get_cumulative_returns(rewards, mask, 1.0)
    assert all(cls.__dict__[name] is fn for name, fn in originals.items())
    _close(adv, want_adv, F32)
    _close(ret, want_ret, F32)
    _close(returns, want_returns, F32)
