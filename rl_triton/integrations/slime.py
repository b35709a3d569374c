"""slime: drop-ins for the GAE and discounted-return scans of ``slime.utils.ppo_utils`` (written
against THUDM/slime at commit ``624b824a``), each one rl_triton call.

    import rl_triton.integrations.slime as rt_slime
    rt_slime.patch()          # in every process that computes advantages (slime's Megatron actors)
    ...                       # get_advantages_and_returns_batch, get_reinforce_plus_plus_returns: rl_triton
    rt_slime.unpatch()        # slime's own functions again (the same objects)

or without patching, with slime's signatures (slime itself need not be installed)::

    advantages, returns = rt_slime.chunked_gae(rewards, values, gamma=1.0, lambd=0.95)

``patch()`` sets the attributes of ``slime.utils.ppo_utils`` named in ``FUNCTIONS``:
``chunked_gae`` and ``vanilla_gae`` (which ``get_advantages_and_returns_batch`` calls for PPO's
GAE) and ``chunked_discounted_returns`` (which ``get_reinforce_plus_plus_returns`` calls).
slime reads them as module globals at each call, so the callers reach rl_triton unchanged. This
covers the path without context parallelism and the context-parallel one as slime runs it today
(all-gather the sequence, scan it whole, slice): the scan on the gathered rows is the drop-in.

Conventions mapped here (docs/slime.md): ``[B, T]`` rows of response tokens padded on the right
with zeros; GAE over the whole row with V = A = 0 past its end (no mask: slime zero-pads rewards
and values), ``returns = advantages + values``; the discounted return restarts from 0 past the
end. slime's ``chunk_size`` (the block length of its chunked-matmul scan) changes only its
rounding and is not read here. Where a function here raises while slime's ``ppo_utils`` is
imported, it raises what slime's own function raises on the same arguments.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

from .. import discounted_return, gae
from ..core.docstrings import documented
from ._llm import tensor_arg
from ._patching import PatchState, raising_as, requires_framework

__all__ = ["FUNCTIONS", "chunked_discounted_returns", "chunked_gae", "is_patched", "patch", "patched", "unpatch",
           "vanilla_gae"]

_PPO_UTILS = "slime.utils.ppo_utils"
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"  # THUDM/slime, the code these were checked against
_INSTALL = "slime @ git+https://github.com/THUDM/slime"
FUNCTIONS = ("chunked_gae", "vanilla_gae", "chunked_discounted_returns")


def _rows(x, name: str) -> torch.Tensor:
    x = tensor_arg(x, name)
    if x.ndim != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(x.shape)}")
    return x


def _slime_function(name: str):
    """slime's own function ``name`` for the error path, while its ppo_utils is imported."""
    module = sys.modules.get(_PPO_UTILS)
    fn = _saved.get(name) or (None if module is None else getattr(module, name, None))
    return None if fn is None or fn is _OURS.get(name) else fn


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


_OURS = {name: globals()[name] for name in FUNCTIONS}


def _ppo_utils():
    requires_framework(__name__, "slime", "slime", requirement=_INSTALL)
    return importlib.import_module(_PPO_UTILS)


_module: types.ModuleType | None = None
_saved = {}  # name -> slime's function that patch() replaced


def _apply() -> None:
    global _module
    module = _ppo_utils()
    for name in FUNCTIONS:
        if name in vars(module):
            _saved[name] = getattr(module, name)
            setattr(module, name, _OURS[name])
    _module = module


def _restore() -> None:
    global _module
    module, _module = _module, None
    for name, fn in _saved.items():
        if getattr(module, name, None) is _OURS[name]:  # what someone else set since stays
            setattr(module, name, fn)
    _saved.clear()


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route slime's ``FUNCTIONS`` (the GAE and discounted-return scans of ``slime.utils.ppo_utils``)
    through rl_triton until ``unpatch()``. Imports slime; ``ImportError`` where it cannot.
    Idempotent. Thread-safe. Call it in each process that computes advantages (slime's Megatron
    training actors); the patch is shared with ``patched()`` blocks, in any thread."""
    _ppo_utils()
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``: slime's own functions (the same objects) are back at once, or, while
    ``patched()`` blocks are open (in any thread), when the last of them closes. Idempotent."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether slime's scans are routed through rl_triton now."""
    return _state.active


def patched():
    """``with patched(): ...``: slime is patched for the block. Blocks nest, also across threads;
    slime's own functions come back when the last holder (block or ``patch()``) lets go. Imports
    slime when called (``ImportError`` where it cannot)."""
    _ppo_utils()
    return _state.patched()
