"""Check the Triton backend against the float64 oracle (rl_triton.testing) at large shapes.

Every algorithm, several dtypes, batch-major and time-major layouts, outputs poisoned with
NaN before each call (so every element must be written); then torch.compile(fullgraph=True)
and CUDA-graph capture of gae, the reverse/forward scan direction at many lengths, repeated calls
of one signature (the call plans and their generated launches), and (full run
on a GPU of 48 GB or more) GAE on a tensor of 2.16e9 elements, the int64 index path.
The oracle runs on the host in a process pool while the GPU works.

    python benchmarks/gpu_check.py            # on a CUDA machine
    python benchmarks/gpu_check.py --quick    # small shapes; without CUDA: a smoke run on CPU
                                              # tensors in the Triton interpreter

--device cpu runs the Triton kernels on CPU tensors in the interpreter (TRITON_INTERPRET=1 is
set for the run when it is not set already); that is what --quick picks where CUDA is missing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from common import parser

SHAPES = [(4096, 128), (16384, 512), (32768, 8), (64, 8192), (8, 32768), (1, 131072), (3, 1000003),
          (257, 999), (2048, 64, "time-major"), (300, 257, "time-major"), (8, 4096, "time-major")]
QUICK_SHAPES = [(5, 40), (3, 300), (2, 7, "time-major")]
# case name -> (function, variant of rl_triton.testing.catalog)
ALGOS = {
    "gae": ("gae", "terminated+bootstrap"),
    "gae_done": ("gae", "done+bootstrap"),  # TorchRL style: done alone, every done a termination
    "gae_gym": ("gae", "gym with per-step gamma"),
    "gae_obs": ("gae", "episode_starts"),  # observation-aligned flags, read in place
    "td_lambda": ("td_lambda_return", "torchrl"),
    "discounted": ("discounted_return", "gym"),
    "vtrace": ("vtrace", "gym"),
    "retrace": ("retrace", "expected"),
    "retrace_pairs": ("retrace", "pairs"),
    "eligibility": ("eligibility_trace", "done+initial"),
    "cumsum": ("episodic_cumsum", "done+initial"),
    "scan_reverse": ("affine_scan", "reverse"),
    "scan_forward": ("affine_scan", "forward"),
    "arrival": ("arrival_gae", "ratio+done"),  # PufferLib's rows: rewards and dones read at t+1, the ratio
    "nstep": ("nstep_return", "gym"),  # a windowed kernel of its own, n = 5
    "nstep_obs": ("nstep_return", "episode_starts"),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-9}
GAMMA, LMBDA, TRACE_LMBDA = 0.99, 0.95, 0.9


def cases(quick: bool, only=None):
    shapes = QUICK_SHAPES if quick else SHAPES
    if only:
        shapes = [s for s in shapes if f"{s[0]}x{s[1]}" in only]
    out = []
    for shape in shapes:
        R, T = shape[:2]
        layout = shape[2] if len(shape) > 2 else "batch-major"
        dtypes = [torch.float32]
        if R * T <= 2_000_000 or quick:
            dtypes.append(torch.bfloat16)
        if (R, T) in ((257, 999), (8, 32768), (5, 40)):
            dtypes += [torch.float16, torch.float64]
        for dtype in dtypes:
            for algo in ALGOS:
                if algo == "retrace_pairs" and R * T > 2_000_000:
                    continue
                out.append((algo, R, T, layout, dtype))
    return out


def _testing():
    """rl_triton.testing, imported on first use: importing rl_triton imports triton (through
    torch's custom ops), and main() must set TRITON_INTERPRET before that for CPU tensors."""
    import rl_triton.testing

    return rl_triton.testing


def reference(*args, **kwargs):
    return _testing().reference(*args, **kwargs)


def problem(case, seed, device="cpu"):
    """The case's problem; the same values on every device (2% terminations, 2% truncations)."""
    algo, R, T, layout, dtype = case
    fn, variant = ALGOS[algo]
    shape, time_dim = ((T, R), 0) if layout == "time-major" else ((R, T), -1)
    return _testing().make(fn, shape, variant, time_dim=time_dim, dtype=dtype, device=device, seed=seed, gamma=GAMMA,
                lmbda=TRACE_LMBDA if fn == "eligibility_trace" else LMBDA)


def expected(case, seed):
    """The oracle's outputs for one case (runs in a worker process)."""
    return problem(case, seed).expected()


def actual(case, seed, device):
    """The library's outputs on ``device`` (poisoned ``out=`` tensors), as float64 numpy."""
    p = problem(case, seed, device)
    poison = [torch.full(p.shape, float("nan"), dtype=p.dtype, device=device) for _ in range(p.n_out)]
    p.call("triton", out=tuple(poison) if p.n_out == 2 else poison[0])
    return [x.double().cpu().numpy() for x in poison]


def rel_err(y, ref):
    return float(np.max(np.abs(y - ref) / (1.0 + np.abs(ref)))) if y.size else 0.0


def check_compile_and_graphs(device):
    import rl_triton as rt

    lines = []
    torch.manual_seed(0)
    r, v = torch.randn(4096, 128, device=device), torch.randn(4096, 128, device=device)
    d = torch.rand(4096, 128, device=device) < 0.02
    kw = dict(done=d, gamma=GAMMA, lmbda=LMBDA)
    ref = reference("gae", (r, v), kw)[0]

    def f(r, v, d):
        return rt.gae(r, v, done=d, gamma=GAMMA, lmbda=LMBDA)[0]

    compiled = torch.compile(f, fullgraph=True)
    lines.append(("torch.compile(fullgraph=True) gae", rel_err(compiled(r, v, d).double().cpu().numpy(), ref)))
    if device.type == "cuda":
        f(r, v, d)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = f(r, v, d)
        r2 = torch.randn_like(r)
        r.copy_(r2)
        graph.replay()
        torch.cuda.synchronize()
        ref2 = reference("gae", (r2, v), kw)[0]
        lines.append(("CUDA-graph capture + replay of gae (new inputs)", rel_err(static.double().cpu().numpy(), ref2)))
    return lines


def check_launch_cache(device):
    """Repeated calls with the same shape but other alignment and strides: the cached direct
    launches must pick the kernel Triton's dispatch would (misaligned data by a storage offset,
    transposed strides), in the single-pass and the split regimes."""
    import rl_triton as rt

    worst = 0.0
    for R, T in ((64, 300), (2, 20000)):
        def inputs(variant, seed):
            torch.manual_seed(seed)
            made = []
            for dtype in (torch.float32, torch.float32, torch.bool):
                if variant == "offset":  # data pointers 1 element past an allocation's start
                    x = torch.empty(R * T + 1, dtype=dtype, device=device)[1:].view(R, T)
                elif variant == "transposed":
                    x = torch.empty(T, R, dtype=dtype, device=device).t()
                else:
                    x = torch.empty(R, T, dtype=dtype, device=device)
                x.copy_(torch.rand(R, T, device=device) < 0.02 if dtype == torch.bool else torch.randn(R, T))
                made.append(x)
            return made

        for seed, variant in enumerate(["plain", "offset", "plain", "transposed", "offset", "plain"] * 2):
            r, v, d = inputs(variant, seed)
            kw = dict(done=d, gamma=GAMMA, lmbda=LMBDA)
            adv = rt.gae(r, v, **kw)[0]
            ref = reference("gae", (r, v), kw)[0]
            worst = max(worst, rel_err(adv.double().cpu().numpy(), ref))
    return worst


def check_repeated_calls(device):
    """Every case called three times with new values of one signature: the first call leaves a
    plan (rl_triton/core/plans.py), the second runs it, the third its generated launch."""
    worst = 0.0
    for algo in ALGOS:
        for seed in range(3):
            p = problem((algo, 64, 300, "batch-major", torch.float32), 1000 + seed, device)
            for got, want in zip(p.call("triton"), p.expected()):
                worst = max(worst, rel_err(got.double().cpu().numpy(), want))
    return worst


def check_direction(device, lengths):
    import rl_triton as rt

    worst = 0.0
    for T in lengths:
        torch.manual_seed(T)
        a, b = torch.randn(64, T, device=device), torch.rand(64, T, device=device)
        for reverse in (True, False):
            y = rt.affine_scan(a, b, reverse=reverse, backend="triton").double().cpu().numpy()
            worst = max(worst, rel_err(y, reference("affine_scan", (a, b), dict(reverse=reverse))[0]))
    return worst


def check_token_level(device):
    """GAE over response masks (skip, pad) against the oracle, packed sequences against each
    sequence alone, masked_whiten against verl's, at shapes with partial tiles and time splits."""
    import rl_triton as rt
    from rl_triton.testing import frameworks, oracle

    worst = 0.0
    for (R, T) in [(3, 1), (37, 1000), (5, 40000), (1024, 257)]:
        g = torch.Generator().manual_seed(R * T)
        r, v = torch.randn(R, T, generator=g), torch.randn(R, T, generator=g)
        m = torch.rand(R, T, generator=g) < 0.8
        m[0] = False
        boot = torch.randn(R, generator=g)
        rows = slice(0, min(R, 6))
        for mode in ("skip", "pad"):
            got = rt.gae(r.to(device), v.to(device), mask=m.to(device), mask_mode=mode, bootstrap_value=boot.to(device),
                         gamma=0.99, lmbda=0.95)
            want = oracle.gae_masked(r[rows].double().numpy(), v[rows].double().numpy(), m[rows].numpy(),
                                     np.full((rows.stop, T), 0.99), np.full((rows.stop, T), 0.95), mode,
                                     boot[rows].double().numpy())
            worst = max(worst, *(rel_err(x[rows].double().cpu().numpy(), w) for x, w in zip(got, want)))
        adv = got[0]
        whitened = rt.masked_whiten(adv, m.to(device))
        want = frameworks.verl_masked_whiten(adv.double().cpu(), m.double())
        worst = max(worst, rel_err(whitened.double().cpu().numpy(), want.numpy()))
    # the fused whitening (the scan's moments) against verl's GAE step, in float64 on the device
    for (R, T) in [(37, 1000), (1024, 8192)]:
        g = torch.Generator().manual_seed(R + T)
        r, v = torch.randn(R, T, generator=g).to(device), torch.randn(R, T, generator=g).to(device)
        m = (torch.rand(R, T, generator=g) < 0.9).to(device)
        want = frameworks.verl_compute_gae_advantage_return(r.double(), v.double(), m.double(), 0.99, 0.95)
        for dtype in (torch.float32, torch.float64):
            got = rt.gae(r.to(dtype), v.to(dtype), mask=m, gamma=0.99, lmbda=0.95, whiten=True)
            worst = max(worst, *(rel_err(x.double().cpu().numpy(), w.cpu().numpy()) for x, w in zip(got, want)))
    lengths = [0, 1, 700, 3, 4097, 0, 64]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    n = int(cu[-1])
    r, v = torch.randn(n, device=device), torch.randn(n, device=device)
    d, m = torch.rand(n, device=device) < 0.05, torch.rand(n, device=device) < 0.8
    for kwargs in (dict(done=d), dict(mask=m), dict(mask=m, mask_mode="pad")):
        got = rt.gae(r, v, **kwargs, cu_seqlens=cu, max_seqlen=max(lengths))
        for i in range(len(lengths)):
            lo, hi = int(cu[i]), int(cu[i + 1])
            if hi > lo:
                alone = rt.gae(r[lo:hi], v[lo:hi], **{k: x[lo:hi] if isinstance(x, torch.Tensor) else x
                                                      for k, x in kwargs.items()})
                worst = max(worst, *(rel_err(a[lo:hi].double().cpu().numpy(), b.double().cpu().numpy())
                                     for a, b in zip(got, alone)))
    return worst


def check_valid_steps(device, quick):
    """Sample Factory's valid steps (rl_triton.core.valid: valid_gae, valid_discounted_return; 30%
    of the steps invalid, dones at 5%) against the oracle, batch-major and time-major, float32 and
    float64, at shapes with partial tiles and time splits: its first rows."""
    from rl_triton.core.valid import valid_discounted_return, valid_gae
    from rl_triton.testing import oracle

    worst = 0.0
    for (R, T) in [(3, 1), (5, 40), (2, 300)] if quick else [(3, 1), (37, 1000), (5, 40000), (1024, 33)]:
        g = torch.Generator().manual_seed(R + 3 * T)
        r, v = torch.randn(R, T, generator=g), torch.randn(R, T + 1, generator=g)
        valid = torch.rand(R, T + 1, generator=g) >= 0.3
        d = (torch.rand(R, T, generator=g) < 0.05).float()
        rows = slice(0, min(R, 6))
        full = np.ones((rows.stop, T))
        want_adv = oracle.valid_gae(r[rows].double().numpy(), v[rows, :-1].double().numpy(),
                                    v[rows, 1:].double().numpy(), valid[rows, :-1].numpy(), valid[rows, 1:].numpy(),
                                    d[rows].numpy(), full * 0.99, full * 0.9405)
        want_sum = oracle.valid_discounted_return(r[rows].double().numpy(), valid[rows, :-1].numpy(),
                                                  d[rows].numpy(), full * 0.97, v[rows, 0].double().numpy())
        for dtype in (torch.float32, torch.float64):
            x, vv = r.to(device, dtype), v.to(device, dtype)
            m, dd = valid.to(device), d.to(device, dtype)
            adv = valid_gae(x, vv[:, :-1], vv[:, 1:], m[:, :-1], m[:, 1:], dd, gamma=0.99, trace=0.9405)
            sums = valid_discounted_return(x.t().contiguous(), m[:, :-1].t().to(dtype), dd.t(), gamma=0.97,
                                           initial=vv[:, 0], time_dim=0).t()
            worst = max(worst, rel_err(adv[rows].double().cpu().numpy(), want_adv),
                        rel_err(sums[rows].double().cpu().numpy(), want_sum))
    return worst


def _group_oracle(s, g, mode):
    """float64 GRPO / RLOO advantages from the formulas (numpy; g: group numbers); a group of one
    keeps its score (GRPO: over the float32 1 + eps)."""
    _, code, count = np.unique(g, return_inverse=True, return_counts=True)
    n = count[code]
    dev = s - (np.bincount(code, s) / count)[code]
    if mode == "rloo":
        return np.where(n > 1, dev * n / np.maximum(n - 1, 1), s)
    std = np.sqrt(np.bincount(code, dev * dev)[code] / np.maximum(n - 1, 1))
    return np.where(n > 1, dev / (std + 1e-6), s / float(np.float32(1) + np.float32(1e-6)))


def check_group_advantages(device, quick):
    """group_advantages (grpo, rloo; float32 scores, int64 ids on the device, groups of 8 to 16 in
    shuffled order) against a float64 oracle: the all-pairs kernel (B = 8192; twice, bitwise
    equal) and the sort path (B above PAIRS_MAX_B), and on CUDA a CUDA graph of the kernel's call
    replayed on new scores."""
    import rl_triton as rt
    from rl_triton.core import groups

    rng = np.random.default_rng(0)
    worst = 0.0
    for B in (300 if quick else 8192, groups.PAIRS_MAX_B + 1):
        sizes = rng.integers(8, 17, B // 8 + 1)
        sizes = sizes[:np.searchsorted(np.cumsum(sizes), B) + 1]
        sizes[-1] -= sizes.sum() - B  # the last group cut to fit
        g = rng.permutation(np.repeat(np.arange(sizes.size), sizes))
        ids = torch.tensor(rng.choice(2**40, sizes.size, replace=False)[g], device=device)
        s = torch.randn(B, device=device)
        for mode in ("grpo", "rloo"):
            got = rt.group_advantages(s, ids, mode=mode, backend="triton")
            again = rt.group_advantages(s, ids, mode=mode, backend="triton")
            if B <= groups.PAIRS_MAX_B and not torch.equal(got, again):  # the kernel adds in a fixed order
                return float("inf")
            worst = max(worst, rel_err(got.double().cpu().numpy(), _group_oracle(s.double().cpu().numpy(), g, mode)))
        if device.type == "cuda" and B <= groups.PAIRS_MAX_B:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = rt.group_advantages(s, ids, backend="triton")
            s.copy_(torch.randn(B, device=device))
            graph.replay()
            torch.cuda.synchronize()
            want = _group_oracle(s.double().cpu().numpy(), g, "grpo")
            worst = max(worst, rel_err(static.double().cpu().numpy(), want))
    return worst


def check_int64(device):
    """GAE on a real tensor of more than 2^31 elements (the kernels' int64 index path), checked
    against the oracle on its first and last rows; None where the GPU lacks the memory (about
    40 GB)."""
    import rl_triton as rt

    R, T = (1 << 24) + 3, 129  # 2.16e9 elements
    if torch.cuda.mem_get_info(device)[0] < 48 * 2**30:
        return None
    g = torch.Generator(device=device).manual_seed(0)
    r = torch.randn(R, T, device=device, generator=g)
    v = torch.randn(R, T, device=device, generator=g)
    d = torch.rand(R, T, device=device, generator=g) < 0.02
    adv, tgt = rt.gae(r, v, done=d, gamma=GAMMA, lmbda=LMBDA)
    worst = 0.0
    for rows in (slice(0, 8), slice(R - 8, R)):
        want = reference("gae", (r[rows], v[rows]), dict(done=d[rows], gamma=GAMMA, lmbda=LMBDA))
        for got, ref in zip((adv[rows], tgt[rows]), want):
            worst = max(worst, rel_err(got.double().cpu().numpy(), ref))
    del r, v, d, adv, tgt
    torch.cuda.empty_cache()
    return worst


def main():
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true",
                   help="small shapes (on CPU tensors in the interpreter where CUDA is missing)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (None: cuda; with --quick, cpu where CUDA is missing)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="processes computing the oracle")
    p.add_argument("--shapes", help="comma-separated RxT subset of the shape list")
    p.add_argument("--no-int64", action="store_true", help="skip the 2.16e9-element GAE (about 40 GB, a minute)")
    args = p.parse_args()
    if importlib.util.find_spec("triton") is None:
        print("gpu_check.py checks the Triton kernels and needs triton, which is not installed: "
              "pip install -e '.[dev]' (CPU: the Triton interpreter) or '.[gpu]' (CUDA)", file=sys.stderr)
        sys.exit(2)
    if args.device is None:
        if not torch.cuda.is_available() and not args.quick:
            p.error("no CUDA here: run with --quick (a smoke run in the Triton interpreter) or --device cpu")
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"  # before rl_triton (and with it triton) is imported
        print("CPU tensors: the Triton kernels run in the interpreter (TRITON_INTERPRET=1)")
    all_cases = cases(args.quick, args.shapes and args.shapes.split(","))
    start = time.time()
    with ProcessPoolExecutor(args.workers) as pool:  # forked before CUDA starts
        futures = [pool.submit(expected, c, i) for i, c in enumerate(all_cases)]
        device = torch.device(args.device)
        if device.type == "cuda":
            print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
                  f"triton {__import__('triton').__version__}")
        rows, failures = [], 0
        for i, (case, fut) in enumerate(zip(all_cases, futures)):
            got = actual(case, i, device)
            want = fut.result()
            written = all(np.isfinite(g).all() for g in got)
            err = max(rel_err(g, w) for g, w in zip(got, want))
            ok = written and err <= TOL[case[4]]
            failures += not ok
            rows.append((case, err, written, ok))
            algo, R, T, layout, dtype = case
            print(f"{'ok  ' if ok else 'FAIL'} {algo:14s} {R:>6d}x{T:<8d} {layout:12s} {str(dtype)[6:]:9s} "
                  f"rel err {err:.1e}{'' if written else '  NOT ALL WRITTEN'}", flush=True)
    lengths = [1, 7, 8, 33, 128] if args.quick else [1, 7, 8, 33, 128, 1000, 4096, 16384, 100000]
    direction = check_direction(device, lengths)
    print(f"{'ok  ' if direction <= 1e-5 else 'FAIL'} scan direction (reverse and forward, T in {lengths}): "
          f"rel err {direction:.1e}")
    failures += direction > 1e-5
    repeated = check_repeated_calls(device)
    print(f"{'ok  ' if repeated <= 1e-5 else 'FAIL'} repeated calls of one signature (plans, generated launches): "
          f"rel err {repeated:.1e}")
    failures += repeated > 1e-5
    cache = check_launch_cache(device)
    print(f"{'ok  ' if cache <= 1e-5 else 'FAIL'} repeated launches across alignments and strides: rel err {cache:.1e}")
    failures += cache > 1e-5
    tokens = check_token_level(device)
    print(f"{'ok  ' if tokens <= 1e-5 else 'FAIL'} token level (masked GAE skip/pad, masked_whiten, packed "
          f"sequences): rel err {tokens:.1e}")
    failures += tokens > 1e-5
    valid_steps = check_valid_steps(device, args.quick)
    print(f"{'ok  ' if valid_steps <= 1e-5 else 'FAIL'} valid steps (Sample Factory's valid_gae and "
          f"valid_discounted_return): rel err {valid_steps:.1e}")
    failures += valid_steps > 1e-5
    grouped = check_group_advantages(device, args.quick)
    print(f"{'ok  ' if grouped <= 1e-5 else 'FAIL'} group advantages (grpo, rloo: the all-pairs kernel, the sort "
          f"path, a CUDA graph): rel err {grouped:.1e}")
    failures += grouped > 1e-5
    if device.type == "cuda" and not args.quick and not args.no_int64:
        wide = check_int64(device)
        if wide is None:
            print("skip int64 index path: less than 48 GB free on the GPU")
        else:
            print(f"{'ok  ' if wide <= 1e-5 else 'FAIL'} int64 index path (GAE, {(1 << 24) + 3}x129 = 2.16e9 "
                  f"elements), first and last 8 rows: rel err {wide:.1e}")
            failures += wide > 1e-5
    for name, err in check_compile_and_graphs(device):
        ok = err <= 1e-5
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.1e}")
    print(f"\n{len(rows) - sum(not r[3] for r in rows)}/{len(rows)} oracle cases passed, "
          f"{failures} failures in all, {time.time() - start:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
