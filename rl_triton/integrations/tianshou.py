"""Tianshou (written against tianshou 2.0.1): the GAE and the discounted returns of
``Algorithm.compute_episodic_return`` as one fused pass, on the host through numba (the CPU
backend's flat-buffer GAE, ``rl_triton.core.cpu.gae_flat_run``) or on a CUDA device where the
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
the inputs' dtypes (its numba function promotes them), and so does the kernel here: it reads
float32 or float64 arrays as they are and widens each element, the outputs are float64.

On the host one numba pass forms the end flags and the value mask (from the indices, the
batch's flags and the buffer's slots), and one more forms the advantages and the returns, the
mask applied and the float32 values widened inside it; the kernel cuts the buffer at end flags
into stretches that advance together (and, from ``SPLIT_MIN_STEPS`` steps with several numba
threads, run on the threads). On a device the values' tensors go through ``rl_triton.gae``.
"""

from __future__ import annotations

import threading
from typing import Any, Union

import numpy as np
import torch

from .. import gae
from ..core import cpu as _cpu
from ._patching import PatchState

__all__ = ["TIANSHOU_VERSION", "compute_episodic_return", "gae_advantages", "is_patched", "patch", "patched",
           "unpatch"]

Array = Union[np.ndarray, torch.Tensor]  # a 1-D numpy array or tensor
TIANSHOU_VERSION = "2.0.1"  # the version these drop-ins were written and checked against
# From this many steps on, with two or more numba threads, the host path spreads its stretches
# over the threads. The threshold is high: on the loaded 2-core machine of docs/tianshou.md a
# numba parallel region cost more than it saved at 1M steps (8-12 ms median on two threads
# against 2.1-2.5 ms on one: the region waits for a thread the other jobs hold), so below it
# one thread runs
SPLIT_MIN_STEPS = 1 << 22


def _numba_threads() -> int:
    try:
        import numba
    except ImportError:
        return 1
    return numba.get_num_threads()


def _host_threads(n: int) -> int:
    if n < SPLIT_MIN_STEPS:  # asked first: numba's thread count takes a lock
        return 1
    threads = _numba_threads()
    return threads if threads > 1 else 1


_NUMBERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _on_device(*xs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in xs)


def _host(x, name: str, flags: bool = False) -> np.ndarray:
    """``x`` (numpy array or CPU tensor) as the 1-D numpy array the flat kernel reads, without a
    copy where it can: floats as float32 or float64 (others widened to float64, the values
    Tianshou's numba loop computes with), flags as bool or uint8 0/1."""
    if isinstance(x, torch.Tensor):
        if not (x.is_floating_point() or x.dtype in _NUMBERS):
            raise TypeError(f"{name} must hold real numbers, got {x.dtype}")
        x = x.detach().reshape(-1)
        if x.dtype not in (torch.float32, torch.float64, torch.bool, torch.uint8):
            x = x.to(torch.float64)
        a = x.numpy()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold real numbers, got {x.dtype}")
        a = x.reshape(-1)
    else:
        raise TypeError(f"{name} must be a numpy array or a torch.Tensor, got {type(x).__name__}")
    if flags:
        return a if a.dtype == np.bool_ else a != 0
    return a if a.dtype in (np.float32, np.float64) else a.astype(np.float64)


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


def _advantages(v_s, v_s_, rew, end_flag, gamma: float, gae_lambda: float, targets: bool = True):
    """``(advantages, advantages + v_s)``, float64 (the second None where ``targets`` is
    False): numpy arrays from the flat numba kernel on the host, tensors on the values' device
    where a value tensor is on one (or where numba is missing)."""
    if not _on_device(v_s, v_s_) and _cpu.available():
        v_s_a, v_s_b, rew_a = _host(v_s_, "v_s_"), _host(v_s, "v_s"), _host(rew, "rew")
        end = _host(end_flag, "end_flag", flags=True)
        n = _check_lengths(v_s=v_s_b, v_s_=v_s_a, rew=rew_a, end_flag=end)
        return _cpu.gae_flat_run(rew_a, v_s_b, v_s_a, None, end, gamma, gae_lambda, threads=_host_threads(n),
                                 targets=targets)
    device = v_s_.device if isinstance(v_s_, torch.Tensor) else (
        v_s.device if isinstance(v_s, torch.Tensor) else None)
    v_s_t = _as_tensor(v_s_, "v_s_", device)
    v_st = _as_tensor(v_s, "v_s", v_s_t.device)
    rew_t = _as_tensor(rew, "rew", v_s_t.device)
    end = _as_tensor(end_flag, "end_flag", v_s_t.device, dtype=None)
    _check_lengths(v_s=v_st, v_s_=v_s_t, rew=rew_t, end_flag=end)
    adv, ret = gae(rew_t, v_st, next_values=v_s_t, truncated=end, gamma=gamma, lmbda=gae_lambda)
    return adv, ret if targets else None


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
    gamma, gae_lambda = _coefficient(gamma, "gamma"), _coefficient(gae_lambda, "gae_lambda")
    adv, _ = _advantages(v_s, v_s_, rew, end_flag, gamma, gae_lambda, targets=False)
    tensors = isinstance(v_s_, torch.Tensor) or isinstance(v_s, torch.Tensor)
    if isinstance(adv, np.ndarray):
        return torch.from_numpy(adv) if tensors else adv
    return adv if tensors else adv.numpy()


def _value_mask(buffer, indices):
    from tianshou.algorithm.algorithm_base import Algorithm

    return Algorithm.value_mask(buffer, indices)


def _stock_value_mask() -> bool:
    """Whether ``Algorithm.value_mask`` is Tianshou's own (``~buffer.terminated[indices]``),
    which the fused flag pass reproduces; a replaced one is called instead."""
    from tianshou.algorithm.algorithm_base import Algorithm

    fn = Algorithm.value_mask
    return getattr(fn, "__module__", None) == "tianshou.algorithm.algorithm_base" \
        and getattr(fn, "__qualname__", None) == "Algorithm.value_mask"


def _unfinished_table(unfinished: np.ndarray, size: int) -> np.ndarray | None:
    """A bool table over the buffer's ``size`` slots, set at the unfinished episodes' last
    slots; None where one of them lies outside the slots."""
    if unfinished.size and (unfinished.min() < 0 or unfinished.max() >= size):
        return None
    table = np.zeros(size, dtype=bool)
    table[unfinished] = True
    return table


def _end_flags(batch, buffer, indices) -> np.ndarray:
    """Tianshou's end flags: terminated or truncated, and the last stored step of every episode
    still being collected (``buffer.unfinished_index()``)."""
    end_flag = np.logical_or(batch.terminated, batch.truncated)
    unfinished = np.asarray(buffer.unfinished_index())
    if unfinished.size:
        indices = np.asarray(indices)
        size = getattr(buffer, "maxsize", 0)
        table = _unfinished_table(unfinished, size) if size > 0 else None
        if table is not None and indices.size and indices.dtype.kind in "iu" and indices.min() >= 0 \
                and indices.max() < size:
            end_flag |= table[indices]  # a table over the buffer's slots instead of a search of every index
        else:
            end_flag[np.isin(indices, unfinished)] = True
    return end_flag


def _flags(batch, buffer, indices, masked: bool):
    """``(end_flag, value_mask)`` as Tianshou forms them (the mask None where ``masked`` is
    False): in one numba pass over the batch where the arrays allow (bool flags, integer
    indices, Tianshou's own ``value_mask``), else by :func:`_end_flags` and ``value_mask``."""
    term, trunc, slots = batch.terminated, batch.truncated, getattr(buffer, "terminated", None)
    if _cpu.available() and all(isinstance(x, np.ndarray) and x.dtype == np.bool_ and x.ndim == 1
                                for x in (term, trunc, slots)) \
            and isinstance(indices, np.ndarray) and indices.dtype.kind == "i" and indices.shape == term.shape \
            and trunc.shape == term.shape and (not masked or _stock_value_mask()):
        table = _unfinished_table(np.asarray(buffer.unfinished_index()), slots.shape[0])
        flags = None if table is None else _cpu.flat_flags_run(indices, term, trunc, slots, table)
        if flags is not None:
            return flags[0], flags[1] if masked else None
    return _end_flags(batch, buffer, indices), np.asarray(_value_mask(buffer, indices)) if masked else None


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
    gamma, gae_lambda = _coefficient(gamma, "gamma"), _coefficient(gae_lambda, "gae_lambda")
    if v_s_ is None and not np.isclose(gae_lambda, 1.0):
        raise ValueError(f"without v_s_ the returns are Monte Carlo: gae_lambda must be 1, got {gae_lambda}")
    end_flag, mask = _flags(batch, buffer, indices, masked=v_s_ is not None)
    if _on_device(v_s_, v_s) or not _cpu.available():
        return _episodic_return_tensors(batch.rew, end_flag, mask, v_s_, v_s, gamma, gae_lambda)
    rew = _host(batch.rew, "batch.rew")
    # Tianshou's next values: zeros without v_s_, else v_s_ times the mask (the kernel multiplies)
    v_s_a = np.broadcast_to(np.float64(0.0), rew.shape) if v_s_ is None else _host(v_s_, "v_s_")
    if mask is not None and (v_s is None or mask.dtype != np.bool_):
        v_s_a, mask = v_s_a * mask, None
    v_s_b = np.roll(v_s_a, 1) if v_s is None else _host(v_s, "v_s")
    n = _check_lengths(rew=rew, v_s_=v_s_a, v_s=v_s_b, end_flag=end_flag)
    if mask is not None:
        _check_lengths(rew=rew, value_mask=mask.reshape(-1))
    advantages, returns = _cpu.gae_flat_run(rew, v_s_b, v_s_a, None if mask is None else mask.reshape(-1), end_flag,
                                            gamma, gae_lambda, threads=_host_threads(n))
    return returns, advantages


def _episodic_return_tensors(rew, end_flag, mask, v_s_, v_s, gamma, gae_lambda):
    """:func:`compute_episodic_return` through ``rl_triton.gae`` on tensors: on the values'
    device (copied back to the host), or on the host where numba is missing."""
    if v_s_ is None:
        v_s_ = np.zeros_like(rew, dtype=np.float64)
    elif isinstance(v_s_, torch.Tensor):
        v_s_ = v_s_.detach().flatten() * torch.from_numpy(mask).to(v_s_.device)
    else:
        v_s_ = np.asarray(v_s_).flatten() * mask
    if v_s is None:
        v_s = torch.roll(v_s_, 1) if isinstance(v_s_, torch.Tensor) else np.roll(v_s_, 1)
    advantages, returns = _advantages(v_s, v_s_, rew, end_flag, gamma, gae_lambda)
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
