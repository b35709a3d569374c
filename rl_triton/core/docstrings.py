"""The Args sections of the public core functions' docstrings, built from their signatures.

The estimators and ``affine_scan`` share most of their arguments (the flags, the next-value
forms, ``gamma``, ``time_dim``, ``backend``, ``out``, ``cu_seqlens``, ``group``, ...). Each
shared argument's text is written once, in ``ARGS``; :func:`documented` appends to a function's
docstring an ``Args:`` section (Google style) with one entry per parameter, in signature order,
taking the text given to the decorator or else ``ARGS``'s. A parameter without a text, or a text
for no parameter, raises at import, so the docstrings cannot fall behind the signatures.
Families of functions with arguments of their own (a framework's drop-ins) pass their table to
the decorator. ``help()`` shows the built docstring; the API reference (docs/api.md) reads it
through the Griffe extension docs/_griffe/plain_formulas.py. What each argument means:
docs/semantics.md.
"""

from __future__ import annotations

import inspect
import textwrap

FLAG = ("Bool, integer or float (true where nonzero), broadcastable to the rewards' shape; with value checks "
         "on (CPU tensors by default, semantics section 8) it must hold only 0 and 1.")

ARGS = {
    "rewards": (
        "``r[t]``, the reward of step t (the transition ``s_t -> s_{t+1}``): a float16, bfloat16, float32 or "
        "float64 tensor of shape ``[*B, T]`` with time at ``time_dim``. The other float tensors have its dtype "
        "(tensor ``gamma``/``lmbda``: any float dtype), every tensor its device, and the outputs its shape, "
        "dtype and device."),
    "values": "``V(s_t)``: a tensor of the rewards' dtype and device, broadcastable to their shape.",
    "next_values": (
        "``V(s_{t+1})`` of each step's true successor (at a truncation the final observation's value, not the "
        "next episode's first): the rewards' dtype, broadcastable to their shape. None: the implied form, "
        "``values[t+1]`` and ``bootstrap_value`` after the last step (semantics section 3), which a call where "
        "a step can be truncated (``truncated`` given, or ``done`` with ``terminated``) rejects with a "
        "ValueError. Not together with ``bootstrap_value``."),
    "bootstrap_value": (
        "``V(s_T)``, the value after the window's last step in the implied form: per row, the rewards' shape "
        "without the time dim (or broadcastable to it), the rewards' dtype. None: 0. Not together with "
        "``next_values``."),
    "terminated": (
        "``terminated[t]``: ``s_{t+1}`` is terminal, so its value counts as 0 and the trace stops after step "
        "t. With ``done``: the dones that are terminations (None: every done); with value checks on, one set "
        "where ``done`` is not is a ValueError. " + FLAG),
    "truncated": (
        "``truncated[t]``: the episode was cut after step t (a time limit); the trace stops, and the step "
        "still bootstraps from ``next_values[t]``, which is then required. Gymnasium style, with "
        "``terminated``; not together with ``done``. " + FLAG),
    "done": (
        "``done[t] = terminated[t] or truncated[t]``: every trace stops after step t (TorchRL style, with "
        "optional ``terminated``; not together with ``truncated``). None: ``terminated | truncated``, each "
        "missing one all false. " + FLAG),
    "episode_starts": (
        "observation-aligned flags (SB3's ``episode_starts``, CleanRL's ``dones``): ``episode_starts[t]`` marks "
        "observation t as an episode's first, so ``done[t] = episode_starts[t+1]`` and every end is a "
        "termination (semantics section 4); read in place, without a shifted copy. The rewards' shape "
        "(broadcastable), any flag dtype. Goes with ``last_done``, instead of ``terminated``/``truncated``/"
        "``done``."),
    "last_done": (
        "with ``episode_starts``: whether the window's last step ends its episode (SB3's ``dones``, CleanRL's "
        "``next_done``), one flag per row: the rewards' shape without the time dim (broadcastable)."),
    "gamma": (
        "the discount, in [0, 1]: a Python number, or a float tensor of any float dtype broadcastable to the "
        "rewards' shape (0-d, per row or per step: semantics section 7). A number is applied in float32 for "
        "float16/bfloat16/float32 data and exactly for float64 data."),
    "lmbda": "the trace parameter lambda, in [0, 1]: a number or a tensor, as ``gamma``.",
    "time_dim": (
        "the time dimension of the per-step tensors, an int in ``[-ndim, ndim)``: ``-1`` for batch-major "
        "``[*B, T]``, ``0`` for time-major ``[T, N]`` (SB3, CleanRL), ``-2`` for TorchRL's ``[*B, T, 1]``."),
    "backend": (
        "``\"auto\"``, ``\"triton\"``, ``\"cpu\"`` (numba) or ``\"torch\"``; None reads the environment "
        "variable ``RL_TRITON_BACKEND`` (default ``\"auto\"``: Triton for CUDA tensors, numba for CPU tensors "
        "where it is installed, else torch). Backends differ only in rounding (semantics section 9). An "
        "unknown name, or a backend that cannot run the tensors, is a ValueError."),
    "out": (
        "a tensor of the output's shape and dtype, on its device, that the result is written to and returned "
        "in; it may alias an input (the result is the same). None: a new tensor. Not where an input requires "
        "grad (ValueError)."),
    "cu_seqlens": (
        "packed sequences (semantics section 14): a 1-D int32 or int64 tensor of offsets ``[0, n_0, n_0+n_1, "
        "..., N]`` (FlashAttention's). The per-step inputs are then token streams along dim 0 with "
        "``time_dim`` at its default, each sequence its own row whose window ends at its last token, and the "
        "per-sequence inputs (``bootstrap_value``, ``last_done``, ``initial``) are ``[B]``."),
    "max_seqlen": (
        "with ``cu_seqlens``: an int at least the longest sequence's length. None: found from the offsets, "
        "which for CUDA offsets synchronises once."),
    "group": (
        "a ``torch.distributed`` ProcessGroup: the window's time axis is split across its ranks in rank order, "
        "each passing its contiguous chunk of every per-step input (per-row inputs whole) and getting its "
        "steps of the result of the call on the whole window (semantics section 17). Or an "
        "``rl_triton.Shards`` layout over a group: each rank passes its pieces of the window, concatenated "
        "along time in the layout's order (``Shards.zigzag``: Megatron-LM's pieces k and 2W-1-k), and gets "
        "those steps. No autograd."),
    "log_pi": ("the target policy's log-probability of the taken action: the rewards' dtype, broadcastable to "
               "their shape."),
    "log_mu": "the behaviour policy's log-probability of the taken action, as ``log_pi``.",
    "c_bar": (
        "the clip of the trace ratio, ``c = lmbda*min(c_bar, ratio)``: a Python number > 0; ``float(\"inf\")`` "
        "means no clipping."),
    "x": (
        "the per-step input: a float16, bfloat16, float32 or float64 tensor with time at ``time_dim``, which "
        "may have feature dims after the time dim (``[*B, T, *F]``). The outputs have its shape, dtype and "
        "device."),
    "initial": (
        "the value before the first step, ``y[-1]``, per row: ``x``'s shape without the time dim "
        "(broadcastable), its dtype. None: 0. To continue across windows, pass the previous window's last "
        "output, zeroed where its last step was done."),
}

# texts that a few functions share
OUT_PAIR = ("a tuple of two tensors of the outputs' shape and dtype, on their device, that the two results are "
            "written to and returned in; either may alias an input (the results are the same). None: new "
            "tensors. Not where an input requires grad (ValueError).")
FORWARD_DONE = (
    "``done[t]``: the episode ends after step t, so step t+1 starts afresh. Bool, integer or float (true where "
    "nonzero), broadcastable to ``x``'s shape or, with fewer dims, covering ``x``'s dims up to the time dim "
    "(broadcast over the feature dims); with value checks on it must hold only 0 and 1. None: no episode ends.")
GAMMA_X = ("the discount, in [0, 1]: a Python number, or a float tensor of any float dtype broadcastable to ``x``'s "
           "shape (0-d, per row or per step). A number is applied in float32 for float16/bfloat16/float32 data "
           "and exactly for float64 data.")


def documented(*tables: dict, **texts):
    """Append to the function's docstring an ``Args:`` section of its parameters in signature
    order: each parameter's text is the one given here by name, else the first of ``tables``
    (dicts of texts by parameter name, for a family of functions such as a framework's) that has
    one, else ``ARGS``'s."""

    def build(fn):
        params = inspect.signature(fn).parameters
        unknown = sorted(set(texts) - set(params))
        if unknown:
            raise TypeError(f"{fn.__qualname__} has no parameter {', '.join(unknown)}")
        lines = ["Args:"]
        for name, param in params.items():
            if name.startswith("_"):  # a protocol argument of the library's own (sharded.py's _chunk)
                continue
            text = next((t[name] for t in (texts, *tables, ARGS) if name in t), None)
            if text is None:
                raise TypeError(f"{fn.__qualname__}: no text for its argument {name}")
            stars = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "")
            lines += textwrap.wrap(f"{stars}{name}: {text}", 100, initial_indent="    ", subsequent_indent="        ",
                                   break_long_words=False, break_on_hyphens=False)
        fn.__doc__ = inspect.cleandoc(fn.__doc__ or "") + "\n\n" + "\n".join(lines) + "\n"
        return fn

    return build
