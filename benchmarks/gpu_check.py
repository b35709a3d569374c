"""Check the Triton backend against the float64 oracle (tests/oracle.py) at large shapes.

Every algorithm, several dtypes, batch-major and time-major layouts, outputs poisoned with
NaN before each call (so every element must be written); then torch.compile(fullgraph=True)
and CUDA-graph capture of gae, and the reverse/forward scan direction at many lengths.
The oracle runs on the host in a process pool while the GPU works.

    python benchmarks/gpu_check.py            # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --quick --device cpu   # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import oracle  # noqa: E402

SHAPES = [(4096, 128), (16384, 512), (32768, 8), (64, 8192), (8, 32768), (1, 131072), (3, 1000003),
          (257, 999), (2048, 64, "time-major")]
QUICK_SHAPES = [(5, 40), (3, 300), (2, 7, "time-major")]
ALGOS = ["gae", "gae_done", "gae_gym", "gae_obs", "td_lambda", "discounted", "vtrace", "retrace", "retrace_pairs",
         "eligibility", "cumsum", "scan_reverse", "scan_forward"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-9}
GAMMA, LMBDA = 0.99, 0.95


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


def make_inputs(algo, R, T, dtype, seed):
    """float64 numpy inputs, already rounded to ``dtype``, and the flags."""
    rng = np.random.default_rng(seed)

    def f(*shape, scale=1.0):
        x = rng.standard_normal(shape) * scale
        return torch.from_numpy(x).to(dtype).double().numpy()

    term = rng.random((R, T)) < 0.02
    trunc = (rng.random((R, T)) < 0.02) & ~term
    d = dict(r=f(R, T), v=f(R, T), nv=f(R, T), lp=f(R, T, scale=0.3), lm=f(R, T, scale=0.3), boot=f(R),
             term=term, trunc=trunc,
             gt=torch.from_numpy(rng.uniform(0.9, 1.0, (R, T))).to(dtype).double().numpy())
    if algo == "retrace_pairs":
        logits = rng.standard_normal((R, T, 4))
        pi = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        d["pi"] = torch.from_numpy(pi).to(dtype).double().numpy()
        d["nq"] = f(R, T, 4)
    if algo.startswith("scan"):
        d["beta"] = d["gt"] * (rng.random((R, T)) > 0.02)
    return d


def hyper(x, dtype):
    """A float hyperparameter as the kernels apply it: float32 unless the inputs are float64
    (as PyTorch applies Python scalars to float32 tensors)."""
    return x if dtype == torch.float64 else float(np.float32(x))


def expected(case, seed):
    """The oracle's outputs for one case (runs in a worker process)."""
    algo, R, T, _, dtype = case
    d = make_inputs(algo, R, T, dtype, seed)
    g, l = np.full((R, T), hyper(GAMMA, dtype)), np.full((R, T), hyper(LMBDA, dtype))
    term, trunc = d["term"], d["trunc"]
    done = term | trunc
    if algo == "gae":
        return oracle.gae(d["r"], d["v"], oracle.implied_next_values(d["v"], d["boot"]), term, term, g, l)
    if algo == "gae_done":  # TorchRL style: done alone, every done a termination
        return oracle.gae(d["r"], d["v"], oracle.implied_next_values(d["v"], d["boot"]), done, done, g, l)
    if algo == "gae_gym":
        return oracle.gae(d["r"], d["v"], d["nv"], term, done, d["gt"], l)
    if algo == "gae_obs":  # observation-aligned: episode starts = term shifted forward, last done = term[:, -1]
        return oracle.gae(d["r"], d["v"], oracle.implied_next_values(d["v"], d["boot"]), term, term, g, l)
    if algo == "td_lambda":
        return (oracle.td_lambda_return(d["r"], d["nv"], term, done, g, l),)
    if algo == "discounted":
        return (oracle.discounted_return(d["r"], term, done, g, next_values=d["nv"], carry=d["nv"][:, -1]),)
    if algo == "vtrace":
        return oracle.vtrace(d["r"], d["v"], d["nv"], d["lp"], d["lm"], term, done, g, l, 1.0, 1.0, 1.0)
    if algo == "retrace":
        return (oracle.retrace(d["r"], d["v"], d["lp"], d["lm"], term, done, g, l, 1.0, next_expected_q=d["nv"]),)
    if algo == "retrace_pairs":
        return (oracle.retrace(d["r"], d["v"], d["lp"], d["lm"], term, done, g, l, 1.0,
                               next_pi=d["pi"], next_q=d["nq"]),)
    if algo == "eligibility":
        return (oracle.eligibility_trace(d["r"], done, g, np.full((R, T), hyper(0.9, dtype)), initial=d["boot"]),)
    if algo == "cumsum":
        return (oracle.episodic_cumsum(d["r"], term, initial=d["boot"]),)
    return (oracle.affine_scan(d["r"], d["beta"], reverse=algo == "scan_reverse", initial=d["boot"]),)


def actual(case, seed, device):
    """The library's outputs on ``device`` (poisoned ``out=`` tensors), as float64 numpy [R, T]."""
    import rl_triton as rt

    algo, R, T, layout, dtype = case
    d = make_inputs(algo, R, T, dtype, seed)
    tm = layout == "time-major"

    def t(x, dt=dtype):  # caller layout: [R, T] batch-major, or a contiguous [T, R]
        x = torch.from_numpy(np.ascontiguousarray(x.T if tm else x))
        return x.to(dt).to(device)

    def row(x):
        return torch.from_numpy(x).to(dtype).to(device)

    kw = dict(time_dim=0 if tm else -1, backend="triton")
    n_out = 2 if algo in ("gae", "gae_done", "gae_gym", "gae_obs", "vtrace") else 1
    shape = (T, R) if tm else (R, T)
    poison = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(n_out)]
    kw["out"] = tuple(poison) if n_out == 2 else poison[0]
    term, trunc = t(d["term"], torch.bool), t(d["trunc"], torch.bool)
    done_u8 = t(d["term"] | d["trunc"], torch.uint8)
    r, v, nv = t(d["r"]), t(d["v"]), t(d["nv"])
    if algo == "gae":
        rt.gae(r, v, bootstrap_value=row(d["boot"]), terminated=term, gamma=GAMMA, lmbda=LMBDA, **kw)
    elif algo == "gae_done":
        rt.gae(r, v, bootstrap_value=row(d["boot"]), done=done_u8, gamma=GAMMA, lmbda=LMBDA, **kw)
    elif algo == "gae_obs":
        starts = np.concatenate([np.zeros((R, 1), bool), d["term"][:, :-1]], 1)
        rt.gae(r, v, bootstrap_value=row(d["boot"]), episode_starts=t(starts.astype(np.float32), torch.float32),
               last_done=torch.from_numpy(d["term"][:, -1]).to(device), gamma=GAMMA, lmbda=LMBDA, **kw)
    elif algo == "gae_gym":
        rt.gae(r, v, next_values=nv, terminated=term, truncated=trunc, gamma=t(d["gt"]), lmbda=LMBDA, **kw)
    elif algo == "td_lambda":
        rt.td_lambda_return(r, nv, done=done_u8, terminated=term, gamma=GAMMA, lmbda=LMBDA, **kw)
    elif algo == "discounted":
        rt.discounted_return(r, terminated=term, truncated=t(d["trunc"], torch.float32), next_values=nv,
                             gamma=GAMMA, **kw)
    elif algo == "vtrace":
        rt.vtrace(r, v, t(d["lp"]), t(d["lm"]), next_values=nv, terminated=term, truncated=trunc, gamma=GAMMA,
                  lmbda=LMBDA, **kw)
    elif algo.startswith("retrace"):
        extra = (dict(next_expected_q=nv) if algo == "retrace" else dict(
            next_pi=torch.from_numpy(np.ascontiguousarray(d["pi"].transpose(1, 0, 2) if tm else d["pi"])).to(dtype).to(device),
            next_q=torch.from_numpy(np.ascontiguousarray(d["nq"].transpose(1, 0, 2) if tm else d["nq"])).to(dtype).to(device)))
        rt.retrace(r, v, t(d["lp"]), t(d["lm"]), terminated=term, truncated=trunc, gamma=GAMMA, lmbda=LMBDA,
                   **extra, **kw)
    elif algo == "eligibility":
        rt.eligibility_trace(r, done=t(d["term"] | d["trunc"], torch.float32), gamma=GAMMA, lmbda=0.9,
                             initial=row(d["boot"]), **kw)
    elif algo == "cumsum":
        rt.episodic_cumsum(r, done=term, initial=row(d["boot"]), **kw)
    else:
        rt.affine_scan(r, t(d["beta"]), reverse=algo == "scan_reverse", initial=row(d["boot"]), **kw)
    return [(p.T if tm else p).double().cpu().numpy() for p in poison]


def rel_err(y, ref):
    return float(np.max(np.abs(y - ref) / (1.0 + np.abs(ref)))) if y.size else 0.0


def check_compile_and_graphs(device):
    import rl_triton as rt

    lines = []
    torch.manual_seed(0)
    r, v = torch.randn(4096, 128, device=device), torch.randn(4096, 128, device=device)
    d = torch.rand(4096, 128, device=device) < 0.02
    g, l = np.full(r.shape, hyper(GAMMA, r.dtype)), np.full(r.shape, hyper(LMBDA, r.dtype))
    ref = oracle.gae(r.double().cpu().numpy(), v.double().cpu().numpy(),
                     oracle.implied_next_values(v.double().cpu().numpy()), d.cpu().numpy(), d.cpu().numpy(), g, l)[0]

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
        ref2 = oracle.gae(r2.double().cpu().numpy(), v.double().cpu().numpy(),
                          oracle.implied_next_values(v.double().cpu().numpy()), d.cpu().numpy(),
                          d.cpu().numpy(), g, l)[0]
        lines.append(("CUDA-graph capture + replay of gae (new inputs)", rel_err(static.double().cpu().numpy(), ref2)))
    return lines


def check_launch_cache(device):
    """Repeated calls with the same shape but other alignment and strides: the cached direct
    launches must pick the kernel Triton's dispatch would (misaligned data by a storage offset,
    transposed strides), in the single-pass and the split regimes."""
    import rl_triton as rt

    worst = 0.0
    for R, T in ((64, 300), (2, 20000)):
        g, l = np.full((R, T), hyper(GAMMA, torch.float32)), np.full((R, T), hyper(LMBDA, torch.float32))

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
            adv = rt.gae(r, v, done=d, gamma=GAMMA, lmbda=LMBDA)[0]
            vn, dn = v.double().cpu().numpy(), d.cpu().numpy()
            ref = oracle.gae(r.double().cpu().numpy(), vn, oracle.implied_next_values(vn), dn, dn, g, l)[0]
            worst = max(worst, rel_err(adv.double().cpu().numpy(), ref))
    return worst


def check_direction(device, lengths):
    import rl_triton as rt

    worst = 0.0
    for T in lengths:
        torch.manual_seed(T)
        a, b = torch.randn(64, T, device=device), torch.rand(64, T, device=device)
        for reverse in (True, False):
            y = rt.affine_scan(a, b, reverse=reverse, backend="triton").double().cpu().numpy()
            worst = max(worst, rel_err(y, oracle.affine_scan(a.double().cpu().numpy(), b.double().cpu().numpy(),
                                                            reverse=reverse)))
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (interpreter smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--shapes", help="comma-separated RxT subset of the shape list")
    args = p.parse_args()
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
    cache = check_launch_cache(device)
    print(f"{'ok  ' if cache <= 1e-5 else 'FAIL'} repeated launches across alignments and strides: rel err {cache:.1e}")
    failures += cache > 1e-5
    for name, err in check_compile_and_graphs(device):
        ok = err <= 1e-5
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.1e}")
    print(f"\n{len(rows) - sum(not r[3] for r in rows)}/{len(rows)} oracle cases passed, "
          f"{failures} failures in all, {time.time() - start:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
