"""Tianshou (written against tianshou 2.0.1): the GAE and the discounted returns of
``Algorithm.compute_episodic_return`` as fused scans, on the host through numba (the flattened
buffer cut where episodes end, the pieces on several threads) or on a CUDA device where the
values are CUDA tensors.

    import rl_triton.integrations.tianshou as rt_tianshou
    rt_tianshou.patch()       # Algorithm.compute_episodic_return and _gae, for every algorithm
    ...                       # A2C, PPO, REINFORCE, ... as usual
    rt_tianshou.unpatch()     # Tianshou's own objects back, the same ones

or, without patching, the two functions here called directly: :func:`gae_advantages` (the
signature of Tianshou's ``_gae``) and :func:`compute_episodic_return` (the static method's).
Neither needs Tianshou; ``patch()`` imports it.

Conventions mapped (docs/tianshou.md): the batch is Tianshou's flattened buffer, one 1-D array
per field in buffer order, episodes one after another; ``end_flag[i]`` (``terminated |
truncated``, and the last step of each unfinished episode) cuts the trace after step i but keeps
its bootstrap; ``v_s_[i]`` is V of the observation after step i, already zero where the step
terminated (``value_mask``), ``v_s[i]`` V of the observation of step i. So

    A[i] = r[i] + gamma * v_s_[i] - v_s[i] + gamma * lambda * (1 - end_flag[i]) * A[i+1],

the end of the arrays ending the trace, which is ``rl_triton.gae`` with explicit next values
and every end a truncation (``next_values=v_s_``, ``truncated=end_flag``). Without values
(``v_s_`` and ``v_s`` None, lambda 1) the advantages are the discounted returns within episodes,
``rl_triton.discounted_return(rew, done=end_flag)``. Tianshou's loop runs in float64 whatever
the inputs' dtypes (its numba function promotes them), and so do the calls here: float32 inputs
are converted first, the outputs are float64.

The host path is parallel where the buffer allows: the 1-D arrays are read as ``P`` overlapping
rows of one strided view (no copy), row k from ``k * S`` to ``(k + 1) * S + H``, and each row's
first ``S`` outputs are kept. A row's kept outputs are exact where an episode ends inside its
overlap ``H`` (the trace from any kept step is cut before the row's end), which is checked on
the flags; where it is not so, the call runs as one row.
"""

from __future__ import annotations

import threading
from typing import Any, Union

import numpy as np
import torch

from .. import discounted_return, gae
from ._patching import PatchState

__all__ = ["TIANSHOU_VERSION", "compute_episodic_return", "gae_advantages", "is_patched", "patch", "patched",
           "unpatch"]

Array = Union[np.ndarray, torch.Tensor]  # a 1-D numpy array or tensor
TIANSHOU_VERSION = "2.0.1"  # the version these drop-ins were written and checked against
# Where the host path splits a buffer into overlapping rows: from SPLIT_MIN_STEPS steps on, with two
# or more numba threads, into ROWS_PER_THREAD rows per thread, each overlapping the next by OVERLAP
# steps (doubled up to OVERLAP_MAX while some overlap holds no episode end). The threshold is high:
# a parallel region waits for every thread, which on a busy machine costs milliseconds (10x the
# scan of 100k steps, docs/tianshou.md), while one thread walks 256k steps in about a millisecond
SPLIT_MIN_STEPS = 1 << 18
ROWS_PER_THREAD = 2
OVERLAP = 1 << 10
OVERLAP_MAX = 1 << 16


def _numba_threads() -> int:
    try:
        import numba
    except ImportError:
        return 1
    return numba.get_num_threads()


def _layout(end_flag: np.ndarray) -> tuple[int, int, int] | None:
    """``(P, S, H)``: P rows of S + H steps, row k starting at k * S, where every overlap holds an
    episode end; None where the buffer is short or no such split is found."""
    n, threads = end_flag.shape[0], _numba_threads()
    rows = ROWS_PER_THREAD * threads
    if n < SPLIT_MIN_STEPS or threads < 2:  # one thread walks one row fastest: no copy of the kept outputs
        return None
    overlap = OVERLAP
    while overlap <= min(OVERLAP_MAX, n // (2 * rows)):
        stride = (n - overlap) // rows
        h = n - rows * stride
        # row k (k < P-1) keeps steps [kS, (k+1)S): exact where a flag is set in [(k+1)S - 1, (k+1)S + H - 1)
        starts = stride * np.arange(1, rows) - 1
        window = np.lib.stride_tricks.as_strided(end_flag[starts[0]:], (rows - 1, h),
                                                 (stride * end_flag.strides[0], end_flag.strides[0]))
        if window.any(axis=1).all():
            return rows, stride, h
        overlap *= 2
    return None


def _rows(x: torch.Tensor, layout) -> torch.Tensor:
    rows, stride, h = layout
    return x.as_strided((rows, stride + h), (stride, 1))


def _kept(y: torch.Tensor, layout, n: int) -> torch.Tensor:
    """The flat result from the rows' outputs: row k's first S steps, the last row's overlap
    (numpy copies on the host: a torch copy there waits on its thread pool)."""
    rows, stride, h = layout
    if y.device.type == "cpu":
        src, out = y.numpy(), np.empty(n, dtype=y.numpy().dtype)
        out[:rows * stride].reshape(rows, stride)[...] = src[:, :stride]
        out[rows * stride:] = src[-1, stride:]
        return torch.from_numpy(out)
    out = torch.empty(n, dtype=y.dtype, device=y.device)
    out[:rows * stride].view(rows, stride).copy_(y[:, :stride])
    out[rows * stride:].copy_(y[-1, stride:])
    return out


_NUMBERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _as_tensor(x, name: str, device=None, dtype=torch.float64) -> torch.Tensor:
    """``x`` as a contiguous 1-D tensor of ``dtype`` (None: its own) on ``device`` (None: its
    own); numpy arrays are converted by numpy (a torch conversion on the host waits on its
    thread pool) and wrapped without a copy."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold real numbers, got {x.dtype}")
        np_dtype = None if dtype is None else torch.empty((), dtype=dtype).numpy().dtype
        t = torch.from_numpy(np.ascontiguousarray(x.reshape(-1), dtype=np_dtype))
    elif isinstance(x, torch.Tensor):
        if not (x.is_floating_point() or x.dtype in _NUMBERS):
            raise TypeError(f"{name} must hold real numbers, got {x.dtype}")
        t = x.detach().reshape(-1).contiguous()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
    else:
        raise TypeError(f"{name} must be a numpy array or a torch.Tensor, got {type(x).__name__}")
    return t if device is None else t.to(device)


def _run(fn, tensors: dict, end: torch.Tensor, n_out: int, **kwargs):
    """The first ``n_out`` outputs of ``fn(**tensors, **kwargs)`` on 1-D tensors, as
    overlapping rows on the host where ``_layout`` finds them, else as one row."""
    layout = _layout(end.numpy()) if end.device.type == "cpu" else None
    if layout is not None:
        tensors = {k: _rows(v, layout) for k, v in tensors.items()}
    outs = fn(**tensors, **kwargs)
    outs = (outs if isinstance(outs, tuple) else (outs,))[:n_out]
    return outs if layout is None else tuple(_kept(y, layout, end.shape[0]) for y in outs)


def _gae_call(rewards, values, next_values, truncated, gamma, lmbda):
    return gae(rewards, values, next_values=next_values, truncated=truncated, gamma=gamma, lmbda=lmbda)


def _return_call(rewards, done, gamma):
    return discounted_return(rewards, done=done, gamma=gamma)


def _check_lengths(**arrays) -> int:
    n = {name: x.shape[0] for name, x in arrays.items()}
    if len(set(n.values())) > 1:
        raise ValueError(f"the arrays must have one length, got {n}")
    return next(iter(n.values()))


def _coefficient(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x}")
    return x


def _advantages(v_s, v_s_, rew, end_flag, gamma, gae_lambda, n_out=2):
    """``(advantages, advantages + v_s)`` as float64 tensors on the values' device (the
    advantages alone where ``n_out`` is 1)."""
    gamma, gae_lambda = _coefficient(gamma, "gamma"), _coefficient(gae_lambda, "gae_lambda")
    device = v_s_.device if isinstance(v_s_, torch.Tensor) else (
        v_s.device if isinstance(v_s, torch.Tensor) else None)
    v_s_t = _as_tensor(v_s_, "v_s_", device)
    v_st = _as_tensor(v_s, "v_s", v_s_t.device)
    rew_t = _as_tensor(rew, "rew", v_s_t.device)
    end = _as_tensor(end_flag, "end_flag", v_s_t.device, dtype=None)
    _check_lengths(v_s=v_st, v_s_=v_s_t, rew=rew_t, end_flag=end)
    return _run(_gae_call, dict(rewards=rew_t, values=v_st, next_values=v_s_t, truncated=end), end, n_out,
                gamma=gamma, lmbda=gae_lambda)


def gae_advantages(v_s: Array, v_s_: Array, rew: Array, end_flag: Array, gamma: float,
                   gae_lambda: float) -> Array:
    """Tianshou's ``_gae`` as one fused scan: the advantages, float64.

    A[i] = rew[i] + gamma * v_s_[i] - v_s[i] + gamma * gae_lambda * (1 - end_flag[i]) * A[i+1],
    A[n] = 0.

    Args:
        v_s: V of each step's observation, 1-D (numpy array or torch.Tensor).
        v_s_: V of the observation after each step, 1-D, zero where the step terminated.
        rew: the rewards, 1-D.
        end_flag: where an episode ends (the trace is cut after the step), 1-D, bool or 0/1.
        gamma: the discount, in [0, 1].
        gae_lambda: the GAE parameter, in [0, 1].

    Returns a float64 numpy array where the values are numpy arrays, else a float64 tensor on
    the device of the values (``v_s_``'s, else ``v_s``'s: CUDA values are computed there).
    """
    (adv,) = _advantages(v_s, v_s_, rew, end_flag, gamma, gae_lambda, n_out=1)
    return adv if isinstance(v_s_, torch.Tensor) or isinstance(v_s, torch.Tensor) else adv.numpy()


def _value_mask(buffer, indices):
    from tianshou.algorithm.algorithm_base import Algorithm

    return Algorithm.value_mask(buffer, indices)


def _end_flags(batch, buffer, indices) -> np.ndarray:
    """Tianshou's end flags: terminated or truncated, and the last stored step of every episode
    still being collected (``buffer.unfinished_index()``)."""
    end_flag = np.logical_or(batch.terminated, batch.truncated)
    unfinished = np.asarray(buffer.unfinished_index())
    if unfinished.size:
        indices = np.asarray(indices)
        size = getattr(buffer, "maxsize", 0)
        if indices.size and indices.dtype.kind in "iu" and size > 0 and unfinished.min() >= 0 \
                and unfinished.max() < size and indices.min() >= 0 and indices.max() < size:
            # a table over the buffer's slots instead of a search of every index
            table = np.zeros(size, dtype=bool)
            table[unfinished] = True
            end_flag |= table[indices]
        else:
            end_flag[np.isin(indices, unfinished)] = True
    return end_flag


def compute_episodic_return(batch: Any, buffer: Any, indices: np.ndarray, v_s_: Array | None = None,
                            v_s: Array | None = None, gamma: float = 0.99,
                            gae_lambda: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Tianshou's ``Algorithm.compute_episodic_return`` as one fused scan: ``(returns,
    advantages)``, float64 numpy arrays of the batch's length.

    The end flags are Tianshou's (``batch.terminated | batch.truncated``, and the last stored
    step of each unfinished episode of ``buffer``); ``v_s_`` is masked by Tianshou's
    ``value_mask`` (zero after a terminated step) and ``v_s`` defaults to it shifted by one
    (``np.roll``), as there. Then A is :func:`gae_advantages` and the returns are ``A + v_s``.
    With ``v_s_`` None the next values are zero and ``gae_lambda`` must be 1: with ``v_s`` None
    too, A is the discounted return within episodes (``rl_triton.discounted_return``).

    Args:
        batch: the rollout (``rew``, ``terminated``, ``truncated``), equal to ``buffer[indices]``.
        buffer: the replay buffer the batch comes from.
        indices: the batch's positions in ``buffer``.
        v_s_: V of the observation after each step (numpy or torch, any device), or None.
        v_s: V of each step's observation, or None.
        gamma: the discount, in [0, 1].
        gae_lambda: the GAE parameter, in [0, 1].
    """
    rew = batch.rew
    gamma, gae_lambda = _coefficient(gamma, "gamma"), _coefficient(gae_lambda, "gae_lambda")
    if v_s_ is None and not np.isclose(gae_lambda, 1.0):
        raise ValueError(f"without v_s_ the returns are Monte Carlo: gae_lambda must be 1, got {gae_lambda}")
    end_flag = _end_flags(batch, buffer, indices)
    if v_s_ is None and v_s is None and gae_lambda == 1.0:
        rew_t = _as_tensor(rew, "batch.rew")
        end = torch.from_numpy(end_flag)
        _check_lengths(rew=rew_t, end_flag=end)
        (returns,) = _run(_return_call, dict(rewards=rew_t, done=end), end, 1, gamma=gamma)
        returns = returns.numpy()
        return returns, returns.copy()
    if v_s_ is None:
        v_s_ = np.zeros_like(rew, dtype=np.float64)
    else:
        mask = _value_mask(buffer, indices)
        if isinstance(v_s_, torch.Tensor):
            v_s_ = v_s_.detach().flatten() * torch.from_numpy(np.asarray(mask)).to(v_s_.device)
        else:
            v_s_ = np.asarray(v_s_).flatten() * mask
    if v_s is None:
        v_s = torch.roll(v_s_, 1) if isinstance(v_s_, torch.Tensor) else np.roll(v_s_, 1)
    advantages, returns = _advantages(v_s, v_s_, rew, end_flag, gamma, gae_lambda)
    # Tianshou's contract: numpy arrays (values on a device are computed there, then copied back)
    return returns.cpu().numpy(), advantages.cpu().numpy()


# -- patching ------------------------------------------------------------------------------
_lock = threading.Lock()
_ORIGINALS: dict = {}  # name -> Tianshou's object, as found on first patch


def _base():
    from tianshou.algorithm import algorithm_base

    return algorithm_base


def _set_patch(on: bool) -> None:
    base = _base()
    with _lock:
        if not _ORIGINALS:
            _ORIGINALS["_gae"] = base.__dict__["_gae"]
            _ORIGINALS["compute_episodic_return"] = base.Algorithm.__dict__["compute_episodic_return"]
        if on:
            base._gae = gae_advantages
            base.Algorithm.compute_episodic_return = staticmethod(compute_episodic_return)
        else:
            base._gae = _ORIGINALS["_gae"]
            base.Algorithm.compute_episodic_return = _ORIGINALS["compute_episodic_return"]


_state = PatchState(lambda: _set_patch(True), lambda: _set_patch(False))


def patch() -> None:
    """Route ``Algorithm.compute_episodic_return`` (every algorithm's, also when called as
    ``Algorithm.compute_episodic_return``) and the module function ``_gae`` of
    ``tianshou.algorithm.algorithm_base`` through rl_triton until ``unpatch()``. Imports
    Tianshou. Idempotent. Thread-safe; shared with ``patched()`` blocks in any thread."""
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``: Tianshou's own objects are back at once, or when the last open
    ``patched()`` block closes. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``patch()`` or a ``patched()`` block routes Tianshou's functions now."""
    return _state.active


def patched():
    """``with patched(): ...``: Tianshou is patched for the block. Blocks nest, also across
    threads; Tianshou's objects come back when the last holder (block or ``patch()``) lets go."""
    return _state.patched()
