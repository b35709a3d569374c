"""One declaration per fused algorithm: its named arguments with their kinds, its outputs and its
scan direction. Every backend reads the arguments by these names.

Argument kinds:

- ``f1`` / ``f2`` / ``f3``: float tensors ``[R]`` / ``[R, T]`` / ``[R, T, A]``, None when absent;
  ``f2`` coefficients may also be plain numbers;
- ``u1`` / ``u2``: flag tensors ``[R]`` / ``[R, T]`` of any dtype, true where nonzero, None when
  absent;
- ``s``: a float number; ``b``: a bool; ``n``: an int (a count, such as n-step's window);
- ``i``: a mode integer for the numba kernels, derived from which inputs are present
  (:meth:`Algorithm.bind` fills it; Triton reads the same from which inputs are None).

Every scan algorithm has an argument ``carry``, the scan value beyond the window edge where the scan
starts (0 when absent). It is the third argument (``CARRY``), so one Triton INIT loads it, except
in the masked algorithms, whose INIT reads it by name: there the mask, the bootstrap value and
then the carry come first (triton 3.6 misreads a tensor argument that follows an absent one in
those kernels; benchmarks/engine_ptx.py compiles every order in use), and in those entries with
``own_init``, whose carry stands after their tensors (``arrival_gae`` and the valid-step
algorithms). What it stands
for is each algorithm's own (``carry`` of its entry below); a sequence split along time across
ranks (rl_triton/core/sharded.py) hands it from chunk to chunk. The outputs are ``[R, T]`` float
tensors.

**Edge maps.** A kernel can also report, per row, the value it hands on at the other edge (where
the scan ends) and how that value moves with its carry: ``edge[i] = (handed, b)`` with
``handed = a + b*carry`` (``a`` alone where ``b`` is 0), so that run from carry 0 it gives the
map ``(a, b)``; two-state scans report ``(x, b1, y, b2, c)``, the map of the pair (the engine's
``combine_pair`` form) on (``bootstrap_value``, ``carry``). The handed value is the scan value
at the ending edge; where an entry's ``hands`` says otherwise, rl_triton/core/sharded.py forms
it from that.

**Windowed algorithms** (``window=True``, in ``WINDOWED``) are no scan: each output reads a
window of later steps directly (n-step returns). They have no carry, no direction and no edge
map; numba runs their loop of rl_triton/core/cpu.py through the same launch as the scans, Triton
their own kernel (rl_triton/core/kernels/nstep.py) instead of the scan engine.
"""

from __future__ import annotations

from collections import namedtuple
from typing import NamedTuple


class Arg(NamedTuple):
    name: str
    kind: str


# the episode flags every estimator takes: transition-aligned (terminated / done / truncated), or
# observation-aligned, the ``done`` slot holding episode starts and ``last_done`` the step after
# the window (docs/semantics.md, sections 2 and 4)
FLAGS = (Arg("terminated", "u2"), Arg("done", "u2"), Arg("truncated", "u2"), Arg("last_done", "u1"))

CARRY = 2  # the position of the carry argument

# how next values are read: explicit array, or values[t+1] with the bootstrap value at t = T-1;
# explicit with a bootstrap value: V-trace's vs[T] is bootstrap_value + carry (a chunk of a
# sharded sequence, whose next chunk starts at values[T]), not next_values[T-1] + carry
NV_EXPLICIT, NV_IMPLIED, NV_EXPLICIT_EDGE = 0, 1, 2
# how done is read: the done array; terminated | truncated; or observation-aligned (done[t] =
# episode_starts[t+1], last_done at t = T-1, every done a termination)
DONE_ARRAY, DONE_TERM_OR_TRUNC, DONE_OBS_ALIGNED = 0, 1, 2
# how Retrace's expected next value is read: given, or summed over next_pi * next_q
EV_GIVEN, EV_PAIRS = 0, 1
# KL shaping of the rewards inside GAE (docs/semantics.md, section 13.1): the two log-prob tensors,
# then the KL coefficient (a number) in the slot of the estimator chosen (the others None, so that
# Triton compiles each estimator apart, from which slot is present), the clamp of the estimate (a
# number, None: none), and the numba kernels' mode integer (kl_mode: KL_NONE, or the estimator's
# number, 1 + its index in KL_ESTIMATORS, plus KL_CLAMPED where a clamp is given). The numbers are
# "f2" coefficients, so that a float64 call reads them exactly; the numba kernels read them once.
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
KL = (Arg("log_probs", "f2"), Arg("ref_log_probs", "f2"), *(Arg(f"kl_{e}", "f2") for e in KL_ESTIMATORS),
      Arg("kl_clamp", "f2"), Arg("kl_mode", "i"))
KL_NONE, KL_CLAMPED = 0, 8
# how a token mask acts (docs/semantics.md, section 13), each its own algorithm: masked steps are
# skipped in time (verl), or their rewards and values read as 0 (TRL, OpenRLHF)
MASK_MODES = ("skip", "pad")


def _modes(kw: dict) -> dict:
    """The mode integers implied by which inputs are present."""
    if kw.get("last_done") is not None:
        done_mode = DONE_OBS_ALIGNED
    elif kw.get("done") is not None:
        done_mode = DONE_ARRAY
    else:
        done_mode = DONE_TERM_OR_TRUNC
    kl_mode = KL_NONE
    for k, estimator in enumerate(KL_ESTIMATORS):  # a plain loop: torch 2.6's dynamo traces no next() default
        if kw.get(f"kl_{estimator}") is not None:
            kl_mode = k + 1 + (KL_CLAMPED if kw.get("kl_clamp") is not None else 0)
            break
    return {
        "nv_mode": NV_IMPLIED if kw.get("next_values") is None else
        NV_EXPLICIT if kw.get("bootstrap_value") is None else NV_EXPLICIT_EDGE,
        "done_mode": done_mode,
        "ev_mode": EV_GIVEN if kw.get("next_expected_q") is not None else EV_PAIRS,
        "kl_mode": kl_mode,
    }


class Algorithm:
    """A fused algorithm: ``args`` in kernel order, ``outputs``, and ``reverse`` (the scan runs
    backwards in time; None: the ``reverse`` argument says). ``need_prev``: the Triton epilogue
    reads y one step earlier in scan order. ``pair``: the scan carries two values (the engine's
    two-state scan). ``own_init``: the Triton INIT reads the carry by name, which then need not
    stand at ``CARRY``. ``window``: not a scan (module docstring): no carry, ``reverse`` None."""

    def __init__(self, name: str, args, outputs, *, reverse, carry: str, need_prev: bool = False,
                 pair: bool = False, hands: str = "", own_init: bool = False, window: bool = False):
        self.name = name
        self.carry = carry  # what the carry stands for (docs)
        self.hands = hands  # what the kernel hands on at the ending edge, where not the scan value
        self.args = tuple(args)
        self.names = tuple(a.name for a in self.args)
        self.kinds = tuple(a.kind for a in self.args)
        self.outputs = tuple(outputs)
        self.reverse = reverse
        self.need_prev = need_prev
        self.pair = pair
        self.window = window
        self.Args = namedtuple(f"{name}_args", self.names, defaults=(None,) * len(self.names))
        # the position of each argument in the arguments and of each output in the outputs, by
        # name (Triton kernels index their argument tuples with these)
        self.at = namedtuple(f"{name}_at", self.names + self.outputs)(*range(len(self.names)),
                                                                       *range(len(self.outputs)))
        self.modes = tuple(n for n, k in zip(self.names, self.kinds) if k == "i")
        # float tensors read per step (the launch plan counts those present)
        self.streams = tuple(i for i, k in enumerate(self.kinds) if k in ("f2", "f3"))
        self.has_flags = "terminated" in self.names
        if window:
            if "carry" in self.names or reverse is not None:
                raise ValueError(f"{name}: a windowed algorithm has no carry and no direction")
        elif "mask" not in self.names and not own_init and self.names.index("carry") != CARRY:
            raise ValueError(f"{name}: the carry argument must stand at position {CARRY}")
        if self.has_flags:
            first = self.names.index("terminated")
            if self.args[first:first + len(FLAGS)] != FLAGS:
                raise ValueError(f"{name}: the flags must stand together in the order of FLAGS")

    def bind(self, **kw):
        """The arguments by name (absent ones None), the mode integers filled in."""
        if self.modes:
            modes = _modes(kw)
            kw.update((m, modes[m]) for m in self.modes)
        return self.Args(**kw)

    def __repr__(self):
        return f"Algorithm({self.name!r})"


def _f2(*names):
    return tuple(Arg(n, "f2") for n in names)


GAE = Algorithm(
    "gae",
    (*_f2("rewards", "values"), Arg("carry", "f1"), *_f2("next_values"), Arg("bootstrap_value", "f1"), *FLAGS,
     *_f2("gamma", "lmbda"), Arg("nv_mode", "i"), Arg("done_mode", "i"), *KL),
    ("advantages", "value_targets"), reverse=True, carry="A[T]")

TD_LAMBDA_RETURN = Algorithm(
    "td_lambda_return",
    (*_f2("rewards", "next_values"), Arg("carry", "f1"), *FLAGS, *_f2("gamma", "lmbda"), Arg("done_mode", "i")),
    ("returns",), reverse=True, carry="G'[T]")

DISCOUNTED_RETURN = Algorithm(
    "discounted_return",
    (*_f2("rewards", "next_values"), Arg("carry", "f1"), *FLAGS, *_f2("gamma"), Arg("done_mode", "i")),
    ("returns",), reverse=True, carry="R[T]")

VTRACE = Algorithm(
    "vtrace",
    (*_f2("rewards", "values"), Arg("carry", "f1"), *_f2("next_values"), Arg("bootstrap_value", "f1"),
     *_f2("log_pi", "log_mu"), *FLAGS,
     *_f2("gamma", "lmbda"), Arg("rho_bar", "s"), Arg("c_bar", "s"), Arg("rho_bar_pg", "s"), Arg("nv_mode", "i"),
     Arg("done_mode", "i")),
    ("vs", "pg_advantages"), reverse=True, need_prev=True,
    carry="(vs - v)[T]; vs_next[T-1] = V(s_T) + carry unless done[T-1]")

RETRACE = Algorithm(
    "retrace",
    (*_f2("rewards", "q_values"), Arg("carry", "f1"), *_f2("log_pi", "log_mu", "next_expected_q"),
     Arg("next_pi", "f3"), Arg("next_q", "f3"), *FLAGS, *_f2("gamma", "lmbda"), Arg("c_bar", "s"), Arg("ev_mode", "i"),
     Arg("done_mode", "i")),
    ("q_targets",), reverse=True, carry="c[T]*(Q_ret[T] - q[T]), read at T-1 with c[T] = 1 and q[T] = 0",
    hands="c[0]*(Q_ret[0] - q[0])")

# GAE over the unmasked steps of a response (skip): a masked step carries the next value and the
# advantage; a two-state scan (the next unmasked value, the advantage)
MASKED_GAE = Algorithm(
    "masked_gae",
    (*_f2("rewards", "values"), Arg("mask", "u2"), Arg("bootstrap_value", "f1"), Arg("carry", "f1"),
     *_f2("gamma", "lmbda"), *KL),
    ("advantages", "value_targets"), reverse=True, pair=True,
    carry="A[T]; bootstrap_value carries the first state, the value of the next unmasked step",
    hands="(V of the first unmasked step, A[0])")

# GAE with rewards and values read as 0 where the mask is 0 (pad)
PADDED_GAE = Algorithm(
    "padded_gae",
    (*_f2("rewards", "values"), Arg("mask", "u2"), Arg("bootstrap_value", "f1"), Arg("carry", "f1"),
     *_f2("gamma", "lmbda"), *KL),
    ("advantages", "value_targets"), reverse=True, carry="A[T]")

# V-trace's advantage vs - v on arrival-aligned rows (PufferLib's buffers): rewards[t] and done[t]
# arrive with observation t, so step t reads rewards[t+1], done[t+1] and values[t+1]; the ratio is
# given, not its logarithms; the last column has no step of its own (the scan passes the carry
# through it) and is stored only where write_last is nonzero (a number, 0 or 1). The carry comes
# after the tensors, and INIT reads it by name: triton 3.6 misreads a tensor after an absent carry
# here (benchmarks/engine_ptx.py compiles the forms in use)
ARRIVAL_GAE = Algorithm(
    "arrival_gae",
    (*_f2("rewards", "values"), Arg("done", "u2"), *_f2("ratio", "gamma", "lmbda"), Arg("carry", "f1"),
     Arg("rho_bar", "s"), Arg("c_bar", "s"), Arg("write_last", "s")),
    ("advantages",), reverse=True, carry="A[T-1], the last observation's advantage", own_init=True)

ELIGIBILITY_TRACE = Algorithm(
    "eligibility_trace",
    (*_f2("x"), Arg("done", "u2"), Arg("carry", "f1"), *_f2("gamma", "lmbda")),
    ("traces",), reverse=False, carry="e[-1]", hands="(1 - done[T-1])*e[T-1]")

# Sample Factory's valid steps (docs/semantics.md, section 6.11): an invalid step passes the
# accumulated value on with factor 1 and has no TD error of its own; a valid step reads V(s_{t+1})
# only where next_valid; trace is the factor gamma*lmbda of a valid step. Every done a
# termination. The carry stands last and INIT reads it by name: it is absent in the GAE calls, and
# triton 3.6 misreads a tensor that follows an absent one in such kernels
VALID_GAE = Algorithm(
    "valid_gae",
    (*_f2("rewards", "values", "next_values"), Arg("valid", "u2"), Arg("next_valid", "u2"), Arg("done", "u2"),
     *_f2("gamma", "trace"), Arg("carry", "f1")),
    ("advantages",), reverse=True, carry="A[T]", own_init=True)

VALID_DISCOUNTED_RETURN = Algorithm(
    "valid_discounted_return",
    (*_f2("rewards"), Arg("valid", "u2"), Arg("done", "u2"), *_f2("gamma"), Arg("carry", "f1")),
    ("returns",), reverse=True, carry="S[T]", own_init=True)

AFFINE_SCAN = Algorithm(
    "affine_scan",
    (*_f2("alpha", "beta"), Arg("carry", "f1"), Arg("reverse", "b")),
    ("y",), reverse=None, carry="y beyond the edge where the scan starts")

ALGORITHMS = {a.name: a for a in (GAE, TD_LAMBDA_RETURN, DISCOUNTED_RETURN, VTRACE, RETRACE, ELIGIBILITY_TRACE,
                                  AFFINE_SCAN, MASKED_GAE, PADDED_GAE, ARRIVAL_GAE, VALID_GAE,
                                  VALID_DISCOUNTED_RETURN)}

# n-step returns (docs/semantics.md, section 6.10): each step's window of up to ``n`` rewards,
# read directly
NSTEP_RETURN = Algorithm(
    "nstep_return",
    (*_f2("rewards", "next_values"), *FLAGS, *_f2("gamma"), Arg("n", "n"), Arg("done_mode", "i")),
    ("returns",), reverse=None, carry="", window=True)

WINDOWED = {a.name: a for a in (NSTEP_RETURN,)}
