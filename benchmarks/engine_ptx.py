"""Compile every engine launch of a set of public calls to sm_90 PTX without a GPU, and compare
two checkouts: an engine change whose PTX is unchanged cannot change device time.

Triton's dispatch runs with a stand-in driver (device 0, target sm_90) and compiles each launch
with ``warmup=True`` instead of launching it; the launch plan sees the H200's 132
multiprocessors. Shapes and call forms follow the GPU benchmark's.

    python benchmarks/engine_ptx.py --root . --json new.json            # this checkout
    python benchmarks/engine_ptx.py --root OTHER_CHECKOUT --json old.json
    python benchmarks/engine_ptx.py --compare old.json new.json
    python benchmarks/engine_ptx.py --time-major-regime --only time_major --json walk.json  # the WALK launches

It needs triton (3.6 is the GPU image's) and torch, no GPU.
"""

from __future__ import annotations

import difflib
import json
import re
import sys

from common import parser

SHAPES = ((4096, 128), (32768, 8), (8, 32768), (16384, 512), (128, 4096), (16384, 4096), (257, 999))
MULTIPROCESSORS = 132  # the H200's


def _calls(rt, torch, R, T, dtype, g):
    def x(*shape):
        return torch.randn(*(shape or (R, T)), generator=g).to(dtype)

    r, v, nv, lp, lm = x(), x(), x(), x(), x()

    def tm(a):
        """``a`` laid out time-major: ``[T, R]``, the rows contiguous."""
        return a.t().contiguous()
    term = torch.rand(R, T, generator=g) < 0.02
    trunc = torch.rand(R, T, generator=g) < 0.02
    done = term | trunc
    boot = x(R)
    sf_v, sf_valid = x(R, T + 1), torch.rand(R, T + 1, generator=g) > 0.1
    kw = dict(backend="triton")
    return {
        "gae": lambda: rt.gae(r, v, bootstrap_value=boot, done=done, **kw),
        "gae_terminated": lambda: rt.gae(r, v, bootstrap_value=boot, terminated=term, **kw),
        "gae_episode_starts": lambda: rt.gae(r, v, bootstrap_value=boot, episode_starts=term, last_done=term[:, -1],
                                             **kw),
        "gae_gym": lambda: rt.gae(r, v, next_values=nv, terminated=term, truncated=trunc, gamma=x() * 0 + 0.9, **kw),
        "td_lambda_return": lambda: rt.td_lambda_return(r, nv, done=done, terminated=term, **kw),
        "td_lambda_return_done": lambda: rt.td_lambda_return(r, nv, done=done, **kw),
        "discounted_return": lambda: rt.discounted_return(r, next_values=nv, terminated=term, truncated=trunc, **kw),
        "discounted_return_mc": lambda: rt.discounted_return(r, done=done, **kw),
        "vtrace": lambda: rt.vtrace(r, v, lp, lm, next_values=nv, terminated=term, truncated=trunc, **kw),
        "vtrace_done": lambda: rt.vtrace(r, v, lp, lm, done=done, **kw),
        "retrace": lambda: rt.retrace(r, v, lp, lm, next_expected_q=nv, done=done, **kw),
        "retrace_pairs": lambda: rt.retrace(r, v, lp, lm, next_pi=x(R, T, 3), next_q=x(R, T, 3), terminated=term,
                                            truncated=trunc, **kw),
        "eligibility_trace": lambda: rt.eligibility_trace(r, done=done, gamma=0.9, initial=boot, **kw),
        "episodic_cumsum": lambda: rt.episodic_cumsum(r, done=done, **kw),
        "affine_scan": lambda: rt.affine_scan(r, v, initial=boot, **kw),
        "affine_scan_forward": lambda: rt.affine_scan(r, v, reverse=False, **kw),
        "gae_mask_skip": lambda: rt.gae(r, v, mask=~term, bootstrap_value=boot, **kw),
        "gae_mask_pad": lambda: rt.gae(r, v, mask=~term, mask_mode="pad", **kw),
        "gae_mask_skip_bootstrap": lambda: rt.gae(r, v, mask=~term, bootstrap_value=boot, gamma=0.9, **kw),
        "gae_mask_pad_bootstrap": lambda: rt.gae(r, v, mask=~term, mask_mode="pad", bootstrap_value=boot, **kw),
        # KL shaping inside the scan (rl_triton.gae's kl=): each estimator's BUILD, a clamp
        "gae_mask_skip_kl_k3": lambda: rt.gae(r, v, mask=~term, kl=dict(log_probs=lp, ref_log_probs=lm, coef=0.1,
                                                                         estimator="k3"), **kw),
        "gae_mask_pad_kl_k1": lambda: rt.gae(r, v, mask=~term, mask_mode="pad", kl=dict(
            log_probs=lp, ref_log_probs=lm, coef=0.1, clamp=10.0), **kw),
        "gae_kl_k2": lambda: rt.gae(r, v, bootstrap_value=boot, done=done, kl=dict(
            log_probs=lp, ref_log_probs=lm, coef=0.1, estimator="k2"), **kw),
        "gae_kl_abs": lambda: rt.gae(r, v, kl=dict(log_probs=lp, ref_log_probs=lm, coef=0.1, estimator="abs"), **kw),
        # the fused whitening: the scan reports its moments, then the fold and the normalisation
        "gae_mask_skip_whiten": lambda: rt.gae(r, v, mask=~term, whiten=True, **kw),
        "gae_mask_pad_whiten": lambda: rt.gae(r, v, mask=~term, mask_mode="pad", whiten=dict(unbiased=False), **kw),
        # rsl_rl's, skrl's and rl_games's normalisation over every element: std + eps
        "gae_whiten_std": lambda: rt.gae(r, v, bootstrap_value=boot, done=done, whiten=dict(eps_mode="std"), **kw),
        # a chunk of a sequence split across ranks: the edge maps' reduce launches (rl_triton/core/sharded.py)
        "gae_edge_map": _chunk(torch, R, 2, lambda **c: rt.gae(r, v, bootstrap_value=boot, done=done, **kw, **c)),
        "vtrace_edge_map": _chunk(torch, R, 2, lambda **c: rt.vtrace(r, v, lp, lm, done=done, **kw, **c)),
        "gae_mask_skip_edge_map": _chunk(torch, R, 5, lambda **c: rt.gae(r, v, mask=~term, **kw, **c)),
        "gae_mask_pad_edge_map": _chunk(torch, R, 2, lambda **c: rt.gae(r, v, mask=~term, mask_mode="pad",
                                                                    bootstrap_value=boot, **kw, **c)),
        # PufferLib's advantage: float flags, the ratio, the last column left alone (or a ratio of 1)
        "arrival_gae": lambda: rt.arrival_gae(r, v, ratio=x().exp(), done=done.to(dtype), write_last=False,
                                              out=torch.zeros_like(r), **kw),
        "arrival_gae_plain": lambda: rt.arrival_gae(r, v, done=done, **kw),
        "arrival_gae_no_flags": lambda: rt.arrival_gae(r, v, ratio=x().exp(), gamma=x() * 0 + 0.9, **kw),
        "arrival_gae_gamma": lambda: rt.arrival_gae(r, v, done=done, lmbda=x() * 0 + 0.9, **kw),
        # time-major [T, R] rollouts (the engine's WALK regime; with the moments, the lane regime)
        "gae_time_major": lambda: rt.gae(tm(r), tm(v), done=tm(done), time_dim=0, **kw),
        "gae_whiten_std_time_major": lambda: rt.gae(tm(r), tm(v), done=tm(done), time_dim=0,
                                                    whiten=dict(eps_mode="std"), **kw),
        "td_lambda_return_time_major": lambda: rt.td_lambda_return(tm(r), tm(nv), done=tm(done), time_dim=0, **kw),
        "discounted_return_time_major": lambda: rt.discounted_return(tm(r), done=tm(done), time_dim=0, **kw),
        "vtrace_time_major": lambda: rt.vtrace(tm(r), tm(v), tm(lp), tm(lm), done=tm(done), time_dim=0, **kw),
        "retrace_time_major": lambda: rt.retrace(tm(r), tm(v), tm(lp), tm(lm), next_expected_q=tm(nv),
                                                 done=tm(done), time_dim=0, **kw),
        "eligibility_trace_time_major": lambda: rt.eligibility_trace(tm(r), done=tm(done), gamma=0.9, time_dim=0,
                                                                     **kw),
        "episodic_cumsum_time_major": lambda: rt.episodic_cumsum(tm(r), done=tm(done), time_dim=0, **kw),
        "affine_scan_forward_time_major": lambda: rt.affine_scan(tm(r), tm(v), reverse=False, time_dim=0, **kw),
        "gae_mask_skip_time_major": lambda: rt.gae(tm(r), tm(v), mask=tm(~term), time_dim=0, **kw),
        "arrival_gae_time_major": lambda: rt.arrival_gae(tm(r), tm(v), done=tm(done), time_dim=0, **kw),
        # n-step returns: a windowed kernel of its own (rl_triton/core/kernels/nstep.py), every flag form
        "nstep_return": lambda: rt.nstep_return(r, nv, n=5, terminated=term, truncated=trunc, **kw),
        "nstep_return_done": lambda: rt.nstep_return(r, nv, n=3, done=done, terminated=term, gamma=x() * 0 + 0.9,
                                                     **kw),
        "nstep_return_episode_starts": lambda: rt.nstep_return(r, nv, n=5, episode_starts=term, last_done=term[:, -1],
                                                               **kw),
        "nstep_return_time_major": lambda: rt.nstep_return(tm(r), tm(nv), n=5, done=tm(done), time_dim=0, **kw),
        # windows past nstep.MAX_BLOCK steps (the walk kernel where T is longer)
        "nstep_return_long": lambda: rt.nstep_return(r, nv, n=1000, episode_starts=term, last_done=term[:, -1], **kw),
        # Sample Factory's valid steps, as its drop-ins call them: values and valids [R, T+1] read
        # through views, float dones; the sum time-major with and without x_last
        "sample_factory_gae": lambda: _valid_steps().valid_gae(r, sf_v[:, :-1], sf_v[:, 1:], sf_valid[:, :-1],
                                                               sf_valid[:, 1:], done.to(dtype), gamma=0.99,
                                                               trace=0.9405, **kw),
        "sample_factory_sum": lambda: _valid_steps().valid_discounted_return(
            tm(r), tm(sf_valid[:, :-1]).to(dtype), tm(done).to(dtype), gamma=0.97, initial=boot, time_dim=0, **kw),
        "sample_factory_sum_no_last": lambda: _valid_steps().valid_discounted_return(
            tm(r), tm(sf_valid[:, :-1]).to(dtype), tm(done).to(dtype), gamma=0.97, time_dim=0, **kw),
    }


def _valid_steps():
    """rl_triton.core.valid (a checkout without it fails these calls by name)."""
    import importlib

    return importlib.import_module("rl_triton.core.valid")


def _chunk(torch, R, width, call):
    """``call`` as one chunk of a sequence split across ranks, asking for its edge map: the
    sharded route's ``_chunk`` argument (a checkout from before it set a context variable)."""
    def run():
        from rl_triton.core import plans

        chunk = plans.Chunk(torch.zeros(R), torch.zeros(R, width + 1, dtype=torch.float64))
        if not hasattr(plans, "CHUNK"):
            return call(_chunk=chunk)
        token = plans.CHUNK.set(chunk)
        try:
            return call()
        finally:
            plans.CHUNK.reset(token)
    return run


def collect(root: str | None, only: str = "", time_major_regime: bool = False) -> dict:
    """{call: [PTX of each launch]} (or an error text) for this checkout or ``root``; ``only``:
    the calls whose name contains it; ``time_major_regime``: the time-major regime for every
    time-major call, whatever its shape."""
    if root:
        sys.path.insert(0, root)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StandIn:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(StandIn())
    import rl_triton as rt
    from rl_triton.core import kernels

    print(f"rl_triton from {rt.__file__}, triton {triton.__version__}", flush=True)
    kernels.INTERPRET = True  # CPU tensors take the Triton backend; nothing is launched
    kernels._multiprocessors = lambda device: MULTIPROCESSORS
    if time_major_regime:  # the time-major plan and the engine's WALK regime for time-major calls
        kernels.TIME_MAJOR_REGIME = True
        kernels.time_major_regime_wins = lambda R, T: True
    captured = []

    class Compile:
        """A jit kernel whose launches compile it and keep the PTX instead."""

        def __init__(self, jit):
            self.jit = jit

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kernel = self.jit.run(*args, grid=grid, warmup=True, **kwargs)
                captured.append((kernel.result() if hasattr(kernel, "result") else kernel).asm["ptx"])
            return launch

    for name in ("scan_kernel", "edge_kernel"):  # the edge maps' fold, where the checkout has it
        if hasattr(kernels, name):
            setattr(kernels, name, Compile(getattr(kernels, name)))
    from rl_triton.core.kernels import moments

    for name in ("fold_kernel", "normalize_kernel", "moments_kernel", "whiten_kernel"):  # those the checkout has
        if hasattr(moments, name):
            setattr(moments, name, Compile(getattr(moments, name)))
    try:  # the n-step kernel, where the checkout has it
        from rl_triton.core.kernels import nstep
    except ImportError:
        nstep = None
    if nstep is not None:
        for name in ("nstep_kernel", "nstep_blocks_kernel", "nstep_walk_kernel"):  # those the checkout has
            if hasattr(nstep, name):
                setattr(nstep, name, Compile(getattr(nstep, name)))
    g = torch.Generator().manual_seed(0)
    out = {}
    for R, T in SHAPES:
        dtypes = (torch.float32, torch.float64, torch.bfloat16) if (R, T) in ((4096, 128), (257, 999)) else (
            torch.float32,)
        for dtype in dtypes:
            for name, call in _calls(rt, torch, R, T, dtype, g).items():
                if only not in name:
                    continue
                captured.clear()
                try:
                    call()
                    out[f"{name} {R}x{T} {str(dtype)[6:]}"] = list(captured)
                except Exception as e:  # a call that fails to compile is reported, the others still run
                    out[f"{name} {R}x{T} {str(dtype)[6:]}"] = "ERROR " + _chain(e)
    return out


def _chain(e: BaseException) -> str:
    """An exception and its causes, innermost last (a compile error's cause is where it failed)."""
    parts = []
    while e is not None and len(parts) < 8:
        parts.append(f"{type(e).__name__}: {str(e)[-1500:]}")
        e = e.__cause__ or e.__context__
    return "\n-- caused by --\n".join(parts)


def _instructions(ptx: str) -> list[str]:
    """The kernel's instructions, without debug sections, comments and kernel names."""
    body = re.split(r"\.section\s*\.debug", ptx)[0]
    lines = []
    for line in body.splitlines():
        line = line.strip()
        if line and not line.startswith((".loc", ".file", "//", "$L__")):
            lines.append(re.sub(r"(scan|edge)_kernel\w*", "K", line))
    return lines


def compare(old_path: str, new_path: str) -> None:
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    same = 0
    for key, a in old.items():
        b = new.get(key)
        if isinstance(a, str) or isinstance(b, str) or b is None:
            print(f"{key}: {'missing' if b is None else (a if isinstance(a, str) else b)[:200]}")
            continue
        for i, (pa, pb) in enumerate(zip(a, b)):
            ia, ib = _instructions(pa), _instructions(pb)
            if ia == ib:
                same += 1
                continue
            diff = [d for d in difflib.unified_diff(ia, ib, lineterm="", n=0) if d[:3] not in ("---", "+++", "@@ ")]
            print(f"{key} launch {i}: {len(ia)} -> {len(ib)} lines, {len(diff)} differ, e.g. {diff[:4]}")
        if len(a) != len(b):
            print(f"{key}: {len(a)} -> {len(b)} launches")
    print(f"{same} launches with identical PTX")


def main():
    p = parser(__doc__)
    p.add_argument("--root", help="a checkout whose rl_triton to compile (None: this one)")
    p.add_argument("--json", help="write {call: [PTX]} here")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two --json files")
    p.add_argument("--only", default="", help="compile the calls whose name contains this")
    p.add_argument("--time-major-regime", action="store_true",
                   help="the time-major regime for every time-major call (the library takes it where "
                        "kernels.time_major_regime_wins says)")
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    out = collect(args.root, args.only, args.time_major_regime)
    errors = sum(isinstance(v, str) for v in out.values())
    print(f"{len(out)} calls compiled, {errors} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
