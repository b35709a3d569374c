"""The seven estimators: argument handling, then either a fused backend kernel or the
composed path (coefficients as torch ops, the differentiable scan, an epilogue).

The composed path serves ``backend="torch"`` and every call where autograd needs gradients;
the fused paths (numba on CPU, Triton on GPU) read the raw inputs once and write the outputs.
Argument handling (validation, layouts, backend choice, the launch) is
rl_triton/core/call.py's; semantics: docs/semantics.md.
"""

from __future__ import annotations

import functools
import math
from numbers import Real
from typing import NamedTuple

import torch

from . import coefficients as C
from . import inputs, launch, routes, scan, sharded, spec
from .call import TRUNCATION_HELP, Call, launch_bound
from .plans import Bound, Reduce
from .docstrings import FLAG, FORWARD_DONE, GAMMA_X, OUT_PAIR, documented
from . import whiten as whitening
from .whiten import WHITEN_OPTIONS, check_whiten_options, masked_whiten


@routes.public(sharded.GAE, outputs=2)
@documented(
    mask=("a token mask (LLM responses; semantics section 13): nonzero marks a step that counts. Any flag dtype, "
          "broadcastable to the rewards' shape; with value checks on it must hold only 0 and 1. Not together with "
          "the episode flags or ``next_values`` (ValueError): the response ends at the window end, which "
          "bootstraps from ``bootstrap_value`` (None: 0)."),
    mask_mode=("how ``mask`` is read: ``\"skip\"`` (verl) skips masked steps in time, or ``\"pad\"`` (TRL, "
               "OpenRLHF) reads rewards and values as 0 there (semantics section 13). ``\"pad\"`` needs a mask."),
    whiten=("False; True (verl's convention, :func:`rl_triton.masked_whiten`'s defaults); or a dict of "
            ":func:`rl_triton.masked_whiten` keywords (``unbiased``, ``shift_mean``, ``scale``, ``eps``, "
            "``eps_mode``, ``group``). The advantages are then whitened in place after the value targets are "
            "formed: over the mask's tokens, or without a mask over every element (rsl_rl, skrl and rl_games "
            "normalise so: ``dict(eps_mode=\"std\")``, ``(A - mean) / (std + 1e-8)``). With ``group=`` the "
            "statistics span the group's ranks unless the dict names another group. Not where autograd needs "
            "gradients (ValueError); with ``cu_seqlens`` it needs a mask."),
    kl=("KL shaping of the rewards inside the scan (semantics section 13.1): None, or a dict with the keys "
        "``log_probs`` (log pi(a_t|s_t) of the policy that sampled the tokens) and ``ref_log_probs`` (the "
        "reference policy's), float tensors of any float dtype broadcastable to the rewards' shape, on their "
        "device; ``coef``, the KL coefficient, a finite Python number; ``estimator`` (default ``\"k1\"``): "
        "``\"k1\"`` d, ``\"k2\"`` d**2/2, ``\"k3\"`` min(exp(-d) + d - 1, 10) (d clipped to [-20, 20] "
        "first) or ``\"abs\"`` \\|d\\|, with d = log_probs - ref_log_probs; ``clamp`` (default None), a "
        "number > 0 that clips the estimate to [-clamp, clamp] (OpenRLHF: 10). Each step's reward is then "
        "``r[t] - coef*kl[t]``, formed in the compute dtype; masked tokens read no reward, shaped or not. "
        "TypeError/ValueError naming the key for a bad entry."),
    out=OUT_PAIR,
)
def gae(rewards, values, *, next_values=None, bootstrap_value=None, terminated=None, truncated=None,
        done=None, gamma=0.99, lmbda=0.95, time_dim=-1, backend=None, out=None, episode_starts=None,
        last_done=None, mask=None, mask_mode="skip", whiten=False, kl=None, cu_seqlens=None, max_seqlen=None,
        group=None, _chunk=None):
    """Generalized advantage estimation.

    delta[t] = r[t] + gamma*(1-terminated[t])*V(s_{t+1}) - V(s_t)
    A[t] = delta[t] + gamma*lmbda*(1-done[t])*A[t+1],  A[T] = 0

    With a token ``mask`` (LLM responses; docs/semantics.md, section 13): ``mask_mode="skip"``
    (verl) skips masked steps in time: nv[t] = V of the next unmasked step (bootstrap_value, or
    0, past the last), A[t] = m[t]*(r[t] + gamma*nv[t] - V(s_t)) + (m[t]*gamma*lmbda + 1 - m[t])*A[t+1];
    ``mask_mode="pad"`` (TRL, OpenRLHF) reads rewards and values as 0 where the mask is 0.

    With ``kl`` (semantics section 13.1) every r[t] above is r[t] - coef*kl[t], the KL estimate of
    log_probs[t] - ref_log_probs[t] formed in the same pass.

    Returns ``(advantages, value_targets = advantages + values)`` (pad: the zeroed values).
    """
    c = Call(rewards, "rewards", time_dim, chunk=_chunk)
    c.value(values, "values")
    kl = _kl_shaping(c, kl)
    if mask is not None or mask_mode != "skip":
        return _masked_gae(c, rewards, values, mask, mask_mode, whiten, bootstrap_value, gamma, lmbda, backend, out,
                           kl, next_values=next_values, terminated=terminated, truncated=truncated, done=done,
                           episode_starts=episode_starts, last_done=last_done)
    options = _whiten_options(whiten)
    c.flags(terminated, truncated, done, episode_starts=episode_starts, last_done=last_done)
    c.next_value_form(next_values, bootstrap_value)
    g, l = c.coefficient(gamma, "gamma"), c.coefficient(lmbda, "lmbda")
    fused = c.start(backend, out, 2)
    if options is not None:
        _whitening_call(c)
    if c.empty:
        return _whitened(c.empty_outputs(), None, options, None)
    if fused:
        bound = c.bind(spec.GAE, rewards=c.view(rewards), values=c.view(values), next_values=c.view(next_values),
                       bootstrap_value=c.row_view(bootstrap_value), **c.fused_flags(), gamma=c.view(g),
                       lmbda=c.view(l), **_kl_args(c, kl))
        return bound if options is None else _launch_whitened(bound, None, options)
    v = c.float_rows(values)
    nterm, ndone = c.composed_flags()
    nv = c.composed_next_values(values, next_values, bootstrap_value)
    alpha, beta = C.gae(_shaped_rewards(c, rewards, kl), v, nv, nterm, ndone, c.float_rows(g), c.float_rows(l))
    adv = scan.call_scan(c, alpha, beta, c.float_row(None), True)
    return _whitened(c.results([adv, adv + v]), None, options, c.backend)


KL_KEYS = ("log_probs", "ref_log_probs", "coef", "estimator", "clamp")


class KLShaping(NamedTuple):
    """``gae``'s ``kl`` after its checks: the two log-prob tensors as given, the coefficient and
    the clamp as floats (clamp None: none), the estimator's name (spec.KL_ESTIMATORS)."""
    log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    coef: float
    estimator: str
    clamp: float | None


def _kl_shaping(c, kl) -> KLShaping | None:
    """``gae``'s ``kl`` checked against the call ``c`` (TypeError/ValueError naming the key)."""
    if kl is None:
        return None
    if not isinstance(kl, dict):
        raise TypeError(f"kl must be None or a dict with the keys {list(KL_KEYS)}, got {type(kl).__name__}")
    unknown = sorted(str(k) for k in kl if k not in KL_KEYS)
    if unknown:
        raise ValueError(f"kl takes the keys {list(KL_KEYS)}, got {unknown}")
    for key in ("log_probs", "ref_log_probs", "coef"):
        if key not in kl:
            raise ValueError(f"kl needs the key {key!r}")
    estimator = kl.get("estimator", "k1")
    if not isinstance(estimator, str) or estimator not in spec.KL_ESTIMATORS:
        raise ValueError(f"kl['estimator'] must be one of {list(spec.KL_ESTIMATORS)}, got {estimator!r}")
    coef = kl["coef"]
    if isinstance(coef, bool) or not isinstance(coef, Real):
        raise TypeError(f"kl['coef'] must be a number, got {type(coef).__name__}")
    if not math.isfinite(coef):
        raise ValueError(f"kl['coef'] must be finite, got {coef}")
    clamp = kl.get("clamp")
    if clamp is not None:
        clamp = inputs.check_threshold(clamp, "kl['clamp']")
        clamp = None if math.isinf(clamp) else clamp
    tensors = [c.rows.value(kl[key], f"kl['{key}']", any_float=True) for key in ("log_probs", "ref_log_probs")]
    c.grad_inputs.extend(tensors)  # autograd through the log-probs takes the composed path
    return KLShaping(*tensors, float(coef), estimator, clamp)


def _kl_args(c, kl: KLShaping | None) -> dict:
    """The fused kernels' KL group (spec.KL) for ``kl``: none without it."""
    if kl is None:
        return {}
    coef, clamp = kl.coef, kl.clamp
    if c.backend == "triton":
        # the numbers as broadcast tensors: Triton 3.6 cannot compile the builders' test of which
        # slot is present on a constant slot ``(None, value)``
        coef, clamp = _broadcast(c, coef), None if clamp is None else _broadcast(c, clamp)
    return {"log_probs": c.view(kl.log_probs), "ref_log_probs": c.view(kl.ref_log_probs),
            f"kl_{kl.estimator}": coef, "kl_clamp": clamp}


def _broadcast(c, value: float) -> torch.Tensor:
    """``value`` as an ``[R, T]`` view of one element in the compute dtype, on the call's device."""
    rows = c.rows
    return torch.full((1, 1), value, dtype=c.compute_dtype, device=rows.device).expand(rows.R, rows.T)


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str, clamp: float | None):
    """The per-token KL estimate of semantics section 13.1 as torch ops, in the inputs' dtype:
    d = log_probs - ref_log_probs; k1 d, k2 d**2/2, k3 min(exp(-d') + d' - 1, 10) with d' = d
    clipped to [-20, 20], abs |d|; then clipped to [-clamp, clamp] where clamp is given."""
    d = log_probs - ref_log_probs
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    elif estimator == "k3":
        e = (-d).clamp(-20.0, 20.0)
        kl = (torch.exp(e) - e - 1.0).clamp(max=10.0)
    else:
        kl = d.abs()
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def _shaped_rewards(c, rewards, kl: KLShaping | None):
    """The composed path's rewards ``[R, T]`` in the compute dtype, KL-shaped where ``kl`` is given."""
    r = c.float_rows(rewards)
    if kl is None:
        return r
    return r - kl.coef * kl_estimate(c.float_rows(kl.log_probs), c.float_rows(kl.ref_log_probs), kl.estimator,
                                     kl.clamp)


def _whiten_options(whiten) -> dict | None:
    """``gae``'s ``whiten`` as :func:`masked_whiten` keywords (None: no whitening); raises for a
    bad one before any work."""
    if whiten is False:
        return None
    if whiten is not True and not isinstance(whiten, dict):
        raise TypeError(f"whiten must be False, True or a dict of masked_whiten keywords, got {whiten!r}")
    if isinstance(whiten, dict) and not set(whiten) <= set(WHITEN_OPTIONS):
        raise ValueError(f"whiten takes the keywords {sorted(WHITEN_OPTIONS)}, got {sorted(whiten)}")
    options = {} if whiten is True else dict(whiten)
    check_whiten_options(**options)
    return options


_WHITEN_AUTOGRAD = ("whiten= writes the advantages in place and does not support autograd; call masked_whiten on "
                    "the advantages instead")


def _whitening_call(c):
    """Raise for a call that whitens its advantages where autograd needs gradients."""
    if c.needs_grad:
        raise ValueError(_WHITEN_AUTOGRAD)


def _launch_whitened(bound, mask, options):
    """``bound`` (a fused GAE call) with its advantages whitened in place over ``mask``'s
    elements (all with None; the kernel reads it as its argument ``mask``). On the Triton
    backend, for a call of this process alone: a bound call that ``launch_bound`` or the
    signature's plan launches in two launches where the outputs allow (dense advantages, no
    ``out=`` overlapping an input, rl_triton/core/whiten.py's ``scan_accepts``): the scan,
    which also reduces the advantages it writes tile by tile into partial moments, then the
    fold of those and the normalisation. On the numba backend without a mask, likewise a bound
    call that a plan serves: the scan, then one whitening kernel over the advantages
    (``flat_accepts``: where they are dense). Elsewhere the outputs of the scan's launch
    followed by :func:`masked_whiten`."""
    c, algo, _, _ = bound
    alone = options.get("group") is None and c.chunk is None and not torch.compiler.is_compiling()
    output, flag = algo.at.advantages, None if mask is None else "mask"
    if c.backend == "triton" and alone:

        def run(args):
            results = None if any(c.aliased) else whitening.scan_whitened(algo, args, c.rows, c.out, output, flag,
                                                                          options)
            return _whitened(c._launch(algo, args), mask, options, c.backend) if results is None else results

        return bound._replace(reduce=Reduce(output, flag, functools.partial(whitening.scan_accepts, output),
                                            whitening.whitener(output, options), run))
    if c.backend == "cpu" and alone and mask is None:
        # numba: the scan, then one whitening kernel over the advantages; the signature keeps a plan
        def run_cpu(args):
            return _whitened(c._launch(algo, args), None, options, c.backend)

        return bound._replace(reduce=Reduce(output, None, functools.partial(whitening.flat_accepts, output),
                                            whitening.flat_whitener(output, options), run_cpu))
    c.plannable = False  # the call is more than its launch
    return _whitened(launch_bound(bound, None), mask, options, c.backend)


def _whitened(results, mask, options, backend):
    """``(advantages, targets)`` with the advantages whitened in place over ``mask``'s elements
    (all with None) where ``options`` (masked_whiten keywords) is not None. An empty call still
    whitens where the options name a group: the statistics' collective needs every rank."""
    adv = results[0]
    if options is not None and (adv.numel() or options.get("group") is not None):
        masked_whiten(adv, None if mask is None else mask.expand(adv.shape), out=adv, backend=backend, **options)
    return results



def _masked_gae(c, rewards, values, mask, mask_mode, whiten, bootstrap_value, gamma, lmbda, backend, out, kl,
                **unsupported):
    if not isinstance(mask_mode, str) or mask_mode not in spec.MASK_MODES:
        raise ValueError(f"mask_mode must be one of {list(spec.MASK_MODES)}, got {mask_mode!r}")
    if mask is None:
        raise ValueError(f"mask_mode={mask_mode!r} needs a mask")
    options = _whiten_options(whiten)
    given = [name for name, x in unsupported.items() if x is not None]
    if given:
        raise ValueError(f"mask does not combine with {', '.join(given)}: a response mask marks the steps of one "
                         "sequence, which ends at the window end (bootstrap_value, or 0)")
    mask = c.mask(mask)
    c.per_row(bootstrap_value, "bootstrap_value")
    g, l = c.coefficient(gamma, "gamma"), c.coefficient(lmbda, "lmbda")
    fused = c.start(backend, out, 2)
    if c.empty:
        return _whitened(c.empty_outputs(), mask, options, None)
    if options is None:
        return _masked_gae_run(c, fused, rewards, values, mask, mask_mode, bootstrap_value, g, l, kl)
    _whitening_call(c)
    results = _masked_gae_run(c, fused, rewards, values, mask, mask_mode, bootstrap_value, g, l, kl)
    if type(results) is Bound:
        return _launch_whitened(results, mask, options)
    return _whitened(results, mask, options, c.backend)


def _masked_gae_run(c, fused, rewards, values, mask, mode, bootstrap_value, g, l, kl):
    if fused:
        return c.bind(spec.MASKED_GAE if mode == "skip" else spec.PADDED_GAE, rewards=c.view(rewards),
                      values=c.view(values), bootstrap_value=c.row_view(bootstrap_value), mask=c.view(mask),
                      gamma=c.view(g), lmbda=c.view(l), **_kl_args(c, kl))
    m = c.view(mask) != 0
    r, v, boot = _shaped_rewards(c, rewards, kl), c.float_rows(values), c.float_row(bootstrap_value)
    if mode == "pad":
        v = torch.where(m, v, 0.0)
        ones = torch.ones_like(v)
        alpha, beta = C.gae(torch.where(m, r, 0.0), v, torch.cat([v[:, 1:], boot[:, None]], 1), ones, ones,
                            c.float_rows(g), c.float_rows(l))
        adv = scan.call_scan(c, alpha, beta, c.float_row(None), True)
        return c.results([adv, adv + v])
    skip = (~m).to(c.compute_dtype)
    carried = scan.scan(torch.where(m, v, 0.0), skip, boot, True, c.backend)
    nv = torch.cat([carried[:, 1:], boot[:, None]], 1)
    alpha, beta = C.masked_gae(r, v, nv, m.to(c.compute_dtype), c.float_rows(g), c.float_rows(l))
    adv = scan.scan(alpha, beta, c.carry(c.float_row(None)), True, c.backend)
    chunk = c.chunk
    if chunk is not None and chunk.edge is not None:  # the two-state map (spec.py) on (bootstrap, carry)
        zero, one = torch.zeros_like(boot), torch.ones_like(boot)
        reach = scan.scan(torch.zeros_like(v), skip, one, True, c.backend)  # d carried / d bootstrap
        d_alpha = torch.where(m, c.float_rows(g) * torch.cat([reach[:, 1:], one[:, None]], 1), 0.0)
        gains = [scan.scan(torch.zeros_like(v), beta, one, True, c.backend), scan.scan(d_alpha, beta, zero, True,
                                                                                        c.backend)]
        chunk.edge[:, :5] = torch.stack([carried[:, 0], reach[:, 0], adv[:, 0], gains[0][:, 0], gains[1][:, 0]], 1)
    return c.results([adv, adv + v])


@routes.public(sharded.TD_LAMBDA_RETURN)
@documented(
    next_values=("``V(s_{t+1})`` of each step's true successor (at a truncation the final observation's value, "
                 "not the next episode's first): the rewards' dtype, broadcastable to their shape. "
                 "``next_values[T-1]`` bootstraps the window end."),
)
def td_lambda_return(rewards, next_values, *, terminated=None, truncated=None, done=None, gamma=0.99,
                     lmbda=0.95, time_dim=-1, backend=None, out=None, episode_starts=None, last_done=None,
                     cu_seqlens=None, max_seqlen=None, group=None, _chunk=None):
    """TD(lambda) return, restarting at every done and bootstrapping at truncations and the window end.

    G[t] = r[t] + gamma*(1-terminated[t])*((1-lmbda)*V(s_{t+1}) + lmbda*G'[t+1]),
    G'[t+1] = V(s_{t+1}) where done[t] or t = T-1, else G[t+1].  lmbda=1: TD(1), lmbda=0: TD(0).
    """
    c = Call(rewards, "rewards", time_dim, chunk=_chunk)
    c.value(next_values, "next_values")
    c.flags(terminated, truncated, done, episode_starts=episode_starts, last_done=last_done)
    g, l = c.coefficient(gamma, "gamma"), c.coefficient(lmbda, "lmbda")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:
        nv = c.view(next_values)
        return c.bind(spec.TD_LAMBDA_RETURN, rewards=c.view(rewards), next_values=nv, carry=nv[:, -1],
                      **c.fused_flags(), gamma=c.view(g), lmbda=c.view(l))
    nv = c.float_rows(next_values)
    nterm, ndone = c.composed_flags()
    alpha, beta = C.td_lambda_return(c.float_rows(rewards), nv, nterm, ndone, c.float_rows(g), c.float_rows(l))
    return c.results([scan.call_scan(c, alpha, beta, nv[:, -1], True)])


@routes.public(sharded.DISCOUNTED_RETURN)
@documented(
    next_values=("``V(s_{t+1})``, what the return restarts from at a done that is not a termination (the final "
                 "observation's value at a truncation) and, as ``next_values[T-1]``, at the window end: the "
                 "rewards' dtype, broadcastable to their shape. Required where a step can be truncated "
                 "(``truncated`` given, or ``done`` with ``terminated``: ValueError without it). Not together "
                 "with ``bootstrap_value``."),
    bootstrap_value=("``R[T]``, the return after the window's last step, per row: the rewards' shape without "
                     "the time dim (broadcastable), their dtype. None, without ``next_values``: 0 (the "
                     "Monte-Carlo reward-to-go). Not together with ``next_values``."),
)
def discounted_return(rewards, *, terminated=None, truncated=None, done=None, next_values=None,
                      bootstrap_value=None, gamma=0.99, time_dim=-1, backend=None, out=None, episode_starts=None,
                      last_done=None, cu_seqlens=None, max_seqlen=None, group=None, _chunk=None):
    """Discounted reward-to-go within episodes.

    R[t] = r[t] + gamma*(1-terminated[t])*(R[t+1] if not done[t] else V(s_{t+1})),
    R[T] = bootstrap_value if given, else next_values[T-1] if given, else 0 (Monte Carlo).
    """
    c = Call(rewards, "rewards", time_dim, chunk=_chunk)
    c.flags(terminated, truncated, done, episode_starts=episode_starts, last_done=last_done)
    if next_values is not None and bootstrap_value is not None:
        raise ValueError("pass either next_values or bootstrap_value, not both")
    c.value(next_values, "next_values", optional=True)
    c.per_row(bootstrap_value, "bootstrap_value")
    if c.maybe_truncated and next_values is None:
        raise ValueError(f"next_values is required when steps can be truncated: {TRUNCATION_HELP}")
    g = c.coefficient(gamma, "gamma")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:
        nv = c.view(next_values)
        carry = c.row_view(bootstrap_value) if nv is None else nv[:, -1]
        return c.bind(spec.DISCOUNTED_RETURN, rewards=c.view(rewards), next_values=nv, carry=carry,
                      **c.fused_flags(), gamma=c.view(g))
    r = c.float_rows(rewards)
    nv = c.float_rows(next_values) if next_values is not None else torch.zeros_like(r)
    carry = c.float_row(bootstrap_value) if next_values is None else nv[:, -1]
    nterm, ndone = c.composed_flags()
    alpha, beta = C.discounted_return(r, nv, nterm, ndone, c.float_rows(g))
    return c.results([scan.call_scan(c, alpha, beta, carry, True)])


@routes.public(sharded.NSTEP_RETURN)
@documented(
    next_values=("``V(s_{t+1})`` of each step's true successor (at a truncation the final observation's value): "
                 "the rewards' dtype, broadcastable to their shape. A window that ends at step e before a "
                 "termination bootstraps from ``next_values[e]``."),
    n=("the number of rewards in a window, an int >= 1 (``n = 1``: the one-step TD target; ``n >= T``: the "
       "return to the episode's or the rollout's end)."),
    group=("not supported: NotImplementedError. A window reads up to n - 1 steps past a chunk's end, which the "
           "sharded route does not exchange (docs/distributed.md); gather the steps on one rank instead."),
)
def nstep_return(rewards, next_values, *, n, terminated=None, truncated=None, done=None, gamma=0.99, time_dim=-1,
                 backend=None, out=None, episode_starts=None, last_done=None, cu_seqlens=None, max_seqlen=None,
                 group=None, _chunk=None):
    """n-step returns, cut at episode ends and at the window end.

    R[t] = sum_{k<m} gamma^k r[t+k] + gamma^m (1-terminated[t+m-1]) V(s_{t+m}),
    m = min(n, e - t + 1, T - t) with e the first done at or after t, and gamma^k the product of
    the steps' discounts gamma[t]...gamma[t+k-1]: a window stops after n rewards, at its episode's
    end (no bootstrap past a termination, the truncated step's own next value at a truncation) and
    at the rollout's end (bootstrapping from what is there).

    Not a scan: the fused kernels read the windows directly. Triton: for windows of up to 512
    steps each input read once per tile, a window its part in its block of min(n, T) steps and
    in the next (two scans and a gather), else O(min(n, T)) steps per output; numba: min(n, T) - 1 vectorised
    passes over each row for n <= 12, else O(T) per row (blocks of n steps). Both add each
    window's own terms alone: no differences of running sums. The torch backend and calls that
    need gradients take torch ops, min(n, T) - 1 passes over the rows, differentiable. With
    ``cu_seqlens`` every sequence is its own row, its last token the rollout's end.
    """
    c = Call(rewards, "rewards", time_dim)
    c.value(next_values, "next_values")
    c.flags(terminated, truncated, done, episode_starts=episode_starts, last_done=last_done)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    g = c.coefficient(gamma, "gamma")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:
        return c.bind(spec.NSTEP_RETURN, rewards=c.view(rewards), next_values=c.view(next_values),
                      **c.fused_flags(), gamma=c.view(g), n=n)
    r, nv, g = c.float_rows(rewards), c.float_rows(next_values), c.float_rows(g)
    nterm, ndone = c.composed_flags()
    # R_1[t] = r + gamma*(1-term)*nv (a termination reads no nv); R_k[t] = R_1[t] where the step ends its
    # episode or the window, else r + gamma*R_{k-1}[t+1]
    one = r + torch.where(nterm == 0, 0.0, g * nv)
    stops = ndone == 0
    stops[:, -1] = True
    ret = one
    for _ in range(min(n, c.rows.T) - 1):
        ret = torch.where(stops, one, r + g * torch.cat([ret[:, 1:], ret[:, -1:]], 1))
    return c.results([ret])


@routes.public(sharded.VTRACE, outputs=2)
@documented(
    rho_bar=("the clip of the importance ratio in the TD errors, ``rho = min(rho_bar, ratio)``: a Python "
             "number > 0; ``float(\"inf\")`` means no clipping."),
    rho_bar_pg=("the clip of the ratio in the policy-gradient advantages, ``min(rho_bar_pg, ratio)``: a number "
                "> 0 or ``float(\"inf\")``. None: ``rho_bar``."),
    out=OUT_PAIR,
)
def vtrace(rewards, values, log_pi, log_mu, *, next_values=None, bootstrap_value=None, terminated=None,
           truncated=None, done=None, gamma=0.99, lmbda=1.0, rho_bar=1.0, c_bar=1.0, rho_bar_pg=None,
           time_dim=-1, backend=None, out=None, episode_starts=None, last_done=None, cu_seqlens=None,
           max_seqlen=None, group=None, _chunk=None):
    """V-trace targets and policy-gradient advantages (IMPALA).

    ratio = exp(log_pi - log_mu), rho = min(rho_bar, ratio), c = lmbda*min(c_bar, ratio)
    (vs - v)[t] = rho[t]*(r[t] + gamma*(1-term[t])*V(s_{t+1}) - v[t]) + gamma*(1-done[t])*c[t]*(vs - v)[t+1]
    pg[t] = min(rho_bar_pg, ratio[t])*(r[t] + gamma*(1-term[t])*vs_next[t] - v[t]),
    vs_next[t] = vs[t+1], or V(s_{t+1}) where done[t] or t = T-1.  Returns ``(vs, pg_advantages)``.
    """
    c = Call(rewards, "rewards", time_dim, chunk=_chunk)
    c.value(values, "values")
    c.value(log_pi, "log_pi")
    c.value(log_mu, "log_mu")
    c.flags(terminated, truncated, done, episode_starts=episode_starts, last_done=last_done)
    c.next_value_form(next_values, bootstrap_value)
    g, l = c.coefficient(gamma, "gamma"), c.coefficient(lmbda, "lmbda")
    rho_bar = inputs.check_threshold(rho_bar, "rho_bar")
    c_bar = inputs.check_threshold(c_bar, "c_bar")
    rho_bar_pg = rho_bar if rho_bar_pg is None else inputs.check_threshold(rho_bar_pg, "rho_bar_pg")
    fused = c.start(backend, out, 2)
    if c.empty:
        return c.empty_outputs()
    if fused:
        return c.bind(spec.VTRACE, rewards=c.view(rewards), values=c.view(values), next_values=c.view(next_values),
                      bootstrap_value=c.row_view(bootstrap_value), log_pi=c.view(log_pi), log_mu=c.view(log_mu),
                      **c.fused_flags(), gamma=c.view(g), lmbda=c.view(l), rho_bar=rho_bar, c_bar=c_bar,
                      rho_bar_pg=rho_bar_pg)
    r, v = c.float_rows(rewards), c.float_rows(values)
    nv = c.composed_next_values(values, next_values, bootstrap_value)
    nterm, ndone = c.composed_flags()
    gf = c.float_rows(g)
    ratio = torch.exp(c.float_rows(log_pi) - c.float_rows(log_mu))
    alpha, beta = C.vtrace(r, v, nv, nterm, ndone, gf, ratio.clamp(max=rho_bar),
                           c.float_rows(l) * ratio.clamp(max=c_bar))
    vs = scan.call_scan(c, alpha, beta, c.float_row(None), True) + v
    # vs[T] = V(s_T) + the carry the scan ran from, (vs - v)[T]; V(s_T) the chunk's bootstrap
    # value where it sets one
    carry = c.carry(c.float_row(None))
    after = c.chunk_arg("bootstrap_value")
    after = nv[:, -1] if after is None else after
    vs_next = torch.where(ndone == 0, nv, torch.cat([vs[:, 1:], (after + carry)[:, None]], 1))
    pg = C.vtrace_pg(r, v, vs_next, nterm, gf, ratio.clamp(max=rho_bar_pg))
    return c.results([vs, pg])


@documented(
    q_values="``Q(s_t, a_t)``: the rewards' dtype, broadcastable to their shape.",
    log_pi=("the target policy's log-probability of the taken action, log pi(a_t|s_t): the rewards' dtype, "
            "broadcastable to their shape. Read by the traces ``retrace``, ``importance`` and ``tree_backup``; "
            "None (ValueError where given) for ``q_lambda`` and ``peng``."),
    log_mu=("the behaviour policy's log-probability of the taken action, as ``log_pi``. Read by ``retrace`` and "
            "``importance``; None (ValueError where given) for the other traces."),
    trace=("the trace coefficient c[t] (Munos et al. 2016, table 1): ``\"retrace\"`` lmbda*min(c_bar, pi/mu); "
           "``\"importance\"`` lmbda*pi/mu; ``\"tree_backup\"`` lmbda*pi(a_t|s_t) (Precup et al. 2000); "
           "``\"q_lambda\"`` lmbda*greedy[t] (Watkins' Q(lambda): the trace is cut at a non-greedy action); "
           "``\"peng\"`` lmbda (Harutyunyan et al. 2016's Q(lambda), Peng's Q(lambda) when the target policy "
           "is greedy: Kozuno et al. 2021). Semantics section 6.5."),
    greedy=("with ``trace=\"q_lambda\"`` only (ValueError otherwise): a flag tensor, nonzero where the taken "
            "action a_t is greedy under the target policy; any flag dtype, broadcastable to the rewards' shape."),
    c_bar=("the clip of the trace ratio of ``trace=\"retrace\"``, ``c = lmbda*min(c_bar, ratio)``: a Python "
           "number > 0, ``float(\"inf\")`` for no clipping; None: 1. ValueError where given with another trace."),
    next_expected_q=("``ev[t] = E_{a~pi} Q(s_{t+1}, a)``: the rewards' dtype, broadcastable to their shape. "
                     "Give exactly one of ``next_expected_q`` and the pair ``next_pi``, ``next_q`` (ValueError)."),
    next_pi=("``pi(a | s_{t+1})`` for each action a: one dim more than the rewards, broadcastable to "
             "``rewards.shape + (A,)`` with the action dim last whatever ``time_dim`` is, the rewards' dtype. "
             "With ``next_q``: ``ev[t] = sum_a next_pi[..., a]*next_q[..., a]``."),
    next_q="``Q(s_{t+1}, a)`` for each action a, as ``next_pi`` and with as many actions.",
    truncated=("``truncated[t]``: the episode was cut after step t (a time limit); the trace stops, and the "
               "step still bootstraps from ``ev[t]``. Gymnasium style, with ``terminated``; not together with "
               "``done``. " + FLAG),
)
def retrace(rewards, q_values, log_pi=None, log_mu=None, *, trace="retrace", greedy=None, next_expected_q=None,
            next_pi=None, next_q=None, terminated=None, truncated=None, done=None, gamma=0.99, lmbda=1.0, c_bar=None,
            time_dim=-1, backend=None, out=None, episode_starts=None, last_done=None, cu_seqlens=None, max_seqlen=None,
            group=None):
    """Off-policy Q targets with a trace (Munos et al. 2016): Retrace(lambda) by default.

    c[t] = the trace coefficient of ``trace`` (below), c[T] = 0;
    ev[t] = E_{a~pi} Q(s_{t+1}, a): ``next_expected_q``, or sum_a next_pi[..., a]*next_q[..., a];
    Q_ret[t] = r[t] + gamma*(1-term[t])*(ev[t] + (1-done[t])*c[t+1]*(Q_ret[t+1] - q[t+1])).

    retrace: c = lmbda*min(c_bar, pi/mu); importance: c = lmbda*pi/mu; tree_backup: c = lmbda*pi;
    q_lambda: c = lmbda*greedy; peng: c = lmbda (pi/mu = exp(log_pi - log_mu), pi = exp(log_pi)).
    """
    log_pi, log_mu, lmbda, c_bar = _trace_inputs(rewards, trace, log_pi, log_mu, greedy, lmbda, c_bar)
    return _retrace(rewards, q_values, log_pi, log_mu, next_expected_q=next_expected_q, next_pi=next_pi,
                    next_q=next_q, terminated=terminated, truncated=truncated, done=done, gamma=gamma, lmbda=lmbda,
                    c_bar=c_bar, time_dim=time_dim, backend=backend, out=out, episode_starts=episode_starts,
                    last_done=last_done, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, group=group)


TRACES = ("retrace", "importance", "tree_backup", "q_lambda", "peng")
# the inputs each trace reads, besides lmbda
TRACE_READS = {"retrace": ("log_pi", "log_mu", "c_bar"), "importance": ("log_pi", "log_mu"),
                "tree_backup": ("log_pi",), "q_lambda": ("greedy",), "peng": ()}


def _trace_inputs(rewards, trace, log_pi, log_mu, greedy, lmbda, c_bar):
    """The kernel's inputs (log_pi, log_mu, lmbda, c_bar) whose c[t] = lmbda*min(c_bar, exp(log_pi - log_mu))
    is ``trace``'s coefficient: log_mu 0 for tree_backup (c = lmbda*pi), log_pi = log_mu = 0 and the
    clip off for q_lambda (lmbda*greedy) and peng (lmbda)."""
    if not isinstance(trace, str) or trace not in TRACES:
        raise ValueError(f"trace must be one of {list(TRACES)}, got {trace!r}")
    given = {"log_pi": log_pi, "log_mu": log_mu, "greedy": greedy, "c_bar": c_bar}
    reads = TRACE_READS[trace]
    for name, x in given.items():
        if name in reads and x is None and name != "c_bar":
            raise ValueError(f"trace={trace!r} needs {name}")
        if name not in reads and x is not None:
            raise ValueError(f"trace={trace!r} reads no {name}; pass None")
    if trace == "retrace":
        return log_pi, log_mu, lmbda, 1.0 if c_bar is None else c_bar
    inputs.check_tensor(rewards, "rewards")
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device).expand(rewards.shape)
    if trace == "importance":
        return log_pi, log_mu, lmbda, math.inf
    if trace == "tree_backup":
        return log_pi, zero, lmbda, math.inf
    if trace == "q_lambda":
        inputs.check_tensor(greedy, "greedy", dtypes=inputs.FLAG_DTYPES, kind="a bool, integer or float")
        if greedy.device != rewards.device:
            raise ValueError(f"greedy is on {greedy.device}, the rewards on {rewards.device}")
        inputs.Rows.check_broadcast(greedy, "greedy", rewards.shape)
        on = greedy if greedy.dtype == torch.bool else greedy != 0
        cd = inputs.compute_dtype(rewards.dtype)
        if isinstance(lmbda, torch.Tensor):
            if lmbda.device != rewards.device:
                raise ValueError(f"lmbda is on {lmbda.device}, the rewards on {rewards.device}")
            lam = lmbda.to(cd)
        else:
            # a fill, not a copy from the host: capturable in a CUDA graph
            lam = torch.full((), inputs.check_unit_interval(lmbda, "lmbda"), dtype=cd, device=rewards.device)
        lmbda = torch.where(on, lam, torch.zeros((), dtype=cd, device=rewards.device))
    return zero, zero, lmbda, math.inf


@routes.public(sharded.RETRACE)
def _retrace(rewards, q_values, log_pi, log_mu, *, next_expected_q=None, next_pi=None, next_q=None,
             terminated=None, truncated=None, done=None, gamma=0.99, lmbda=1.0, c_bar=1.0, time_dim=-1,
             backend=None, out=None, episode_starts=None, last_done=None, cu_seqlens=None, max_seqlen=None,
             group=None, _chunk=None):
    """:func:`retrace` on the kernel's inputs: the trace c[t] = lmbda*min(c_bar, exp(log_pi - log_mu)).

    c[t] = lmbda*min(c_bar, exp(log_pi[t] - log_mu[t])), c[T] = 0;
    ev[t] = E_{a~pi} Q(s_{t+1}, a): ``next_expected_q``, or sum_a next_pi[..., a]*next_q[..., a];
    Q_ret[t] = r[t] + gamma*(1-term[t])*(ev[t] + (1-done[t])*c[t+1]*(Q_ret[t+1] - q[t+1])).
    """
    c = Call(rewards, "rewards", time_dim, chunk=_chunk)
    c.value(q_values, "q_values")
    c.value(log_pi, "log_pi")
    c.value(log_mu, "log_mu")
    if (next_expected_q is None) == (next_pi is None and next_q is None):
        raise ValueError("pass either next_expected_q or the pair next_pi and next_q (not both, not neither)")
    if next_expected_q is None:
        if next_pi is None or next_q is None:
            raise ValueError("next_pi and next_q must be given together")
        for name, x in (("next_pi", next_pi), ("next_q", next_q)):
            inputs.check_tensor(x, name)
            if x.ndim != c.rows.ref.ndim + 1:
                raise ValueError(f"{name} must have the rewards' shape plus an action dim, got {tuple(x.shape)}")
            c.value(x, name, shape=tuple(c.rows.shape) + (x.shape[-1],))
        if next_pi.shape[-1] != next_q.shape[-1]:
            raise ValueError(f"next_pi has {next_pi.shape[-1]} actions but next_q has {next_q.shape[-1]}")
    else:
        c.value(next_expected_q, "next_expected_q")
    c.flags(terminated, truncated, done, episode_starts=episode_starts, last_done=last_done)
    g, l = c.coefficient(gamma, "gamma"), c.coefficient(lmbda, "lmbda")
    c_bar = inputs.check_threshold(c_bar, "c_bar")
    pair = next_expected_q is None
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:
        pi, nq = (c.rows.rows_3d(next_pi), c.rows.rows_3d(next_q)) if pair else (None, None)
        return c.bind(spec.RETRACE, rewards=c.view(rewards), q_values=c.view(q_values), log_pi=c.view(log_pi),
                      log_mu=c.view(log_mu), next_expected_q=c.view(next_expected_q), next_pi=pi, next_q=nq,
                      **c.fused_flags(), gamma=c.view(g), lmbda=c.view(l), c_bar=c_bar)
    if pair:
        ev = (c.rows.rows_3d(next_pi).to(c.compute_dtype) * c.rows.rows_3d(next_q).to(c.compute_dtype)).sum(-1)
    else:
        ev = c.float_rows(next_expected_q)
    nterm, ndone = c.composed_flags()
    trace = c.float_rows(l) * torch.exp(c.float_rows(log_pi) - c.float_rows(log_mu)).clamp(max=c_bar)
    # at the window end c[T] = 1 and q[T] = 0: the carry is c[T]*(Q_ret[T] - q[T]) itself
    c_next = torch.cat([trace[:, 1:], torch.ones_like(trace[:, :1])], 1)
    q = c.float_rows(q_values)
    q_next = torch.cat([q[:, 1:], torch.zeros_like(q[:, :1])], 1)
    alpha, beta = C.retrace(c.float_rows(rewards), ev, q_next, nterm, ndone, c.float_rows(g), c_next)
    return c.results([scan.call_scan(c, alpha, beta, c.float_row(None), True)])


def _eligibility_trace(x, done, decay, initial, time_dim, backend, out, chunk):
    """e[t] = x[t] + g[t]*l[t]*(1-done[t-1])*e[t-1], e[-1] = initial (done[-1] = 0); decay = [g, l]."""
    c = Call(x, "x", time_dim, chunk=chunk)
    c.flags(None, None, done, align=True)
    decay = [c.coefficient(d, name) for name, d in decay]
    c.per_row(initial, "initial")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:
        return c.bind(spec.ELIGIBILITY_TRACE, x=c.view(x), done=c.view(c.done), gamma=c.view(decay[0]),
                      lmbda=c.view(decay[1]), carry=c.row_view(initial))
    _, ndone = c.composed_flags()
    prev_open = torch.cat([torch.ones_like(ndone[:, :1]), ndone[:, :-1]], 1)
    beta = torch.where(prev_open == 0, 0.0, c.float_rows(decay[0]) * c.float_rows(decay[1]) * prev_open)
    return c.results([scan.call_scan(c, c.float_rows(x), beta, c.float_row(initial), False)])


@routes.public(sharded.ELIGIBILITY_TRACE)
@documented(done=FORWARD_DONE, gamma=GAMMA_X)
def eligibility_trace(x, *, done=None, gamma=0.99, lmbda=1.0, initial=None, time_dim=-1, backend=None, out=None,
                      cu_seqlens=None, max_seqlen=None, group=None, _chunk=None):
    """Accumulating eligibility trace, forward in time, reset after each done.

    e[t] = x[t] + gamma*lmbda*(1-done[t-1])*e[t-1], e[-1] = initial (default 0).
    ``x`` may have trailing feature dims after the time dim; ``done`` broadcasts over them.
    """
    return _eligibility_trace(x, done, [("gamma", gamma), ("lmbda", lmbda)], initial, time_dim, backend, out, _chunk)


@routes.public(sharded.EPISODIC_CUMSUM)
@documented(done=FORWARD_DONE)
def episodic_cumsum(x, *, done=None, initial=None, time_dim=-1, backend=None, out=None, cu_seqlens=None,
                    max_seqlen=None, group=None, _chunk=None):
    """Running sum within episodes, forward in time: c[t] = x[t] + (1-done[t-1])*c[t-1], c[-1] = initial."""
    return _eligibility_trace(x, done, [("gamma", 1.0), ("lmbda", 1.0)], initial, time_dim, backend, out, _chunk)


@routes.public(None)
@documented(
    rewards=("``rewards[t]``, the reward that arrived with observation t: the step from observation t has "
             "``rewards[t+1]``, and ``rewards[0]`` belongs to no step of the row. A float16, bfloat16, float32 or "
             "float64 tensor of shape ``[*B, T]`` with time at ``time_dim``; the other float tensors have its "
             "dtype and device, and the output its shape, dtype and device."),
    values="``V`` of observation t: a tensor of the rewards' dtype and device, broadcastable to their shape.",
    ratio=("the importance ratio ``pi/mu`` of the action taken at observation t: the rewards' dtype, "
           "broadcastable to their shape. None: 1 (plain GAE)."),
    done=("``done[t]``, the done flag that arrived with observation t: the step from observation t ends its "
          "episode where ``done[t+1]``, always as a termination. " + FLAG + " None: no episode ends."),
    rho_bar=("the clip of the TD errors' weight, ``rho = min(rho_bar, ratio)``: a Python number > 0; "
             "``float(\"inf\")`` means no clipping."),
    c_bar=("the clip of the trace weight, ``c = min(c_bar, ratio)``: a Python number > 0; ``float(\"inf\")`` "
           "means no clipping."),
    write_last=("a bool. True: the last observation's column, which has no step in the row, gets advantage 0. "
                "False (needs ``out``, else ValueError): that column of ``out`` is left as it was, as PufferLib's "
                "kernel leaves it."),
)
def arrival_gae(rewards, values, *, ratio=None, done=None, gamma=0.99, lmbda=0.95, rho_bar=1.0, c_bar=1.0,
                write_last=True, time_dim=-1, backend=None, out=None):
    """GAE with clipped importance weights on arrival-aligned rows (PufferLib's advantage).

    ``rewards[t]`` and ``done[t]`` arrive with observation t, so the step from observation t
    reads those of observation t+1 (docs/semantics.md, section 6.9). For t < T-1:

    rho[t] = min(rho_bar, ratio[t]), c[t] = min(c_bar, ratio[t])
    delta[t] = rho[t]*(r[t+1] + gamma*(1-done[t+1])*v[t+1] - v[t])
    A[t] = delta[t] + gamma*lmbda*c[t]*(1-done[t+1])*A[t+1],  A[T-1] = 0

    ``ratio=None`` is 1 (plain GAE). The last observation has no step in the row: its advantage
    is 0, and with ``write_last=False`` (only with ``out=``) that column of ``out`` is left as
    it was. Returns ``advantages``.
    """
    c = Call(rewards, "rewards", time_dim)
    c.value(values, "values")
    c.value(ratio, "ratio", optional=True)
    c.flags(None, None, done)
    g, l = c.coefficient(gamma, "gamma"), c.coefficient(lmbda, "lmbda")
    rho_bar = inputs.check_threshold(rho_bar, "rho_bar")
    c_bar = inputs.check_threshold(c_bar, "c_bar")
    if not isinstance(write_last, bool):
        raise TypeError(f"write_last must be a bool, got {type(write_last).__name__}")
    if not write_last and out is None:
        raise ValueError("write_last=False leaves the last column of out= as it was; pass out=")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    # the kernels leave the column alone; a result that goes through a buffer or the composed
    # path would not, so there the column is kept and put back
    keep = None
    if not write_last and not (fused and not any(c.aliased) and c.rows.output(out)[1] is not None
                               and launch.output_dtype(c.backend, c.compute_dtype, c.rows.dtype) == c.rows.dtype):
        keep = out.select(c.rows.tdim, -1).clone()
    if fused:
        bound = c.bind(spec.ARRIVAL_GAE, rewards=c.view(rewards), values=c.view(values),
                       ratio=1.0 if ratio is None else c.view(ratio), done=c.view(c.done), gamma=c.view(g),
                       lmbda=c.view(l), rho_bar=rho_bar, c_bar=c_bar, write_last=float(write_last))
        if keep is None:
            return bound
        result = launch_bound(bound, None)
    else:
        r, v = c.float_rows(rewards), c.float_rows(values)
        x = 1.0 if ratio is None else c.float_rows(ratio)
        ones = torch.ones_like(v)
        x = x * ones
        _, ndone = c.composed_flags()
        alpha, beta = C.arrival_gae(r[:, 1:], v[:, :-1], v[:, 1:], ndone[:, 1:], (c.float_rows(g) * ones)[:, :-1],
                                    (c.float_rows(l) * ones)[:, :-1], x[:, :-1].clamp(max=rho_bar),
                                    x[:, :-1].clamp(max=c_bar))
        alpha = torch.cat([alpha, v.new_zeros(v.shape[0], 1)], 1)
        beta = torch.cat([beta, v.new_ones(v.shape[0], 1)], 1)
        result = c.results([scan.call_scan(c, alpha, beta, c.float_row(None), True)])
    if keep is not None:
        out.select(c.rows.tdim, -1).copy_(keep)
    return result
