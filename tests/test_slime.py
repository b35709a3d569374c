"""rl_triton.integrations.slime against slime's scans.

slime is not installable from the package index, so the reference is a transcription:
rl_triton.testing.frameworks.slime_vanilla_gae, slime_chunked_discounted_returns and
slime_chunked_gae, from THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515,
slime/utils/ppo_utils.py (vanilla_gae, chunked_discounted_returns, chunked_gae). The tests:

- each drop-in against the transcription and the float64 oracle (lengths below, at and past
  slime's chunk of 128, zero-padded rows as slime pads them), float64 to 1e-12 and float32;
- patch()/unpatch()/patched()/is_patched() on a stand-in ``slime.utils.ppo_utils`` whose batch
  function looks ``chunked_gae`` up as a module global at each call, as slime's
  ``get_advantages_and_returns_batch`` does.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import rl_triton.integrations.slime as rt_slime
from rl_triton.integrations._patching import FrameworkNotInstalled
from rl_triton.testing import frameworks, oracle

from helpers import concurrent_patch_use, nested_blocks_across_threads, spawn_gloo

F64, F32 = torch.float64, torch.float32
MODULE = "slime.utils.ppo_utils"


@pytest.fixture(params=["cpu", "torch"])
def use_backend(request, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", request.param)
    return request.param


def padded(dtype, lengths=(1, 127, 128, 300, 129), seed=0):
    """slime's padded batch: rows of response tokens, zeros past each response's length."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    r, v = (torch.randn(len(lengths), T, generator=g, dtype=F64) for _ in range(2))
    keep = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return (r * keep).to(dtype), (v * keep).to(dtype)


def close(got, expected, dtype):
    if dtype == F64:
        torch.testing.assert_close(got.to(F64), torch.as_tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)
    else:  # slime's chunked matmul rounds differently from a sequential scan
        torch.testing.assert_close(got.to(F64), torch.as_tensor(expected, dtype=F64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("gamma,lambd", [(1.0, 0.95), (0.99, 1.0), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_slime(use_backend, dtype, gamma, lambd):
    r, v = padded(dtype)
    adv, ret = rt_slime.chunked_gae(r, v, gamma, lambd)
    assert adv.dtype == ret.dtype == dtype
    for reference in (frameworks.slime_chunked_gae(r, v, gamma, lambd),
                      frameworks.slime_vanilla_gae(r, v, gamma, lambd)):
        close(adv, reference[0].to(F64), dtype)
        close(ret, reference[1].to(F64), dtype)
    for a, b in zip(rt_slime.vanilla_gae(r, v, gamma, lambd), (adv, ret)):
        assert torch.equal(a, b)
    B, T = r.shape
    zeros = np.zeros((B, T))
    a, targets = oracle.gae(r, v, oracle.implied_next_values(v), zeros, zeros, np.full((B, T), gamma),
                            np.full((B, T), lambd))
    close(adv, a, dtype)
    close(ret, targets, dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("discount", [1.0, 0.97, 0.0])
def test_discounted_returns_match_slime(use_backend, dtype, discount):
    r, _ = padded(dtype, seed=1)
    got = rt_slime.chunked_discounted_returns(r, discount)
    close(got, frameworks.slime_chunked_discounted_returns(r, discount).to(F64), dtype)
    B, T = r.shape
    zeros = np.zeros((B, T))
    close(got, oracle.discounted_return(r, zeros, zeros, np.full((B, T), discount)), dtype)


def test_bad_inputs_and_chunk_size_ignored():
    r, v = padded(F64)
    with pytest.raises(TypeError, match="rewards"):
        rt_slime.chunked_gae(r.numpy(), v, 1.0, 0.95)
    with pytest.raises(ValueError, match="rewards"):
        rt_slime.chunked_gae(r[0], v[0], 1.0, 0.95)
    with pytest.raises(ValueError, match="values"):
        rt_slime.vanilla_gae(r, v[:, 1:], 1.0, 0.95)
    with pytest.raises(ValueError, match="gamma"):
        rt_slime.chunked_discounted_returns(r, 1.5)
    for a, b in zip(rt_slime.chunked_gae(r, v, 1.0, 0.95, chunk_size=7), rt_slime.chunked_gae(r, v, 1.0, 0.95)):
        assert torch.equal(a, b)


# -- patch() on a stand-in slime ------------------------------------------------------------------

LOSS = "slime.backends.megatron_utils.loss"


def stand_in_modules(cp_size=1, cp_rank=0, cp_group=None, dp_cp_group=None) -> dict:
    """Stand-ins of slime's ppo_utils, distributed_utils and Megatron loss module and of
    Megatron-LM's ``mpu`` (a context-parallel world of ``cp_size`` ranks, this one ``cp_rank``):
    slime's functions as transcribed, its batch function looking ``chunked_gae`` up in its module
    at each call, the loss module binding the batch function and the whitening by name at its
    import, as slime's do. ``{module name: module}``."""
    ppo_utils = types.ModuleType(MODULE)
    ppo_utils.chunked_gae = frameworks.slime_chunked_gae
    ppo_utils.vanilla_gae = frameworks.slime_vanilla_gae
    ppo_utils.chunked_discounted_returns = frameworks.slime_chunked_discounted_returns

    def get_advantages_and_returns_batch(total_lengths, response_lengths, values_list, rewards_list, gamma, lambd,
                                         chunked=True):
        mpu = sys.modules["megatron.core"].mpu
        return frameworks.slime_get_advantages_and_returns_batch(
            total_lengths, response_lengths, values_list, rewards_list, gamma, lambd,
            mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size(), mpu.get_context_parallel_group(),
            chunked=chunked, scans=sys.modules[MODULE])

    def get_reinforce_plus_plus_returns(rewards, kl, loss_masks, response_lengths, total_lengths, kl_coef, gamma):
        mpu = sys.modules["megatron.core"].mpu
        return frameworks.slime_get_reinforce_plus_plus_returns(
            rewards, kl, loss_masks, response_lengths, total_lengths, kl_coef, gamma,
            mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size(), mpu.get_context_parallel_group(),
            scans=sys.modules[MODULE])

    ppo_utils.get_advantages_and_returns_batch = get_advantages_and_returns_batch
    ppo_utils.get_reinforce_plus_plus_returns = get_reinforce_plus_plus_returns
    distributed_utils = types.ModuleType("slime.utils.distributed_utils")
    distributed_utils.distributed_masked_whiten = frameworks.slime_distributed_masked_whiten
    loss = types.ModuleType(LOSS)
    loss.get_advantages_and_returns_batch = ppo_utils.get_advantages_and_returns_batch
    loss.get_reinforce_plus_plus_returns = ppo_utils.get_reinforce_plus_plus_returns
    loss.distributed_masked_whiten = distributed_utils.distributed_masked_whiten
    mpu = types.SimpleNamespace(get_context_parallel_world_size=lambda: cp_size,
                                get_context_parallel_rank=lambda: cp_rank,
                                get_context_parallel_group=lambda: cp_group,
                                get_data_parallel_group=lambda with_context_parallel=False: dp_cp_group)
    core = types.ModuleType("megatron.core")
    core.mpu = mpu
    modules = {MODULE: ppo_utils, distributed_utils.__name__: distributed_utils, LOSS: loss, "megatron.core": core}
    for name in ("slime", "slime.utils", "slime.backends", "slime.backends.megatron_utils", "megatron"):
        modules[name] = types.ModuleType(name)
        modules[name].__path__ = []
    return modules


def stand_in_advantages(total_lengths, response_lengths, values, rewards, loss_masks, gamma, lambd):
    """slime's compute_advantages_and_returns for PPO with normalize_advantages, through the names
    its loss module bound: the batch function, then the whitening of every rank's loss-masked
    tokens over the data-parallel group with context parallelism. ``(advantages, returns)``."""
    loss, mpu = sys.modules[LOSS], sys.modules["megatron.core"].mpu
    advantages, returns = loss.get_advantages_and_returns_batch(total_lengths, response_lengths, values, rewards,
                                                                gamma, lambd)
    advantages = frameworks.slime_whiten_advantages(
        advantages, loss_masks, total_lengths, response_lengths, mpu.get_context_parallel_rank(),
        mpu.get_context_parallel_world_size(), mpu.get_data_parallel_group(with_context_parallel=True),
        whiten=loss.distributed_masked_whiten)
    return advantages, returns


def stand_in_batch(rewards, values, gamma, lambd):
    """slime's get_advantages_and_returns_batch without context parallelism, on a padded batch:
    it looks chunked_gae up in its module at each call."""
    return sys.modules[MODULE].chunked_gae(rewards=rewards, values=values, gamma=gamma, lambd=lambd)


@pytest.fixture
def stand_in(monkeypatch):
    modules = stand_in_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield modules[MODULE]
    rt_slime.unpatch()
    assert not rt_slime.is_patched()


def test_patch_routes_and_restores(stand_in):
    originals = {name: getattr(stand_in, name) for name in rt_slime.FUNCTIONS}
    r, v = padded(F64, seed=2)
    theirs = stand_in_batch(r, v, 1.0, 0.95)
    rt_slime.patch()
    rt_slime.patch()
    assert all(getattr(stand_in, n) is getattr(rt_slime, n) for n in rt_slime.FUNCTIONS)
    ours = stand_in_batch(r, v, 1.0, 0.95)
    rt_slime.unpatch()
    assert all(getattr(stand_in, n) is f for n, f in originals.items())
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(o, t, rtol=1e-12, atol=1e-12)


def test_patched_blocks_and_errors(stand_in):
    def routes_ours():
        return stand_in.chunked_gae is rt_slime.chunked_gae

    with rt_slime.patched():
        with rt_slime.patched():
            assert routes_ours()
        assert routes_ours()
        with pytest.raises(AssertionError):  # slime's own error (its assert) on slime's arguments
            rt_slime.chunked_gae(torch.zeros(3), torch.zeros(3), 1.0, 0.95)
    assert not routes_ours()
    assert nested_blocks_across_threads(rt_slime.patched, routes_ours) == [True]
    assert concurrent_patch_use(rt_slime.patched, rt_slime.patch, rt_slime.unpatch, routes_ours) == []
    rt_slime.unpatch()
    rt_slime.patch()

    def someone_elses(*args, **kwargs):
        return None

    stand_in.chunked_gae = someone_elses
    rt_slime.unpatch()
    assert stand_in.chunked_gae is someone_elses
    assert stand_in.vanilla_gae is frameworks.slime_vanilla_gae


def test_without_slime(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)
    with pytest.raises(FrameworkNotInstalled, match="THUDM/slime"):
        rt_slime.patch()
    assert not rt_slime.is_patched()


# -- context parallelism: slime's all-gather, whole-response scan and slice, on gloo ranks -----------

distributed = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")

# (total_length, response_length) of the sequences of each data-parallel rank: response lengths
# not multiples of 2W; with 4 CP ranks (9, 8) leaves rank 0's second piece past the sequence's end;
# (100, 7) and (90, 2) put the whole response in the last pieces (prompt-heavy), (23, 1) is a
# single token
SEQUENCES = ((40, 33), (9, 8), (100, 7), (64, 63), (23, 1), (37, 29), (90, 2))
GAMMA, LAMBD = 0.99, 0.95


def cp_sequences(dp_rank, dtype):
    """Data-parallel rank ``dp_rank``'s sequences, whole: rewards, values and 0/1 loss masks of
    each response (seeded by the rank, so every rank can make every rank's)."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    lengths = SEQUENCES[dp_rank:] + SEQUENCES[:dp_rank]
    rewards = [torch.randn(n, generator=g, dtype=F64).to(dtype) for _, n in lengths]
    values = [torch.randn(n, generator=g, dtype=F64).to(dtype) for _, n in lengths]
    masks = [(torch.rand(n, generator=g) < 0.8).int() for _, n in lengths]
    for m in masks:
        m[0] = 1
    return [t for t, _ in lengths], [n for _, n in lengths], rewards, values, masks


def oracle_gae(rewards, values):
    """The float64 oracle's GAE of one whole response (V = A = 0 past its end)."""
    r, v = (x.to(F64).numpy()[None] for x in (rewards, values))
    zeros, ones = np.zeros_like(r), np.ones_like(r)
    adv, ret = oracle.gae(r, v, oracle.implied_next_values(v), zeros, zeros, GAMMA * ones, LAMBD * ones)
    return torch.from_numpy(np.asarray(adv)[0]), torch.from_numpy(np.asarray(ret)[0])


KL_COEF = 0.05


def rpp_inputs(dp_rank, dtype):
    """REINFORCE++'s inputs of data-parallel rank ``dp_rank``'s sequences: ``(totals, lengths,
    scalar rewards, whole per-token KL, loss masks)`` (the masks often end before the response)."""
    totals, lengths, kl, _, masks = cp_sequences(dp_rank, dtype)
    g = torch.Generator().manual_seed(200 + dp_rank)
    return totals, lengths, torch.randn(len(lengths), generator=g, dtype=F64).to(dtype), kl, masks


def oracle_rpp_returns(reward, kl, mask):
    """The float64 oracle's REINFORCE++ returns of one whole response: token rewards
    -KL_COEF * kl * mask plus the reward at the last masked token, discounted by GAMMA."""
    m = mask.numpy() != 0
    r = -KL_COEF * kl.to(F64).numpy() * m
    r[np.nonzero(m)[0][-1]] += float(reward)
    r = r[None]
    zeros = np.zeros_like(r)
    return torch.from_numpy(np.asarray(oracle.discounted_return(r, zeros, zeros, GAMMA + zeros))[0])


def cp_close(got, expected, dtype):
    if dtype == F64:
        tol = 1e-12
    else:  # slime's chunked matmul (and its float32 statistics) round differently from rl_triton's scan
        tol = 1e-5
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.to(F64), e.to(F64), rtol=tol, atol=tol)


def _cp_worker(rank, world, group):
    """Every layout of ``world`` ranks as (CP, DP) sizes: W CP ranks alone, and with 4 ranks 2 CP x
    2 DP. Per dtype: the drop-in (through Megatron's stand-in ``mpu`` and directly) against the
    transcription of slime's CP path and the float64 oracle of the whole responses; the
    whitening over DP x CP against slime's and the oracle's over every rank's whole responses;
    then the patch, through the stand-in loss module."""
    import torch.distributed as dist

    layouts = [(world, 1)] + ([(2, 2)] if world == 4 else [])
    for cp_size, dp_size in layouts:
        cp_rank, dp_rank = rank % cp_size, rank // cp_size
        cp_groups = [dist.new_group(list(range(d * cp_size, (d + 1) * cp_size))) for d in range(dp_size)]
        cp_group = cp_groups[dp_rank]
        sys.modules.update(stand_in_modules(cp_size, cp_rank, cp_group, group))

        def mine(x, t, n):
            return frameworks.slime_slice_log_prob_with_cp(x, t, n, cp_rank, cp_size)

        for dtype in (F64, F32):
            totals, lengths, rewards, values, masks = cp_sequences(dp_rank, dtype)
            local_r, local_v = ([mine(x, t, n) for x, t, n in zip(xs, totals, lengths)] for xs in (rewards, values))
            theirs = frameworks.slime_get_advantages_and_returns_batch(totals, lengths, local_v, local_r, GAMMA, LAMBD,
                                                                       cp_rank, cp_size, cp_group)
            ours = rt_slime.get_advantages_and_returns_batch(totals, lengths, local_v, local_r, GAMMA, LAMBD)
            direct = rt_slime.context_parallel_gae(totals, lengths, local_v, local_r, GAMMA, LAMBD, group=cp_group)
            assert len(ours[0]) == len(ours[1]) == len(totals)
            for o, d, t in zip(ours, direct, theirs):
                assert all(torch.equal(a, b) for a, b in zip(o, d))
                assert all(a.dtype == dtype and a.shape == b.shape for a, b in zip(o, t))
                cp_close(o, t, dtype)
            whole = [oracle_gae(r, v) for r, v in zip(rewards, values)]
            for k in (0, 1):
                cp_close(ours[k], [mine(w[k], t, n) for w, t, n in zip(whole, totals, lengths)], dtype)

            local_m = [frameworks.slime_cp_loss_mask(m, t, n, cp_rank, cp_size) for m, t, n in zip(masks, totals,
                                                                                                   lengths)]
            assert all(torch.equal(m, mine(w, t, n)) for m, w, t, n in zip(local_m, masks, totals, lengths))
            whitened = rt_slime.distributed_masked_whiten(torch.cat(ours[0]), torch.cat(local_m), process_group=group)
            slimes = frameworks.slime_whiten_advantages(theirs[0], masks, totals, lengths, cp_rank, cp_size, group)
            cp_close([whitened], [torch.cat(slimes)], F32)  # slime's statistics are float32 sums
            # the oracle: every data-parallel rank's whole responses, whitened together
            every = [cp_sequences(d, dtype) for d in range(dp_size)]
            flat = np.concatenate([oracle_gae(r, v)[0].numpy() for e in every for r, v in zip(e[2], e[3])])
            keep = np.concatenate([m.numpy() for e in every for m in e[4]]) != 0
            want = torch.from_numpy(oracle.masked_whiten(flat, keep, eps=1e-8))
            start = sum(n for e in every[:dp_rank] for n in e[1])
            want = [want[start + sum(lengths[:i]):start + sum(lengths[:i + 1])] for i in range(len(lengths))]
            cp_close([whitened], [torch.cat([mine(w, t, n) for w, t, n in zip(want, totals, lengths)])], dtype)

            # REINFORCE++'s returns: slime's all-gather path, the drop-in (mpu and direct), the oracle
            totals, lengths, seq_r, kl, masks = rpp_inputs(dp_rank, dtype)
            local_kl = [mine(x, t, n) for x, t, n in zip(kl, totals, lengths)]
            rpp_args = (seq_r, local_kl, masks, lengths, totals, KL_COEF, GAMMA)
            theirs = frameworks.slime_get_reinforce_plus_plus_returns(*rpp_args, cp_rank, cp_size, cp_group)
            ours = rt_slime.get_reinforce_plus_plus_returns(*rpp_args)
            direct = rt_slime.context_parallel_reinforce_plus_plus_returns(*rpp_args, group=cp_group)
            assert len(ours) == len(totals) and all(torch.equal(a, b) for a, b in zip(ours, direct))
            assert all(a.dtype == dtype and a.shape == b.shape for a, b in zip(ours, theirs))
            cp_close(ours, theirs, dtype)
            cp_close(ours, [mine(oracle_rpp_returns(*x), t, n) for x, t, n in zip(zip(seq_r, kl, masks), totals,
                                                                                    lengths)], dtype)
            with rt_slime.patched():
                patched = sys.modules[LOSS].get_reinforce_plus_plus_returns(
                    rewards=seq_r, kl=local_kl, loss_masks=masks, response_lengths=lengths, total_lengths=totals,
                    kl_coef=KL_COEF, gamma=GAMMA)
            assert all(torch.equal(a, b) for a, b in zip(patched, ours))
            # gamma 1 (slime's default) takes a number for the discount, the padding included
            one = rpp_args[:-1] + (1.0,)
            cp_close(rt_slime.context_parallel_reinforce_plus_plus_returns(*one, group=cp_group),
                     frameworks.slime_get_reinforce_plus_plus_returns(*one, cp_rank, cp_size, cp_group), dtype)

        # the patch: slime's compute path reaches the drop-ins through its loss module's names
        totals, lengths, rewards, values, masks = cp_sequences(dp_rank, F64)
        local_r, local_v = ([mine(x, t, n) for x, t, n in zip(xs, totals, lengths)] for xs in (rewards, values))
        args = (totals, lengths, local_v, local_r, masks, GAMMA, LAMBD)
        slimes = stand_in_advantages(*args)
        with rt_slime.patched():
            patched = stand_in_advantages(*args)
            with rt_slime.patched(whitening=True):
                whitened = stand_in_advantages(*args)
        assert sys.modules[LOSS].get_advantages_and_returns_batch is sys.modules[MODULE].get_advantages_and_returns_batch
        ours = rt_slime.context_parallel_gae(totals, lengths, local_v, local_r, GAMMA, LAMBD, group=cp_group)
        for a, b in zip(patched[1] + whitened[1], ours[1] + ours[1]):
            assert torch.equal(a, b)
        # without whitening=True slime's whitening runs (on rl_triton's advantages)
        mask_args = (masks, totals, lengths, cp_rank, cp_size, group)
        for a, b in zip(patched[0], frameworks.slime_whiten_advantages(ours[0], *mask_args)):
            assert torch.equal(a, b)
        for a, b in zip(whitened[0], frameworks.slime_whiten_advantages(ours[0], *mask_args,
                                                                          whiten=rt_slime.distributed_masked_whiten)):
            assert torch.equal(a, b)
        cp_close(patched[0], slimes[0], F32)
        # no valid token on any rank: slime's ValueError, from both
        empty = torch.cat(ours[0]).new_zeros(sum(a.numel() for a in ours[0]))
        for whiten in (frameworks.slime_distributed_masked_whiten, rt_slime.distributed_masked_whiten):
            with pytest.raises(ValueError, match="mask"):
                whiten(torch.cat(ours[0]), empty, process_group=group)


@distributed
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_slimes_all_gather_and_the_oracle(world):
    spawn_gloo(_cp_worker, world)


def test_context_parallel_layout_is_slimes():
    """The pieces the drop-in cuts each response into are those slime's offsets give each rank."""
    for world in (2, 3, 4):
        for total, n in SEQUENCES + ((8, 7), (16, 3), (200, 199)):
            bounds = rt_slime._response_pieces(total, n, world)
            whole = torch.arange(n)
            for rank in range(world):
                want = frameworks.slime_slice_log_prob_with_cp(whole, total, n, rank, world)
                got = torch.cat([whole[bounds[m]:bounds[m + 1]] for m in (rank, 2 * world - 1 - rank)])
                assert torch.equal(got, want), (total, n, world, rank)


def test_without_context_parallelism_is_todays_drop_in(stand_in):
    """With one CP rank the patched batch function is slime's own around the chunked_gae drop-in,
    byte for byte, and the unpatched drop-in's own path gives the same bytes."""
    totals, lengths, rewards, values, _ = cp_sequences(0, F32)
    args = (totals, lengths, values, rewards, GAMMA, LAMBD)
    direct = rt_slime.get_advantages_and_returns_batch(*args)
    with rt_slime.patched():
        patched = sys.modules[LOSS].get_advantages_and_returns_batch(*args)
        todays = frameworks.slime_get_advantages_and_returns_batch(*args, scans=stand_in)
    for a, b, c in zip(direct[0] + direct[1], patched[0] + patched[1], todays[0] + todays[1]):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_reinforce_plus_plus_without_context_parallelism_is_todays_drop_in(stand_in):
    """With one CP rank the patched REINFORCE++ returns are slime's own function around the
    chunked_discounted_returns drop-in, byte for byte, and so are the unpatched drop-in's and the
    direct call's; all match the float64 oracle."""
    for dtype in (F32, F64):
        totals, lengths, seq_r, kl, masks = rpp_inputs(1, dtype)
        args = (seq_r, kl, masks, lengths, totals, KL_COEF, GAMMA)
        direct = rt_slime.get_reinforce_plus_plus_returns(*args)
        plain = rt_slime.context_parallel_reinforce_plus_plus_returns(*args)
        with rt_slime.patched():
            patched = sys.modules[LOSS].get_reinforce_plus_plus_returns(*args)
            todays = frameworks.slime_get_reinforce_plus_plus_returns(*args, scans=stand_in)
        assert len(direct) == len(lengths)
        for a, b, c, d in zip(direct, plain, patched, todays):
            assert torch.equal(a, b) and torch.equal(b, c) and torch.equal(c, d)
        cp_close(direct, [oracle_rpp_returns(*x) for x in zip(seq_r, kl, masks)], dtype)
        cp_close(direct, frameworks.slime_get_reinforce_plus_plus_returns(*args), dtype)
    assert rt_slime.get_reinforce_plus_plus_returns(seq_r[:0], [], [], [], [], KL_COEF, GAMMA) == []


def test_reinforce_plus_plus_bad_inputs(stand_in):
    totals, lengths, seq_r, kl, masks = rpp_inputs(0, F64)
    call = rt_slime.context_parallel_reinforce_plus_plus_returns
    good = dict(rewards=seq_r, kl=kl, loss_masks=masks, response_lengths=lengths, total_lengths=totals,
                kl_coef=KL_COEF, gamma=GAMMA)
    for change, error, name in (
            (dict(rewards=seq_r.tolist()), TypeError, "rewards"),
            (dict(rewards=seq_r[1:]), ValueError, "rewards"),
            (dict(kl=kl[1:]), ValueError, "kl"),
            (dict(kl=[kl[0][1:]] + kl[1:]), ValueError, r"kl\[0\]"),
            (dict(loss_masks=tuple(masks[:2]) + (masks[2][:-1],) + tuple(masks[3:])), ValueError,
             r"loss_masks\[2\]"),
            (dict(loss_masks=[torch.zeros_like(masks[0])] + masks[1:]), ValueError, r"loss_masks\[0\]"),
            (dict(total_lengths=lengths), ValueError, "response_lengths"),
            (dict(response_lengths=torch.tensor(lengths)), TypeError, "response_lengths"),
            (dict(kl_coef="0.1"), TypeError, "kl_coef"),
            (dict(gamma=1.5), ValueError, "gamma"),
            (dict(gamma=None), TypeError, "gamma")):
        with pytest.raises(error, match=name):
            call(**{**good, **change})
    with pytest.raises(TypeError, match="group"):
        call(**good, group="world")
    # slime's own error (its assert on a fully masked response) while its ppo_utils is imported
    with pytest.raises(AssertionError, match="fully masked"):
        rt_slime.get_reinforce_plus_plus_returns(**{**good, "loss_masks": [torch.zeros_like(masks[0])] + masks[1:]})


def test_patch_reaches_the_names_the_loss_module_bound(stand_in, monkeypatch):
    """slime's loss module binds the batch function and the whitening by name at its import: a
    patch sets them there too, and a loss module imported while patched (binding the patched
    names) gets slime's back at unpatch()."""
    loss, utils = sys.modules[LOSS], sys.modules["slime.utils.distributed_utils"]
    theirs = (loss.get_advantages_and_returns_batch, loss.distributed_masked_whiten)
    rt_slime.patch()
    assert loss.get_advantages_and_returns_batch is rt_slime.get_advantages_and_returns_batch
    assert loss.distributed_masked_whiten is utils.distributed_masked_whiten is not theirs[1]
    later = types.ModuleType(LOSS)
    later.get_advantages_and_returns_batch = stand_in.get_advantages_and_returns_batch
    later.distributed_masked_whiten = utils.distributed_masked_whiten
    monkeypatch.setitem(sys.modules, LOSS, later)
    rt_slime.unpatch()
    assert (later.get_advantages_and_returns_batch, later.distributed_masked_whiten) == theirs
    assert (stand_in.get_advantages_and_returns_batch, utils.distributed_masked_whiten) == theirs


def test_context_parallel_bad_inputs(stand_in):
    totals, lengths, rewards, values, _ = cp_sequences(0, F64)
    call = rt_slime.context_parallel_gae
    with pytest.raises(TypeError, match="total_lengths"):
        call(torch.tensor(totals), lengths, values, rewards, GAMMA, LAMBD)
    with pytest.raises(ValueError, match="total_lengths"):
        call(totals[1:], lengths, values, rewards, GAMMA, LAMBD)
    with pytest.raises(ValueError, match="response_lengths"):
        call([n for n in lengths], lengths, values, rewards, GAMMA, LAMBD)
    with pytest.raises(ValueError, match="rewards_list"):
        call(totals, lengths, values, rewards[1:], GAMMA, LAMBD)
    with pytest.raises(ValueError, match=r"values_list\[1\]"):
        call(totals, lengths, [values[0], values[1][1:]] + values[2:], rewards, GAMMA, LAMBD)
    with pytest.raises(TypeError, match="group"):
        call(totals, lengths, values, rewards, GAMMA, LAMBD, group="world")
    with pytest.raises(ValueError, match="gamma"):
        call(totals, lengths, values, rewards, 1.5, LAMBD)
    with pytest.raises(TypeError, match="whitening"):
        rt_slime.patch(whitening=1)
    assert not rt_slime.is_patched()
    with pytest.raises(AssertionError):  # slime's own error (its assert) while its ppo_utils is imported
        rt_slime.get_advantages_and_returns_batch(totals, lengths, values[1:], rewards, GAMMA, LAMBD)
