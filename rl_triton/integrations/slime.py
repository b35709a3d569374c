"""slime: drop-ins for the GAE and discounted-return scans of ``slime.utils.ppo_utils``, its
batch GAE and REINFORCE++ returns under context parallelism and its advantage whitening (written
against THUDM/slime at commit ``624b824a``), each one rl_triton call.

    import rl_triton.integrations.slime as rt_slime
    rt_slime.patch()          # in every process that computes advantages (slime's Megatron actors)
    ...                       # PPO's GAE (context-parallel too) and REINFORCE++'s returns: rl_triton
    rt_slime.unpatch()        # slime's own functions again (the same objects)

or without patching, with slime's signatures (slime itself need not be installed)::

    advantages, returns = rt_slime.chunked_gae(rewards, values, gamma=1.0, lambd=0.95)
    advantages, returns = rt_slime.context_parallel_gae(total_lengths, response_lengths, values_list,
                                                        rewards_list, 1.0, 0.95, group=cp_group)
    returns = rt_slime.context_parallel_reinforce_plus_plus_returns(rewards, kl, loss_masks, response_lengths,
                                                                     total_lengths, 0.05, 1.0, group=cp_group)

``patch()`` sets the attributes of ``slime.utils.ppo_utils`` named in ``FUNCTIONS``:
``chunked_gae`` and ``vanilla_gae`` (which ``get_advantages_and_returns_batch`` calls for PPO's
GAE), ``chunked_discounted_returns`` (which ``get_reinforce_plus_plus_returns`` calls), and
``get_advantages_and_returns_batch`` and ``get_reinforce_plus_plus_returns`` themselves, also
where slime's Megatron loss module bound them by name. slime reads them as module globals at
each call, so the callers reach rl_triton unchanged. Without context parallelism the two batch
functions stay slime's own around the scan drop-ins; with it, they are
:func:`context_parallel_gae` and :func:`context_parallel_reinforce_plus_plus_returns`: the ranks'
zig-zag pieces of every response scanned in place by one sharded call
(``rl_triton.Shards.zigzag``), where slime all-gathers each response, scans it whole on every
rank and slices its pieces back out. ``patch(whitening=True)`` also runs slime's
``distributed_masked_whiten`` (the advantages' whitening over the data- and context-parallel
ranks) as ``rl_triton.masked_whiten(..., group=...)``.

Conventions mapped here (docs/slime.md): ``[B, T]`` rows of response tokens padded on the right
with zeros; GAE over the whole row with V = A = 0 past its end (no mask: slime zero-pads rewards
and values), ``returns = advantages + values``; the discounted return restarts from 0 past the
end; REINFORCE++'s token rewards are ``-kl_coef * kl * loss_mask`` with the sequence's reward at
the response's last loss-masked token. slime's ``chunk_size`` (the block length of its
chunked-matmul scan) changes only its rounding and is not read here. Under context parallelism
a sequence of ``total_length`` tokens is cut into 2W pieces of ``ceil(total_length / 2W)``
positions, rank k holding pieces k and 2W-1-k, and a response token belongs to the piece of the
logits that score it (one position earlier).
Where a function here raises while slime's module of that name is imported, it raises what
slime's own function raises on the same arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

from .. import Shards, discounted_return, gae, masked_moments, masked_whiten
from ..core.docstrings import documented
from ._llm import tensor_arg
from ._patching import PatchState, raising_as, requires_framework

__all__ = ["FUNCTIONS", "WHITENING", "chunked_discounted_returns", "chunked_gae", "context_parallel_gae",
           "context_parallel_reinforce_plus_plus_returns", "distributed_masked_whiten",
           "get_advantages_and_returns_batch", "get_reinforce_plus_plus_returns", "is_patched", "patch", "patched",
           "unpatch", "vanilla_gae"]

_PPO_UTILS = "slime.utils.ppo_utils"
_DISTRIBUTED_UTILS = "slime.utils.distributed_utils"
_LOSS = "slime.backends.megatron_utils.loss"  # binds the batch functions and the whitening at import
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"  # THUDM/slime, the code these were checked against
_INSTALL = "slime @ git+https://github.com/THUDM/slime"
FUNCTIONS = ("chunked_gae", "vanilla_gae", "chunked_discounted_returns", "get_advantages_and_returns_batch",
             "get_reinforce_plus_plus_returns")
WHITENING = "distributed_masked_whiten"  # a switch while patched: the drop-in only for whitening=True
_HOMES = {**{name: _PPO_UTILS for name in FUNCTIONS}, WHITENING: _DISTRIBUTED_UTILS}


def _rows(x, name: str) -> torch.Tensor:
    x = tensor_arg(x, name)
    if x.ndim != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(x.shape)}")
    return x


def _slime_function(name: str):
    """slime's own function ``name`` for the error path, while its module is imported."""
    module = sys.modules.get(_HOMES[name])
    fn = _saved.get(name) or (None if module is None else getattr(module, name, None))
    return None if fn is None or fn is _OURS.get(name) or fn is _INSTALLED.get(name) else fn


_raises_as_slime = raising_as(_slime_function)

_GAE_ARGS = dict(
    rewards="``[B, T]`` float tensor of token rewards, each row zero-padded past its response.",
    values="``[B, T]`` float tensor of values, zero-padded as the rewards.",
    gamma="the discount: a number or a tensor in [0, 1].",
    lambd="the GAE lambda: a number or a tensor in [0, 1].",
)


def _gae(rewards, values, gamma, lambd):
    with torch.no_grad():
        r, v = _rows(rewards, "rewards"), _rows(values, "values")
        if v.shape != r.shape:
            raise ValueError(f"values must have the rewards' shape {tuple(r.shape)}, got {tuple(v.shape)}")
        dtype = torch.promote_types(r.dtype, v.dtype)
        return gae(r.to(dtype), v.to(dtype), gamma=gamma, lmbda=lambd)


@_raises_as_slime
@documented(_GAE_ARGS, chunk_size="the block length of slime's chunked scan; not read here (no effect on the math).")
def chunked_gae(rewards, values, gamma, lambd, chunk_size=128):
    """slime's ``chunked_gae``: ``(advantages, returns)``, ``[B, T]``.

    ``rl_triton.gae(rewards, values, gamma=gamma, lmbda=lambd)``: per row, backwards over t,
    delta[t] = r[t] + gamma*V[t+1] - V[t] (V[T] = 0), A[t] = delta[t] + gamma*lambd*A[t+1]
    (A[T] = 0), returns = A + V. slime evaluates the same sum as a chunked matrix product; the
    results agree to rounding.
    """
    return _gae(rewards, values, gamma, lambd)


@_raises_as_slime
@documented(_GAE_ARGS)
def vanilla_gae(rewards, values, gamma, lambd):
    """slime's ``vanilla_gae`` (its loop over the tokens): the same result as :func:`chunked_gae`."""
    return _gae(rewards, values, gamma, lambd)


@_raises_as_slime
@documented(
    rewards="``[B, T]`` float tensor of token rewards, each row zero-padded past its response.",
    discount="the discount: a number or a tensor in [0, 1].",
    chunk_size="the block length of slime's chunked scan; not read here (no effect on the math).",
)
def chunked_discounted_returns(rewards, discount, chunk_size=128):
    """slime's ``chunked_discounted_returns``: ``[B, T]``, G[t] = r[t] + discount * G[t+1],
    G[T] = 0: ``rl_triton.discounted_return(rewards, gamma=discount)``."""
    with torch.no_grad():
        return discounted_return(_rows(rewards, "rewards"), gamma=discount)


_BATCH_ARGS = dict(
    total_lengths="the length of each sequence, prompt and response (ints, the same on every CP rank).",
    response_lengths="the number of response tokens of each sequence (ints, the same on every CP rank).",
    values_list="one 1-D float tensor per sequence: the values of this rank's response tokens (its two "
                "pieces of the response, concatenated, under context parallelism; the whole response without).",
    rewards_list="one 1-D float tensor per sequence, laid out as ``values_list``: the token rewards.",
    gamma="the discount: a number or a tensor in [0, 1].",
    lambd="the GAE lambda: a number or a tensor in [0, 1].",
)


def _response_pieces(total_length: int, response_length: int, world: int) -> list:
    """Where Megatron's context-parallel split cuts one response: the ``2 * world + 1`` bounds, in
    response-token positions, of the ``2 * world`` pieces of ``ceil(total_length / (2 * world))``
    sequence positions. Response token j is scored by the logits at sequence position
    ``prompt_length - 1 + j``, so piece m holds the tokens whose position lies in
    ``[m * size, (m + 1) * size)``; pieces inside the prompt are empty."""
    size = -(-total_length // (2 * world))
    shift = total_length - response_length - 1
    return [min(max(m * size - shift, 0), response_length) for m in range(2 * world + 1)]


def _lengths(x, name: str) -> list:
    if isinstance(x, (str, bytes, torch.Tensor)) or not hasattr(x, "__len__"):
        raise TypeError(f"{name} must be a list of ints, got {type(x).__name__}")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in x):
        raise TypeError(f"{name} must hold ints, got {list(x)!r}")
    return list(x)


def _token_lists(B: int, **lists) -> None:
    """Each of ``lists`` (argument name -> value) a list of B 1-D tensors, else the error naming it."""
    for name, xs in lists.items():
        if isinstance(xs, torch.Tensor) or not hasattr(xs, "__len__"):
            raise TypeError(f"{name} must be a list of 1-D tensors, got {type(xs).__name__}")
        if len(xs) != B:
            raise ValueError(f"{name} must hold one tensor per sequence ({B}), got {len(xs)}")
        for i, x in enumerate(xs):
            if tensor_arg(x, f"{name}[{i}]").ndim != 1:
                raise ValueError(f"{name}[{i}] must be 1-D (the sequence's tokens), got shape {tuple(x.shape)}")


def _without_cp(response_lengths, values_list, rewards_list, gamma, lambd):
    """slime's path without context parallelism: the responses in zero-padded rows, one scan."""
    values = values_list[0].new_zeros(len(response_lengths), max(response_lengths))
    rewards = torch.zeros_like(values)
    for i, n in enumerate(response_lengths):
        values[i, :n] = values_list[i]
        rewards[i, :n] = rewards_list[i]
    advantages, returns = _gae(rewards, values, gamma, lambd)
    return ([advantages[i, :n] for i, n in enumerate(response_lengths)],
            [returns[i, :n] for i, n in enumerate(response_lengths)])


def _cp_layout(total_lengths, response_lengths, group):
    """The checked lengths and ``group``, and this rank's pieces of every response:
    ``(total_lengths, response_lengths, world, rank, bounds, parts)``, ``bounds[i]`` the pieces'
    bounds of response i (``_response_pieces``) and ``parts[i]`` the token counts of this rank's
    two pieces of it (``bounds``, ``parts`` None with one rank)."""
    import torch.distributed as dist

    total_lengths = _lengths(total_lengths, "total_lengths")
    response_lengths = _lengths(response_lengths, "response_lengths")
    B = len(response_lengths)
    if B == 0 or len(total_lengths) != B:
        raise ValueError(f"total_lengths and response_lengths must give the same number of sequences (one at "
                         f"least), got {len(total_lengths)} and {B}")
    for t, n in zip(total_lengths, response_lengths):
        if not 0 < n < t:
            raise ValueError(f"response_lengths must lie in [1, total_length) (a prompt of one token at least), "
                             f"got {n} for a total length of {t}")
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return total_lengths, response_lengths, 1, 0, None, None
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group")
    bounds = [_response_pieces(t, n, world) for t, n in zip(total_lengths, response_lengths)]
    parts = [(b[rank + 1] - b[rank], b[2 * world - rank] - b[2 * world - 1 - rank]) for b in bounds]
    return total_lengths, response_lengths, world, rank, bounds, parts


def _token_counts(wanted, **lists) -> None:
    """Each tensor of ``lists`` (argument name -> list) holding this rank's ``wanted[i]`` tokens."""
    for i, n in enumerate(wanted):
        for name, xs in lists.items():
            if xs[i].shape[0] != n:
                raise ValueError(f"{name}[{i}] must hold this rank's {n} tokens of the response, got {xs[i].shape[0]}")


def _runs(starts, counts, device) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, counts)])``: one index tensor."""
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, counts)])


def _slots(bounds, parts, device):
    """Where this rank's tokens go in its ``[B, 2 * slot]`` rows of equal slots, one slot per piece
    and every slot as long as the longest piece of any rank: ``(slot, index)``, ``index`` the
    flat position of each token of the rank's pieces concatenated (response by response, piece k
    at the start of the row's first slot, piece 2W-1-k at the start of its second)."""
    slot = max(1, max(b[m + 1] - b[m] for b in bounds for m in range(len(b) - 1)))
    return slot, _runs([j * slot for j in range(2 * len(parts))], [n for pair in parts for n in pair], device)


@documented(_BATCH_ARGS, group="the context-parallel ``torch.distributed`` ProcessGroup (Megatron's "
            "``mpu.get_context_parallel_group()``), or None: no context parallelism.")
def context_parallel_gae(total_lengths, response_lengths, values_list, rewards_list, gamma, lambd, group=None):
    """GAE of every response split over the context-parallel ranks of ``group`` as Megatron-LM
    (and slime) split it, as one sharded call: ``(advantages_list, returns_list)``, this rank's
    tokens of each response, laid out as ``values_list``.

    Per response, backwards over its tokens t, delta[t] = r[t] + gamma*V[t+1] - V[t] (V = 0 past
    the response), A[t] = delta[t] + gamma*lambd*A[t+1] (A = 0 past it), returns = A + V: slime's
    GAE of the whole response. With W ranks, the sequence (prompt and response) is cut into 2W
    pieces of ``ceil(total_length / 2W)`` positions and rank k holds the response tokens of pieces
    k and 2W-1-k (slime's ``get_logits_and_tokens_offset_with_cp``; a response token lies at the
    position of the logits that score it, one before its own); every response's pieces go
    into slots of one length (its tokens first, then masked padding), the rows of this rank's
    ``[B, 2 * slot]`` batch, and ``rl_triton.gae(..., mask=m, mask_mode="skip",
    group=rl_triton.Shards.zigzag(group))`` scans them: the padding is no step, and the ranks
    exchange a few numbers per row instead of the responses (docs/distributed.md).
    Every rank of ``group`` calls it with the same lengths. The outputs have ``values_list``'s
    dtype (slime casts the rewards to it). No autograd.
    """
    total_lengths, response_lengths, world, rank, bounds, parts = _cp_layout(total_lengths, response_lengths, group)
    B = len(response_lengths)
    _token_lists(B, values_list=values_list, rewards_list=rewards_list)
    wanted = response_lengths if world == 1 else [a + b for a, b in parts]
    _token_counts(wanted, values_list=values_list, rewards_list=rewards_list)
    with torch.no_grad():
        if world == 1:
            return _without_cp(response_lengths, values_list, rewards_list, gamma, lambd)
        slot, index = _slots(bounds, parts, values_list[0].device)
        values = torch.cat(list(values_list))
        rows_v = values.new_zeros(B * 2 * slot).index_copy_(0, index, values)
        rows_r = rows_v.new_zeros(B * 2 * slot).index_copy_(0, index, torch.cat(list(rewards_list)).to(values.dtype))
        mask = torch.zeros(B * 2 * slot, dtype=torch.bool, device=values.device).index_fill_(0, index, True)
        advantages, returns = gae(rows_r.view(B, -1), rows_v.view(B, -1), mask=mask.view(B, -1), mask_mode="skip",
                                  gamma=gamma, lmbda=lambd, group=Shards.zigzag(group))
        return (list(advantages.view(-1).index_select(0, index).split(wanted)),
                list(returns.view(-1).index_select(0, index).split(wanted)))


@_raises_as_slime
@documented(_BATCH_ARGS, chunked="slime's choice between chunked_gae and vanilla_gae; not read here (the same GAE).")
def get_advantages_and_returns_batch(total_lengths, response_lengths, values_list, rewards_list, gamma, lambd,
                                     chunked=True):
    """slime's ``get_advantages_and_returns_batch``: ``(advantages_list, returns_list)``, this
    rank's tokens of each response's GAE.

    Reads the context-parallel world from Megatron-LM's ``mpu``, as slime's does. With one rank
    (no context parallelism) it is slime's own function while patched (whose scan is the
    ``chunked_gae`` drop-in), and the same zero-padded batch and scan otherwise. With several it
    is :func:`context_parallel_gae` on ``mpu.get_context_parallel_group()``: one sharded scan of
    the ranks' pieces where slime all-gathers every response, scans it whole on every rank and
    slices its pieces back out. The results agree to rounding.
    """
    from megatron.core import mpu

    if mpu.get_context_parallel_world_size() == 1:
        theirs = _saved.get("get_advantages_and_returns_batch")
        if theirs is not None:
            return theirs(total_lengths, response_lengths, values_list, rewards_list, gamma, lambd, chunked=chunked)
        return context_parallel_gae(total_lengths, response_lengths, values_list, rewards_list, gamma, lambd)
    return context_parallel_gae(total_lengths, response_lengths, values_list, rewards_list, gamma, lambd,
                                group=mpu.get_context_parallel_group())


_RPP_ARGS = dict(
    rewards="1-D float tensor of the sequences' scalar rewards, one per sequence.",
    kl="one 1-D float tensor per sequence: the per-token KL estimate of this rank's response tokens (its two "
       "pieces of the response, concatenated, under context parallelism; the whole response without).",
    loss_masks="one 1-D tensor per sequence: the loss mask of the whole response (nonzero: the token is "
               "trained on), the same on every CP rank, with one such token at least.",
    response_lengths=_BATCH_ARGS["response_lengths"],
    total_lengths=_BATCH_ARGS["total_lengths"],
    kl_coef="the KL penalty's coefficient (a number).",
    gamma="the discount: a number in [0, 1].",
)


def _number(x, name: str, unit: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if unit and not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {x}")
    return x


def _last_tokens(loss_masks) -> list:
    """The index of each response's last loss-masked token (one read on the host), ValueError
    naming the mask that has none."""
    last = []
    for m in loss_masks:
        flipped = (m != 0).flip(0).to(torch.uint8)
        k = flipped.argmax()  # the first marked token from the end, or 0 where none is
        last.append(torch.where(flipped[k] != 0, m.shape[0] - 1 - k, -1))
    last = torch.stack(last).tolist()
    for i, j in enumerate(last):
        if j < 0:
            raise ValueError(f"loss_masks[{i}] must mark one token of the response at least (it masks them all)")
    return last


@documented(_RPP_ARGS, group="the context-parallel ``torch.distributed`` ProcessGroup (Megatron's "
            "``mpu.get_context_parallel_group()``), or None: no context parallelism.")
def context_parallel_reinforce_plus_plus_returns(rewards, kl, loss_masks, response_lengths, total_lengths, kl_coef,
                                                 gamma, group=None):
    """REINFORCE++'s returns of every response split over the context-parallel ranks of
    ``group`` as Megatron-LM (and slime) split it, as one sharded call: a list of this rank's
    returns of each response, laid out as ``kl``.

    Per response of n tokens with loss mask m and last masked token e, the token rewards are
    r[t] = -kl_coef * kl[t] * m[t], plus the sequence's reward at t = e, and the return is
    G[t] = r[t] + gamma * G[t+1], G[n] = 0: slime's ``get_reinforce_plus_plus_returns`` of the
    whole response. The ranks' pieces are those of :func:`context_parallel_gae` and go into its
    slots of one length; the padding is no step (reward 0, discount 1: a per-step ``gamma``
    tensor, as ``discounted_return`` takes no mask), and one ``rl_triton.discounted_return(...,
    gamma=g, group=rl_triton.Shards.zigzag(group))`` scans them, where slime all-gathers each
    response's KL, scans it whole on every rank and slices its pieces back out. Every rank of
    ``group`` calls it with the same lengths, rewards and masks. The outputs have ``kl``'s dtype.
    No autograd.
    """
    total_lengths, response_lengths, world, rank, bounds, parts = _cp_layout(total_lengths, response_lengths, group)
    B = len(response_lengths)
    rewards = tensor_arg(rewards, "rewards")
    if rewards.shape != (B,):
        raise ValueError(f"rewards must be 1-D with one reward per sequence ({B}), got shape {tuple(rewards.shape)}")
    _token_lists(B, kl=kl, loss_masks=loss_masks)
    kl_coef, gamma = _number(kl_coef, "kl_coef"), _number(gamma, "gamma", unit=True)
    wanted = response_lengths if world == 1 else [a + b for a, b in parts]
    _token_counts(wanted, kl=kl)
    for i, n in enumerate(response_lengths):
        if loss_masks[i].shape[0] != n:
            raise ValueError(f"loss_masks[{i}] must hold the whole response's {n} tokens, got {loss_masks[i].shape[0]}")
    last = _last_tokens(loss_masks)
    with torch.no_grad():
        if world == 1:  # slime's own steps around the scan
            token_rewards = []
            for i, e in enumerate(last):
                r = -kl_coef * (kl[i] * loss_masks[i])
                r[e] += rewards[i]
                token_rewards.append(r)
            rows = token_rewards[0].new_zeros(B, max(response_lengths))
            for i, r in enumerate(token_rewards):
                rows[i, :r.size(0)] = r
            returns = discounted_return(rows, gamma=gamma)
            return [returns[i, :n] for i, n in enumerate(response_lengths)]
        device = kl[0].device
        masks = torch.cat([m[b[k]:b[k + 1]] for m, b in zip(loss_masks, bounds)
                           for k in (rank, 2 * world - 1 - rank)]).to(device)
        token_rewards = -kl_coef * (torch.cat(list(kl)) * masks)
        # the sequence reward on the rank whose pieces hold the response's last masked token
        seqs, at, start = [], [], 0
        for i, (e, b, (n0, n1)) in enumerate(zip(last, bounds, parts)):
            if b[rank] <= e < b[rank + 1]:
                seqs.append(i), at.append(start + e - b[rank])
            elif b[2 * world - 1 - rank] <= e < b[2 * world - rank]:
                seqs.append(i), at.append(start + n0 + e - b[2 * world - 1 - rank])
            start += n0 + n1
        if seqs:
            at = torch.tensor(at, device=device)
            token_rewards[at] = token_rewards[at] + rewards.to(device)[torch.tensor(seqs, device=device)]
        slot, index = _slots(bounds, parts, device)
        rows = token_rewards.new_zeros(B * 2 * slot).index_copy_(0, index, token_rewards)
        # gamma 1 passes the return through the padding as it is: a number will do
        discounts = gamma if gamma == 1 else torch.ones_like(rows).index_fill_(0, index, gamma).view(B, -1)
        returns = discounted_return(rows.view(B, -1), gamma=discounts, group=Shards.zigzag(group))
        return list(returns.view(-1).index_select(0, index).split(wanted))


@_raises_as_slime
@documented(_RPP_ARGS)
def get_reinforce_plus_plus_returns(rewards, kl, loss_masks, response_lengths, total_lengths, kl_coef, gamma):
    """slime's ``get_reinforce_plus_plus_returns``: a list of this rank's REINFORCE++ returns of
    each response (:func:`context_parallel_reinforce_plus_plus_returns` has the math).

    Reads the context-parallel world from Megatron-LM's ``mpu``, as slime's does. With one rank
    it is slime's own function while patched (whose scan is the ``chunked_discounted_returns``
    drop-in), and the same steps otherwise. With several it is
    :func:`context_parallel_reinforce_plus_plus_returns` on ``mpu.get_context_parallel_group()``:
    one sharded scan of the ranks' pieces where slime all-gathers every response's KL, scans it
    whole on every rank and slices its pieces back out. The results agree to rounding. No
    sequences: an empty list, as slime's.
    """
    from megatron.core import mpu

    if isinstance(rewards, torch.Tensor) and rewards.numel() == 0:
        return []
    args = dict(rewards=rewards, kl=kl, loss_masks=loss_masks, response_lengths=response_lengths,
                total_lengths=total_lengths, kl_coef=kl_coef, gamma=gamma)
    if mpu.get_context_parallel_world_size() == 1:
        theirs = _saved.get("get_reinforce_plus_plus_returns")
        return (context_parallel_reinforce_plus_plus_returns if theirs is None else theirs)(**args)
    return context_parallel_reinforce_plus_plus_returns(**args, group=mpu.get_context_parallel_group())


@_raises_as_slime
@documented(
    values="the rank's float tensor of advantages (any shape; may be empty).",
    mask="``values``' shape: nonzero marks a token that enters the statistics.",
    process_group="the ``torch.distributed`` ProcessGroup whose ranks' tokens the statistics span "
                  "(slime: the data-parallel group with context parallelism); None: the default group.",
    shift_mean="False adds the mean back (only the scale changes).",
    epsilon="added to the variance under the square root.",
)
def distributed_masked_whiten(values, mask, process_group=None, shift_mean=True, epsilon=1e-8):
    """slime's ``distributed_masked_whiten``: ``(values - mean) * rsqrt(var + epsilon)`` with the
    mean and unbiased variance (n / (n - 1), for n >= 2) of the masked tokens of every rank of
    ``process_group``, as ``rl_triton.masked_whiten(values, mask, shift_mean=shift_mean,
    eps=epsilon, group=process_group)``: one all-gather of each rank's (count, mean, M2) in
    float64 where slime all-reduces float32 sums and sums of squares. A mask without a token on
    any rank is slime's ``ValueError`` (one more all-gather of the counts, read on the host as
    slime reads its own). Under context parallelism each rank passes its pieces of every response
    and the statistics are those of the whole responses. No autograd.
    """
    import torch.distributed as dist

    group = dist.group.WORLD if process_group is None else process_group
    count, _, _ = masked_moments(values, mask, group=group)
    if count.item() == 0:
        raise ValueError("mask: no token is valid on any rank of process_group")
    return masked_whiten(values, mask, shift_mean=shift_mean, eps=epsilon, group=group)


def _whitening_switch(values, mask, process_group=None, shift_mean=True, epsilon=1e-8):
    """What a patch sets as slime's ``distributed_masked_whiten``: the drop-in while the most
    recent holder of the patch asked for ``whitening=True``, slime's own function otherwise."""
    if _state.settings(_DEFAULT_SETTINGS)["whitening"]:
        return distributed_masked_whiten(values, mask, process_group, shift_mean, epsilon)
    return _saved[WHITENING](values, mask, process_group, shift_mean, epsilon)


_OURS = {name: globals()[name] for name in (*FUNCTIONS, WHITENING)}
_INSTALLED = {**{name: _OURS[name] for name in FUNCTIONS}, WHITENING: _whitening_switch}  # what patch() sets
_DEFAULT_SETTINGS = {"whitening": False}


def _ppo_utils():
    requires_framework(__name__, "slime", "slime", requirement=_INSTALL)
    return importlib.import_module(_PPO_UTILS)


_saved = {}  # name -> slime's function that patch() replaced


def _apply() -> None:
    _ppo_utils()
    for name, fn in _INSTALLED.items():
        module = sys.modules.get(_HOMES[name]) or importlib.util.find_spec(_HOMES[name]) and \
            importlib.import_module(_HOMES[name])
        if module and name in vars(module):
            _saved[name] = getattr(module, name)
            setattr(module, name, fn)
    # slime's loss module binds three of them by name when it is imported; once imported, it keeps
    # slime's objects unless they are set there too (imported later, it binds the patched ones)
    loss = sys.modules.get(_LOSS)
    for name, fn in _saved.items():
        if loss is not None and getattr(loss, name, None) is fn:
            setattr(loss, name, _INSTALLED[name])


def _restore() -> None:
    for module in (*{sys.modules.get(_HOMES[name]) for name in _saved}, sys.modules.get(_LOSS)):
        for name, fn in _saved.items():
            if module is not None and getattr(module, name, None) is _INSTALLED[name]:  # another's setting stays
                setattr(module, name, fn)
    _saved.clear()


_state = PatchState(_apply, _restore)


def _settings(whitening) -> dict:
    if not isinstance(whitening, bool):
        raise TypeError(f"whitening must be a bool, got {type(whitening).__name__}")
    return {"whitening": whitening}


def patch(whitening: bool = False) -> None:
    """Route slime's ``FUNCTIONS`` (the GAE and discounted-return scans of ``slime.utils.ppo_utils``,
    ``get_advantages_and_returns_batch`` and ``get_reinforce_plus_plus_returns``, whose
    context-parallel paths become one sharded scan each) through rl_triton until ``unpatch()``;
    with ``whitening=True`` also slime's ``distributed_masked_whiten`` (the advantage whitening
    over the data- and context-parallel ranks), which otherwise stays slime's. Imports slime; ``ImportError`` where it cannot.
    Idempotent (a later call's ``whitening`` holds from then on). Thread-safe. Call it in each
    process that computes advantages (slime's Megatron training actors); the patch is shared with
    ``patched()`` blocks, in any thread.

    Args:
        whitening: whether slime's whitening runs as ``rl_triton.masked_whiten`` (a bool).
    """
    settings = _settings(whitening)
    _ppo_utils()
    _state.patch(settings)


def unpatch() -> None:
    """Withdraw ``patch()``: slime's own functions (the same objects) are back at once, or, while
    ``patched()`` blocks are open (in any thread), when the last of them closes. Idempotent."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether slime's scans are routed through rl_triton now."""
    return _state.active


def patched(whitening: bool = False):
    """``with patched(): ...``: slime is patched for the block (``whitening`` as for ``patch()``,
    while the block is the most recent holder). Blocks nest, also across threads; slime's own
    functions come back when the last holder (block or ``patch()``) lets go. Imports slime when
    called (``ImportError`` where it cannot).

    Args:
        whitening: whether slime's whitening runs as ``rl_triton.masked_whiten`` (a bool).
    """
    settings = _settings(whitening)
    _ppo_utils()
    return _state.patched(settings)
