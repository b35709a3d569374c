"""Argument checking and the mapping between caller layouts and ``[rows, T]`` views.

Every check here runs before any computation, raises ``TypeError``/``ValueError`` naming the
argument, and never synchronises with a device unless value checks are switched on.
"""

from __future__ import annotations

import math
import os
from numbers import Integral, Real

import torch

FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
FLAG_DTYPES = frozenset((
    torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def env(name: str) -> str | None:
    """``os.environ.get(name)``, read on every call: users switch these variables at run time.
    Inside a torch.compile trace dynamo reads it at trace time and guards on it."""
    return os.environ.get(name)


def env_state() -> tuple:
    """The values of the environment variables the library reads, for a call's signature."""
    return os.environ.get("RL_TRITON_BACKEND"), os.environ.get("RL_TRITON_CHECK_VALUES"), \
        os.environ.get("RL_TRITON_GRAPHS")


def value_checks_on(device: torch.device) -> bool:
    """Data-reading checks: on for CPU tensors, opt-in for accelerators (they would sync);
    never inside a torch.compile trace (a data-dependent branch would break the graph)."""
    mode = _CHECK_MODES.get((env("RL_TRITON_CHECK_VALUES") or "auto").strip().lower())
    on = device.type == "cpu" if mode is None else mode
    return on and not torch.compiler.is_compiling()


_CHECK_MODES = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False,
                "no": False}


def check_tensor(x, name: str, *, dtypes=FLOAT_DTYPES, kind: str = "a floating-point") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {kind} tensor, got dtype {x.dtype}")
    return x


def check_unit_interval(x, name: str):
    """gamma / lmbda: a number or float tensor in [0, 1]."""
    if type(x) is float and 0.0 <= x <= 1.0:
        return x
    if isinstance(x, torch.Tensor):
        check_tensor(x, name)
        if value_checks_on(x.device) and x.numel():
            # one element (TorchRL keeps gamma as a 0-d buffer): a number compare; more: one pass
            # for both ends (NaN propagates into both and fails the compare)
            if x.numel() == 1:
                inside = 0.0 <= float(x.detach()) <= 1.0
            else:
                low, high = torch.aminmax(x.detach())
                inside = 0.0 <= float(low) and float(high) <= 1.0
            if not inside:
                raise ValueError(f"{name} must lie in [0, 1]; the tensor has values outside")
        return x
    if isinstance(x, bool) or not isinstance(x, Real):
        raise TypeError(f"{name} must be a float or a tensor, got {type(x).__name__}")
    if not 0.0 <= float(x) <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {x}")
    return float(x)


def check_threshold(x, name: str) -> float:
    """Clip thresholds (rho_bar, c_bar): numbers > 0, inf allowed."""
    if type(x) is float and x > 0:
        return x
    if isinstance(x, bool) or not isinstance(x, Real):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    if math.isnan(float(x)) or float(x) <= 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return float(x)


def broadcasts(x: torch.Tensor, shape) -> bool:
    """Whether ``x`` broadcasts to ``shape`` (torch's rule, trailing dims aligned)."""
    have, want = tuple(x.shape), tuple(shape)
    n = len(have)
    return have == want or (n <= len(want) and all(h in (1, w) for h, w in zip(have, want[len(want) - n:])))


class Rows:
    """The layout of one call: a reference shape with time at ``tdim``, seen as ``[R, T]`` rows.

    Per-step inputs broadcast to ``shape``; per-row inputs (bootstrap values, initial states)
    broadcast to ``shape`` without the time dim.
    """

    def __init__(self, ref: torch.Tensor, ref_name: str, time_dim, dtype: torch.dtype):
        if isinstance(time_dim, bool) or not isinstance(time_dim, Integral):
            raise TypeError(f"time_dim must be an int, got {type(time_dim).__name__}")
        time_dim = int(time_dim)
        if ref.ndim == 0:
            raise ValueError(f"{ref_name} must have a time dimension, got a 0-d tensor")
        if not -ref.ndim <= time_dim < ref.ndim:
            raise ValueError(f"time_dim={time_dim} is out of range for {ref_name} of shape {tuple(ref.shape)}")
        self.ref = ref
        self.ref_name = ref_name
        self.dtype = dtype
        self.device = ref.device
        self.shape = shape = ref.shape
        self.tdim = tdim = time_dim % ref.ndim
        self.T = shape[tdim]
        self.row_shape = shape[:tdim] + shape[tdim + 1:]
        self.R = self.row_shape[0] if len(self.row_shape) == 1 else math.prod(self.row_shape)

    def _same_device(self, x: torch.Tensor, name: str):
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but {self.ref_name} is on {self.device}")

    def value(self, x, name: str, *, shape=None, any_float: bool = False) -> torch.Tensor:
        """A float input of this call: same dtype (any float dtype with ``any_float``) and device,
        broadcastable to ``shape``."""
        if type(x) is torch.Tensor and x.dtype == self.dtype and x.shape == (self.shape if shape is None else shape) \
                and x.device == self.device and x.layout == torch.strided:
            return x
        check_tensor(x, name)
        self._same_device(x, name)
        if x.dtype != self.dtype and not any_float:
            raise TypeError(f"{name} has dtype {x.dtype} but {self.ref_name} has {self.dtype}; pass one float dtype")
        self._check_shape(x, name, shape)
        return x

    def flag(self, x, name: str, *, shape=None) -> torch.Tensor | None:
        """A flag input: any bool/int/float dtype, broadcastable to ``shape`` (default: per step)."""
        if x is None:
            return None
        if type(x) is torch.Tensor and x.shape == (self.shape if shape is None else shape) and x.dtype in FLAG_DTYPES \
                and x.device == self.device and x.layout == torch.strided:
            return x
        check_tensor(x, name, dtypes=FLAG_DTYPES, kind="a bool, integer or float")
        self._same_device(x, name)
        self._check_shape(x, name, shape)
        return x

    def coefficient(self, x, name: str):
        x = check_unit_interval(x, name)
        if isinstance(x, torch.Tensor):
            self._same_device(x, name)
            self.check_broadcast(x, name, self.shape)
        return x

    def _check_shape(self, x: torch.Tensor, name: str, shape):
        """``x`` broadcasts to ``shape`` (default: per step). A per-row input that fits the rows
        of the same data read time-major (time at dim 0, where this call has it last) gets a
        hint in the error: the usual cause is ``[T, N]`` data passed with the default
        ``time_dim=-1``."""
        shape = self.shape if shape is None else shape
        if broadcasts(x, shape):
            return
        hint = ""
        if tuple(shape) == tuple(self.row_shape) and len(self.shape) >= 2 and self.tdim == len(self.shape) - 1 \
                and broadcasts(x, self.shape[1:]):
            hint = " (time-major data? pass time_dim=0)"
        raise ValueError(f"{name} has shape {tuple(x.shape)}, which does not broadcast to {tuple(shape)}{hint}")

    @staticmethod
    def check_broadcast(x: torch.Tensor, name: str, shape):
        if not broadcasts(x, shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, which does not broadcast to {tuple(shape)}")

    # -- views -------------------------------------------------------------------------------
    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, T]`` view (a copy only when the batch dims cannot be merged)."""
        if x.ndim == 2 and x.shape == self.shape:  # the common layouts, without view overhead
            return x if self.tdim == 1 else x.t()
        return x.expand(self.shape).movedim(self.tdim, -1).reshape(self.R, self.T)

    def rows_3d(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, T, A]`` for inputs with a trailing action dim."""
        x = x.expand(*self.shape, x.shape[-1])
        return x.movedim(self.tdim, -2).reshape(self.R, self.T, x.shape[-1])

    def per_row(self, x: torch.Tensor) -> torch.Tensor:
        """``[R]`` view of a per-row input (bootstrap value, initial state)."""
        if x.ndim == 1 and x.shape == self.row_shape:
            return x
        return x.expand(self.row_shape).reshape(self.R)

    def from_rows(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rows` for a freshly computed ``[R, T]`` tensor."""
        moved = self.row_shape + (self.T,)
        return y.reshape(moved).movedim(-1, self.tdim)

    def check_out(self, out, name: str) -> torch.Tensor:
        """A caller-provided output: the reference's full shape, dtype and device."""
        check_tensor(out, name)
        self._same_device(out, name)
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(
                f"{name} must have shape {tuple(self.shape)} and dtype {self.dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        if out.requires_grad:
            raise ValueError(f"{name} requires grad: out= is written in place; pass a tensor that does not")
        if has_internal_overlap(out):
            raise ValueError(f"{name} has elements that share memory (an expanded or stride-0 view); "
                             f"pass a tensor whose elements are distinct")
        return out

    def output(self, out: torch.Tensor | None = None):
        """An output in the caller's layout (``out`` when given) and a writable ``[R, T]`` view of
        it, or None when the layout has no such view."""
        if out is None:
            # empty_like keeps the strides of dense inputs and is contiguous otherwise
            out = torch.empty_like(self.ref)
        if out.ndim == 2 and out.shape == self.shape:
            return out, self.rows(out)
        try:
            view = out.movedim(self.tdim, -1).view(self.R, self.T)
        except RuntimeError:
            view = None
        return out, view

    def deliver(self, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A computed ``[R, T]`` tensor in the caller's shape, dtype and (when possible) layout."""
        if y.requires_grad:
            return self.from_rows(y).to(self.dtype)
        out, view = self.output(out)
        if view is not None:
            view.copy_(y)
        else:
            out.movedim(self.tdim, -1).copy_(y.reshape(self.row_shape + (self.T,)))
        return out


def has_internal_overlap(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` share memory: with its dims sorted by stride, each stride must
    step past everything the smaller strides reach."""
    reach = 0
    for stride, size in sorted((abs(st), sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may overlap in memory (both non-empty views of one storage whose
    byte ranges meet)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_lo, a_hi), (b_lo, b_hi) = byte_range(a), byte_range(b)
    return a_lo < b_hi and b_lo < a_hi


def byte_span(x: torch.Tensor) -> tuple[int, int]:
    """(lowest, one past the highest) byte offset from ``x.data_ptr()`` that ``x`` reaches."""
    lo = sum(st * (sz - 1) for st, sz in zip(x.stride(), x.shape) if st < 0 and sz > 0)
    hi = sum(st * (sz - 1) for st, sz in zip(x.stride(), x.shape) if st > 0 and sz > 0)
    return lo * x.element_size(), (hi + 1) * x.element_size()


def byte_range(x: torch.Tensor) -> tuple[int, int]:
    """The addresses ``x`` reaches: (lowest, one past the highest)."""
    lo, hi = byte_span(x)
    return x.data_ptr() + lo, x.data_ptr() + hi


def align_leading(x: torch.Tensor | None, ref_ndim: int, tdim: int) -> torch.Tensor | None:
    """Right-pad a flag tensor that covers ref's leading dims (time included) with singleton dims."""
    if x is None or x.ndim >= ref_ndim or x.ndim <= tdim:
        return x
    return x.reshape(x.shape + (1,) * (ref_ndim - x.ndim))
