"""Packed (ragged) sequences: one token stream cut into sequences by FlashAttention-style
``cu_seqlens`` (offsets ``[0, n_0, n_0 + n_1, ..., N]``, as ``flash_attn_varlen_func`` takes
them), every sequence its own row with its own window end (docs/semantics.md, section 14).

A packed call is the padded call of the same sequences: the per-step inputs (``[N, ...]``,
tokens along dim 0) are scattered into a ``[B, L, ...]`` batch, each sequence aligned to the
edge where its scan starts (the end of the row for reverse scans, the start for forward ones),
so that the padding lies where the scan ends and is never read by a token of the sequence; the
estimator runs on that batch (any backend, plans included), and the outputs are gathered back
to ``[N, ...]``. Per-sequence inputs (``bootstrap_value``, ``last_done``, ``initial``) are
``[B]`` and pass through. No step synchronises with the GPU when ``max_seqlen`` is given.
"""

from __future__ import annotations

from numbers import Integral

import torch

from . import inputs

PER_SEQUENCE = frozenset(("bootstrap_value", "last_done", "initial"))


class Sequences:
    """Where each token of a packed stream of ``n_tokens`` lies in the padded ``[B, L]`` batch."""

    def __init__(self, cu_seqlens, max_seqlen, n_tokens: int, device: torch.device, align_end: bool,
                 tokens_of: str = "the inputs"):
        if isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
                or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
            raise TypeError("cu_seqlens must be a 1-D int32 or int64 tensor of B + 1 offsets "
                            f"[0, ..., N], got {_describe(cu_seqlens)}")
        if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, Integral)
                                       or max_seqlen < 0):
            raise TypeError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        self.B = cu.numel() - 1
        lengths = cu[1:] - cu[:-1]
        if max_seqlen is None or cu_seqlens.device.type == "cpu" or inputs.value_checks_on(cu_seqlens.device):
            # reads the offsets: free on the host (always checked there), one synchronisation for
            # CUDA offsets (checked where max_seqlen must be found, or value checks are on)
            max_seqlen = _checked(cu_seqlens.tolist(), max_seqlen, n_tokens, tokens_of)
        self.L = int(max_seqlen)
        # token j of sequence b lies at b*L + (j - cu[b]) (+ L - length_b where aligned to the end):
        # j plus its sequence's offset, one repeat of B offsets and one add over the tokens
        offset = torch.arange(self.B, device=device) * self.L - cu[:-1]
        if align_end:
            offset += self.L - lengths
        self.flat = torch.repeat_interleave(offset, lengths, output_size=n_tokens)
        self.flat += torch.arange(n_tokens, device=device)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` -> ``[B, L, ...]``, zeros where no token lies."""
        batch = x.new_zeros((self.B * self.L, *x.shape[1:]))
        batch.index_copy_(0, self.flat, x)
        return batch.view(self.B, self.L, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, L, ...]`` -> ``[N, ...]``."""
        return y.reshape(self.B * self.L, *y.shape[2:]).index_select(0, self.flat)


def _checked(offsets: list, max_seqlen, n_tokens: int, tokens_of: str) -> int:
    """``max_seqlen``, or the longest sequence where it is None, after checking the offsets of
    ``n_tokens`` tokens (``tokens_of`` says where they were counted)."""
    shown = offsets if len(offsets) <= 8 else offsets[:8] + ["..."]
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never fall, got {shown}")
    if offsets[-1] != n_tokens:
        raise ValueError(f"cu_seqlens must end at the number of tokens, {n_tokens}, got {shown}: packed calls "
                         f"take the tokens along dim 0 ([total_tokens] inputs), and {tokens_of}")
    longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"max_seqlen is {max_seqlen} but a sequence in cu_seqlens has {longest} tokens")
    return longest if max_seqlen is None else max_seqlen


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.ndim}-D {x.dtype} tensor of {x.numel()} elements"
    return type(x).__name__


def run(fn, args: dict, *, reverse: bool, n_out: int = 1):
    """``fn`` (a public function) on packed arguments ``args`` (its parameters by name, with
    ``cu_seqlens`` and ``max_seqlen``): the padded call, its outputs gathered back."""
    args = dict(args)
    cu_seqlens, max_seqlen, out = args.pop("cu_seqlens"), args.pop("max_seqlen"), args.pop("out")
    if cu_seqlens is None:
        raise ValueError("max_seqlen goes with cu_seqlens (packed sequences); pass both or neither")
    time_dim = args.pop("time_dim")
    ref_name = next(iter(args))
    ref = inputs.check_tensor(args[ref_name], ref_name)
    if ref.ndim < 1 or isinstance(time_dim, bool) or time_dim not in (0, -1, -ref.ndim):
        raise ValueError(f"with cu_seqlens the tokens lie along dim 0 of {ref_name} ([N] or [N, ...]); "
                         f"time_dim must be left at -1 or be 0, got {time_dim!r}")
    n = ref.shape[0]
    if out is not None:
        given = (out,) if n_out == 1 else tuple(out) if isinstance(out, (tuple, list)) else ()
        if len(given) != n_out:
            raise TypeError(f"out must be a tuple of {n_out} tensors")
        for i, o in enumerate(given):
            if not isinstance(o, torch.Tensor) or (o.shape, o.dtype, o.device) != (ref.shape, ref.dtype, ref.device):
                raise ValueError(f"out{'' if n_out == 1 else f'[{i}]'} must be a {ref.dtype} tensor of shape "
                                 f"{tuple(ref.shape)} on {ref.device}, like {ref_name}")
    seqs = Sequences(cu_seqlens, max_seqlen, n, ref.device, align_end=reverse,
                     tokens_of=f"{ref_name} has shape {tuple(ref.shape)}")
    def padded(name, x):
        if not isinstance(x, torch.Tensor):
            return x
        if name in PER_SEQUENCE:
            if x.ndim != 1 or x.shape[0] != seqs.B:
                raise ValueError(f"{name} must hold one value per sequence ([{seqs.B}]), got shape {tuple(x.shape)}")
            return x
        if x.ndim == 0:
            return x  # a 0-d coefficient (gamma, lmbda) holds for every token, packed or not
        if x.shape[0] != n:
            raise ValueError(f"{name} must be packed like {ref_name} (dim 0 of {n} tokens), got shape "
                             f"{tuple(x.shape)}")
        return seqs.pad(x)

    for name, x in args.items():
        # a dict argument (gae's kl) holds per-step tensors too
        args[name] = {k: padded(f"{name}[{k!r}]", y) for k, y in x.items()} if isinstance(x, dict) else padded(name, x)
    results = fn(**args, time_dim=1)
    single = isinstance(results, torch.Tensor)
    results = tuple(seqs.unpad(y) for y in ((results,) if single else results))
    if out is not None:
        results = tuple(o.copy_(y) for o, y in zip(given, results))
    return results[0] if single else results
