"""The LLM frameworks' (and CleanRL's and PufferLib's) own advantage loops, transcribed (their
structure and arithmetic kept, each naming its source file and version), for the tests and the token-level benchmark to
compare against. Plain torch; this module never imports ``rl_triton``."""

from __future__ import annotations

from collections import defaultdict

import torch


def cleanrl_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's cleanrl/ppo.py (the same loop in ppo_atari.py and ppo_continuous_action.py), the
    reversed loop written out in its PPO scripts, with ``args.num_steps`` the rollout's length:
    ``(advantages, returns)`` of time-major ``(num_steps, num_envs)`` tensors, ``dones[t]`` = 1
    where obs t starts an episode, ``next_value``/``next_done`` those after the rollout."""
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl 0.5, verl/trainer/ppo/core_algos.py, compute_gae_advantage_return: the loop, returning
    (advantages before whitening, returns)."""
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = token_level_rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def verl_masked_whiten(values, mask, shift_mean=True):
    """verl 0.5, verl/utils/torch_functional.py: masked_mean, masked_var (unbiased) and
    masked_whiten, without masked_var's checks of the mask sum."""
    mean = (values * mask).sum() / mask.sum()
    centered = values - mean
    variance = (centered**2 * mask).sum() / mask.sum()
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """verl's whole GAE step: the loop, then the advantages whitened over the response mask."""
    advantages, returns = verl_gae(token_level_rewards, values, response_mask, gamma, lam)
    return verl_masked_whiten(advantages, response_mask), returns


def openrlhf_gae(values, rewards, action_mask, gamma, lambd):
    """OpenRLHF 0.11.2, openrlhf/trainer/ppo_utils/experience_maker.py,
    RemoteExperienceMaker.get_advantages_and_returns."""
    lastgaelam = 0
    advantages_reversed = []
    response_length = rewards.size(1)
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages.detach(), advantages + values


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl 0.5, verl/trainer/ppo/core_algos.py, compute_grpo_outcome_advantage (returns the
    advantages)."""
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean, id2std = {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        return scores.unsqueeze(-1) * response_mask


def pufferlib_advantage(values, rewards, dones, importance, advantages, gamma, lam, rho_clip, c_clip):
    """pufferlib 3.0.0, pufferlib/extensions/pufferlib.cpp, puff_advantage_row (the CPU twin of
    its CUDA kernel): the loop over t = horizon-2 .. 0, here vectorised over rows, in the
    tensors' dtype with the scalars rounded to it (the op's parameters are C floats). fminf keeps
    the number where the other operand is NaN (torch.fmin). ``advantages[:, -1]`` is not
    written. Returns ``advantages``, written in place."""
    dt = values.dtype
    gamma, lam, rho_clip, c_clip = (torch.tensor(x, dtype=dt) for x in (gamma, lam, rho_clip, c_clip))
    lastpufferlam = torch.zeros(values.shape[0], dtype=dt, device=values.device)
    for t in range(values.shape[1] - 2, -1, -1):
        t_next = t + 1
        nextnonterminal = 1.0 - dones[:, t_next]
        rho_t = torch.fmin(importance[:, t], rho_clip)
        c_t = torch.fmin(importance[:, t], c_clip)
        delta = rho_t * (rewards[:, t_next] + gamma * values[:, t_next] * nextnonterminal - values[:, t])
        lastpufferlam = delta + gamma * lam * c_t * lastpufferlam * nextnonterminal
        advantages[:, t] = lastpufferlam
    return advantages


SKYRL_PPO_UTILS = "skyrl.backends.skyrl_train.utils.ppo_utils"


def skyrl_ppo_utils():
    """SkyRL's real ``ppo_utils`` module (SkyRL installed: the ``skyrl`` extra), imported.

    On Python < 3.12 SkyRL 0.3.0's ``skyrl.backends`` package does not import: its
    ``skyrl.tinker.types`` builds pydantic models of ``typing.TypedDict``, which pydantic takes
    from Python 3.12 on. ppo_utils imports nothing of that package's ``__init__``, so there the
    package is entered without running it (an empty package module over the same directory)."""
    import importlib
    import os
    import sys
    import types

    try:
        return importlib.import_module(SKYRL_PPO_UTILS)
    except Exception as e:
        if sys.version_info >= (3, 12) or "TypedDict" not in str(e):
            raise
    import skyrl

    for name in [n for n in sys.modules if n == "skyrl.backends" or n.startswith("skyrl.backends.")]:
        del sys.modules[name]
    backends = types.ModuleType("skyrl.backends")
    backends.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
    sys.modules["skyrl.backends"] = backends
    return importlib.import_module(SKYRL_PPO_UTILS)


def nemo_rl_compute_gae(token_level_rewards, values, mask, gamma, lam):
    """NeMo-RL's GAE loop with carry-forward masking, ``GeneralizedAdvantageEstimator._compute_gae``
    (NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909,
    nemo_rl/algorithms/advantage_estimator.py), with the estimator's ``gae_gamma`` and lambda
    (a number or a ``[batch_size]`` tensor) as arguments. Returns ``(advantages, returns)``."""
    gen_len = token_level_rewards.shape[-1]
    next_values = torch.zeros(values.shape[0], device=values.device, dtype=values.dtype)
    last_gae_lam = torch.zeros_like(next_values)
    advantages_reversed = []
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        new_gae_lam = delta + gamma * lam * last_gae_lam
        m = mask[:, t]
        next_values = values[:, t] * m + (1 - m) * next_values
        last_gae_lam = new_gae_lam * m + (1 - m) * last_gae_lam
        advantages_reversed.append(last_gae_lam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages, returns


# slime (THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515, slime/utils/ppo_utils.py):
# vanilla_gae, chunked_discounted_returns, chunked_gae


def slime_vanilla_gae(rewards, values, gamma, lambd):
    """slime's vanilla_gae: OpenRLHF's loop (which slime adapts) without the action mask."""
    return openrlhf_gae(values, rewards, None, gamma, lambd)


def slime_chunked_discounted_returns(rewards, discount, chunk_size=128):
    assert rewards.ndim == 2
    B, T = rewards.shape
    device, dtype = rewards.device, rewards.dtype
    rewards_rev = torch.flip(rewards, dims=[1])
    pad = (chunk_size - T % chunk_size) if T % chunk_size != 0 else 0
    if pad:
        rewards_rev = torch.nn.functional.pad(rewards_rev, (0, pad))
    B, T_pad = rewards_rev.shape
    n_chunks = T_pad // chunk_size
    rewards_chunks = rewards_rev.view(B, n_chunks, chunk_size)
    idx = torch.arange(chunk_size, device=device)
    diff = idx[None, :] - idx[:, None]
    M = torch.zeros(chunk_size, chunk_size, device=device, dtype=dtype)
    upper = diff >= 0
    if discount == 0.0:
        M[upper & (diff == 0)] = 1.0
        pow_vec = torch.zeros(chunk_size, device=device, dtype=dtype)
    else:
        M[upper] = discount ** diff[upper].to(dtype)
        pow_vec = discount ** torch.arange(1, chunk_size + 1, device=device, dtype=dtype)
    S_local_chunks = (rewards_chunks.reshape(B * n_chunks, chunk_size) @ M).view(B, n_chunks, chunk_size)
    lengths = [chunk_size] * n_chunks
    if pad > 0:
        lengths[-1] = chunk_size - pad
    S_rev = rewards_rev.new_zeros(B, T_pad)
    s_prev = torch.zeros(B, device=device, dtype=dtype)
    for c in range(n_chunks):
        Lc = lengths[c]
        start = c * chunk_size
        S_global = S_local_chunks[:, c, :Lc] + s_prev.unsqueeze(1) * pow_vec[:Lc]
        S_rev[:, start:start + Lc] = S_global
        s_prev = S_global[:, -1]
    if pad > 0:
        S_rev = S_rev[:, :T]
    return torch.flip(S_rev, dims=[1])


def slime_chunked_gae(rewards, values, gamma, lambd, chunk_size=128):
    assert rewards.ndim == 2 and values.ndim == 2
    B, T = rewards.shape
    assert values.shape == (B, T)
    next_values = torch.cat([values[:, 1:], torch.zeros(B, 1, device=values.device, dtype=values.dtype)], dim=1)
    deltas = rewards + gamma * next_values - values
    advantages = slime_chunked_discounted_returns(deltas, gamma * lambd, chunk_size)
    return advantages, advantages + values


# slime's context-parallel path (THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515):
# slime/backends/megatron_utils/cp_utils.py (get_logits_and_tokens_offset_with_cp,
# all_gather_with_cp, slice_log_prob_with_cp), slime/utils/ppo_utils.py
# (get_advantages_and_returns_batch, get_reinforce_plus_plus_returns), slime/utils/distributed_utils.py
# (distributed_masked_whiten) and the whitening block of compute_advantages_and_returns in
# slime/backends/megatron_utils/loss.py. Megatron's ``mpu`` lookups are the arguments ``cp_rank``,
# ``cp_size`` and ``cp_group``.


def slime_cp_offsets(total_length, response_length, cp_rank, cp_size):
    """slime's get_logits_and_tokens_offset_with_cp: ``(chunk_size, chunks, logits, tokens)``, the
    offsets (from the prompt's start) of this rank's two pieces of the sequence, of the logits
    (one position earlier than the tokens) inside them, and of their tokens; an empty range is
    ``(0, 0)``."""
    assert cp_size > 1
    prompt_length = total_length - response_length
    chunk_size = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    chunks = ((cp_rank * chunk_size, (cp_rank + 1) * chunk_size),
              ((2 * cp_size - cp_rank - 1) * chunk_size, (2 * cp_size - cp_rank) * chunk_size))
    logits, tokens = [], []
    for lo, hi in chunks:
        span = (max(lo, prompt_length - 1), min(hi, total_length - 1))
        if span[0] < span[1]:
            logits.append(span)
            tokens.append((span[0] + 1, span[1] + 1))
        else:
            logits.append((0, 0))
            tokens.append((0, 0))
    return chunk_size, chunks, tuple(logits), tuple(tokens)


def slime_all_gather_with_cp(tensor, total_length, response_length, cp_rank, cp_size, cp_group):
    """slime's all_gather_with_cp: this rank's two pieces of a response-token tensor placed at
    their positions in a zero tensor of the response's length, summed over the CP ranks (an
    all-reduce of the whole response; slime's ``dist.nn.all_reduce``, here without autograd)."""
    if cp_size == 1:
        return tensor
    _, _, logits, _ = slime_cp_offsets(total_length, response_length, cp_rank, cp_size)
    prompt_length = total_length - response_length
    first = logits[0][1] - logits[0][0]
    chunk_0, chunk_1 = tensor[:first], tensor[first:]
    assert chunk_1.shape[0] == logits[1][1] - logits[1][0]

    def zero(n):
        return torch.zeros([n] + list(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)

    if chunk_0.shape[0] == 0 and chunk_1.shape[0] == 0:
        full = zero(response_length)
    elif chunk_1.shape[0] == 0:
        full = torch.cat([zero(logits[0][0] - (prompt_length - 1)), chunk_0, zero(total_length - 1 - logits[0][1])])
    elif chunk_0.shape[0] == 0:
        full = torch.cat([zero(logits[1][0] - (prompt_length - 1)), chunk_1, zero(total_length - 1 - logits[1][1])])
    else:
        full = torch.cat([zero(logits[0][0] - (prompt_length - 1)), chunk_0, zero(logits[1][0] - logits[0][1]),
                          chunk_1, zero(total_length - 1 - logits[1][1])])
    assert full.shape[0] == response_length
    torch.distributed.all_reduce(full, group=cp_group)
    return full


def slime_slice_log_prob_with_cp(log_prob, total_length, response_length, cp_rank, cp_size):
    """slime's slice_log_prob_with_cp: this rank's two pieces of a whole response-token tensor."""
    assert len(log_prob) == response_length
    if cp_size == 1:
        return log_prob
    prompt_length = total_length - response_length
    _, _, logits, _ = slime_cp_offsets(total_length, response_length, cp_rank, cp_size)
    parts = [log_prob[lo - (prompt_length - 1):hi - (prompt_length - 1)] for lo, hi in logits]
    return torch.cat(parts, dim=0)


def slime_get_advantages_and_returns_batch(total_lengths, response_lengths, values_list, rewards_list, gamma,
                                           lambd, cp_rank=0, cp_size=1, cp_group=None, chunked=True, scans=None):
    """slime's get_advantages_and_returns_batch: with ``cp_size > 1`` each response's values and
    rewards all-gathered from the ranks' pieces, GAE (``slime_chunked_gae``, or ``slime_vanilla_gae``
    with ``chunked=False``) on the zero-padded ``[B, max response length]`` batch on every rank,
    and this rank's pieces sliced back out; ``(advantages_list, returns_list)``. ``scans``: a
    module whose ``chunked_gae``/``vanilla_gae`` it calls instead, looked up at the call (slime
    reads them as globals of its ppo_utils)."""
    with torch.no_grad():
        B = len(response_lengths)
        assert B == len(values_list) and B == len(rewards_list)
        device, dtype = values_list[0].device, values_list[0].dtype
        if cp_size > 1:
            full_values = [slime_all_gather_with_cp(v, t, n, cp_rank, cp_size, cp_group)
                           for t, n, v in zip(total_lengths, response_lengths, values_list)]
            full_rewards = [slime_all_gather_with_cp(r, t, n, cp_rank, cp_size, cp_group)
                            for t, n, r in zip(total_lengths, response_lengths, rewards_list)]
        else:
            full_values, full_rewards = values_list, rewards_list
        max_len = max(response_lengths)
        values = torch.zeros(B, max_len, device=device, dtype=dtype)
        rewards = torch.zeros(B, max_len, device=device, dtype=dtype)
        for i, n in enumerate(response_lengths):
            values[i, :n] = full_values[i][:n]
            rewards[i, :n] = full_rewards[i][:n]
        if scans is None:
            scan = slime_chunked_gae if chunked else slime_vanilla_gae
        else:
            scan = scans.chunked_gae if chunked else scans.vanilla_gae
        advantages, returns = scan(rewards=rewards, values=values, gamma=gamma, lambd=lambd)
        if cp_size > 1:
            return ([slime_slice_log_prob_with_cp(a[:n], t, n, cp_rank, cp_size)
                     for t, n, a in zip(total_lengths, response_lengths, advantages)],
                    [slime_slice_log_prob_with_cp(g[:n], t, n, cp_rank, cp_size)
                     for t, n, g in zip(total_lengths, response_lengths, returns)])
        return ([advantages[i, :n] for i, n in enumerate(response_lengths)],
                [returns[i, :n] for i, n in enumerate(response_lengths)])


def slime_get_reinforce_plus_plus_returns(rewards, kl, loss_masks, response_lengths, total_lengths, kl_coef, gamma,
                                           cp_rank=0, cp_size=1, cp_group=None, scans=None):
    """slime's get_reinforce_plus_plus_returns (slime/utils/ppo_utils.py at the commit above): with
    ``cp_size > 1`` each response's KL all-gathered from the ranks' pieces; the token rewards
    ``-kl_coef * kl * loss_mask`` of the whole response with the sequence's reward added at its
    last loss-masked token; ``slime_chunked_discounted_returns`` (``scans.chunked_discounted_returns``,
    looked up at the call, where given) on the zero-padded batch on every rank; this rank's pieces
    sliced back out. A list of returns per response."""
    token_level_rewards = []
    for i in range(len(rewards)):
        total_len, response_len = total_lengths[i], response_lengths[i]
        if cp_size > 1:
            full_kl_response = slime_all_gather_with_cp(kl[i], total_len, response_len, cp_rank, cp_size, cp_group)
        else:
            full_kl_response = kl[i]
        full_mask = loss_masks[i]
        assert full_mask.sum().item() > 0, f"Sequence at index {i} is fully masked."
        masked_kl = full_kl_response * full_mask
        rewards_for_seq = -kl_coef * masked_kl
        last_idx = full_mask.nonzero(as_tuple=True)[0][-1]
        rewards_for_seq[last_idx] += rewards[i]
        token_level_rewards.append(rewards_for_seq)
    if not token_level_rewards:
        return []
    max_len = max(r.size(0) for r in token_level_rewards)
    padded_rewards = token_level_rewards[0].new_zeros(len(token_level_rewards), max_len)
    for i, r in enumerate(token_level_rewards):
        padded_rewards[i, :r.size(0)] = r
    scan = slime_chunked_discounted_returns if scans is None else scans.chunked_discounted_returns
    padded_returns = scan(padded_rewards, gamma)
    out = []
    for i, returns_for_seq in enumerate(padded_returns):
        returns_for_seq = returns_for_seq[:token_level_rewards[i].size(0)]
        if cp_size > 1:
            returns_for_seq = slime_slice_log_prob_with_cp(returns_for_seq, total_lengths[i], response_lengths[i],
                                                           cp_rank, cp_size)
        out.append(returns_for_seq)
    return out


def slime_cp_loss_mask(loss_mask, total_length, response_length, cp_rank, cp_size):
    """The whitening block of slime's compute_advantages_and_returns: this rank's pieces of a
    response's loss mask (its token offsets moved into the response), the whole mask without
    context parallelism."""
    if cp_size == 1:
        return loss_mask
    prompt_length = total_length - response_length
    _, _, _, tokens = slime_cp_offsets(total_length, response_length, cp_rank, cp_size)
    parts = []
    for lo, hi in tokens:
        lo, hi = max(0, lo - prompt_length), max(0, hi - prompt_length)
        if hi > lo:
            parts.append(loss_mask[lo:hi])
    return torch.cat(parts) if parts else torch.tensor([], device=loss_mask.device, dtype=loss_mask.dtype)


def slime_whiten_advantages(advantages, loss_masks, total_lengths, response_lengths, cp_rank, cp_size, dp_cp_group,
                            whiten=None):
    """The whitening block of slime's compute_advantages_and_returns (``args.normalize_advantages``):
    the rank's advantages of every response concatenated, whitened with the statistics of the
    loss-masked tokens of every rank of ``dp_cp_group`` (``whiten``, default
    ``slime_distributed_masked_whiten``; slime calls the name its loss module bound), split
    back per response."""
    whiten = slime_distributed_masked_whiten if whiten is None else whiten
    flat = torch.cat(advantages)
    masks = torch.cat([slime_cp_loss_mask(m, t, n, cp_rank, cp_size)
                       for m, t, n in zip(loss_masks, total_lengths, response_lengths)])
    assert flat.size() == masks.size()
    whitened = whiten(flat, masks, process_group=dp_cp_group, shift_mean=True)
    return list(torch.split(whitened, [a.size(0) for a in advantages]))


def slime_distributed_masked_whiten(values, mask, process_group=None, shift_mean=True, epsilon=1e-8):
    """slime's distributed_masked_whiten: the masked sum, sum of squares and count of this rank
    all-reduced (in float32) over ``process_group``; the variance as mean of squares minus squared
    mean, times n / (n - 1) where n >= 2; ``(values - mean) * rsqrt(var + epsilon)``."""
    stats = torch.tensor([(values * mask).sum(), ((values ** 2) * mask).sum(), mask.sum()], device=values.device,
                         dtype=torch.float32)
    torch.distributed.all_reduce(stats, group=process_group)
    total, total_sq, count = stats
    if count.item() == 0:
        raise ValueError("The global mask sum across all participating GPUs is zero.")
    mean = total / count
    var = total_sq / count - mean ** 2
    if count.item() >= 2:
        var = var * (count / (count - 1))
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened += mean
    return whitened


def areal_gae(rewards, values, loss_mask, seq_no_eos_mask, discount, gae_lambda):
    """AReaL's GAE loop, inline in ``PPOActor._compute_advantages`` (areal 1.0.4, the PyPI wheel,
    areal/trainer/ppo/actor.py, from "Compute GAE." to ``returns = advantages + values``), with the
    actor's ``discount`` and ``gae_lambda`` as arguments. ``loss_mask`` is the rolled float mask
    the method builds; returns ``(advantages, returns)``."""
    bs, max_seqlen = rewards.shape
    advantages_reversed = [torch.zeros(bs, dtype=torch.float32, device=values.device)]
    lastgaelam = 0
    nextvalues = values[:, max_seqlen - 1] * seq_no_eos_mask
    for t in reversed(range(max_seqlen - 1)):
        delta = rewards[:, t] + discount * nextvalues - values[:, t]
        newgaelam = delta + discount * gae_lambda * lastgaelam
        mask = loss_mask[:, t]
        nextvalues = nextvalues * (1 - mask) + values[:, t] * mask
        lastgaelam = lastgaelam * (1 - mask) + newgaelam * mask
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values
