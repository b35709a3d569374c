"""Time the estimators: on a GPU every algorithm on the shape grid against the floors; on a
CPU-only machine GAE on the CPU backends against SB3's and TorchRL's loops.

    python benchmarks/run.py [--algos gae,vtrace] [--shapes 4096x128,1x131072] [--md FILE]
    python benchmarks/run.py --cpu [--md FILE]

Full call: CUDA events around one call with a synchronize before and after (what a training
loop sees), median of many. Device time: median CUDA-graph replay of 20 calls, per call.
Floors, measured in the same process: device-to-device copy bandwidth (torch's copy and a
Triton copy kernel, the faster of the two) applied to the minimum bytes (each input read once,
each output written once), and the full call and replay of an empty Triton kernel.
Peers (TorchRL, torch.compile scans) join the GPU table with the performance issue.

CPU: GAE on time-major (T, N) rollouts, SB3's layout, gamma 0.99, lambda 0.95, 2% dones; the
median of repeated calls (time.perf_counter) of rl_triton's numba and torch backends, SB3's own
``RolloutBuffer.compute_returns_and_advantage`` (and the same method patched by
rl_triton.integrations.sb3) and TorchRL's ``generalized_advantage_estimate``
and ``vec_generalized_advantage_estimate`` when installed, each first checked against the float64
oracle of tests/oracle.py (a wrong result is reported, not timed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import time

import numpy as np
import torch
import triton
import triton.language as tl

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_here, ".."), os.path.join(_here, "..", "tests")]
import oracle  # noqa: E402

import rl_triton as rt  # noqa: E402

GRID = ["4096x128", "64x512", "1024x1024", "16384x512", "128x4096", "32768x8", "4096x32", "16384x16",
        "64x8192", "8x32768", "1x131072", "16384x4096", "4096x4096"]
ALGOS = ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace", "eligibility_trace",
         "episodic_cumsum"]


@triton.jit
def _empty_kernel(x):
    pass


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def full_call_us(fn, n=200):
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def device_us(fn, calls=20, reps=9):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth_tbs():
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    n = src.numel()
    torch_copy = device_us(lambda: dst.copy_(src), calls=3, reps=5)
    tri_copy = device_us(lambda: _copy_kernel[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=8),
                         calls=3, reps=5)
    return 2 * n * 4 / min(torch_copy, tri_copy) / 1e6


def problem(algo, R, T, dtype=torch.float32):
    """(callable, minimum bytes) for one estimator on an R x T rollout (2% dones)."""
    g = torch.Generator(device="cuda").manual_seed(R * 7 + T)

    def x(scale=1.0):
        return (torch.randn(R, T, device="cuda", generator=g) * scale).to(dtype)

    e = torch.tensor([], dtype=dtype).element_size()
    done = torch.rand(R, T, device="cuda", generator=g) < 0.02
    r, v, nv = x(), x(), x()
    if algo == "gae":
        return (lambda: rt.gae(r, v, done=done)), R * T * (2 * e + 1 + 2 * e)
    if algo == "td_lambda_return":
        return (lambda: rt.td_lambda_return(r, nv, done=done)), R * T * (2 * e + 1 + e)
    if algo == "discounted_return":
        return (lambda: rt.discounted_return(r, done=done)), R * T * (e + 1 + e)
    if algo == "vtrace":
        lp, lm = x(0.3), x(0.3)
        return (lambda: rt.vtrace(r, v, lp, lm, done=done)), R * T * (4 * e + 1 + 2 * e)
    if algo == "retrace":
        lp, lm = x(0.3), x(0.3)
        return (lambda: rt.retrace(r, v, lp, lm, next_expected_q=nv, done=done)), R * T * (5 * e + 1 + e)
    if algo == "eligibility_trace":
        return (lambda: rt.eligibility_trace(r, done=done, gamma=0.99, lmbda=0.9)), R * T * (e + 1 + e)
    return (lambda: rt.episodic_cumsum(r, done=done)), R * T * (e + 1 + e)


CPU_SHAPES = [(2048, 8), (2048, 1), (128, 8), (2048, 64)]


def median_us(fn, min_time=0.3, min_calls=5):
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def cpu_peers(T, N, r, v, ep_start, last_v, last_done, gamma, lam):
    """name -> callable returning time-major advantages, for the installed peers."""
    peers = {}
    try:
        import gymnasium as gym
        from stable_baselines3.common.buffers import RolloutBuffer

        buf = RolloutBuffer(T, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", gae_lambda=lam,
                            gamma=gamma, n_envs=N)
        buf.rewards[:], buf.values[:], buf.episode_starts[:] = r, v, ep_start

        import rl_triton.integrations.sb3 as rt_sb3

        def sb3(method):
            method(buf, torch.as_tensor(last_v), last_done)
            return buf.advantages

        peers["SB3 RolloutBuffer"] = lambda: sb3(RolloutBuffer.compute_returns_and_advantage)
        peers["SB3 RolloutBuffer, rl_triton patch"] = lambda: sb3(rt_sb3.compute_returns_and_advantage)
    except ImportError:
        pass
    try:
        from torchrl.objectives.value import functional as F

        done = torch.as_tensor(np.concatenate([ep_start[1:], last_done[None]], 0) != 0).T[..., None]
        vt = torch.as_tensor(v).T[..., None]
        nvt = torch.cat([vt[:, 1:], torch.as_tensor(last_v)[:, None, None]], 1)
        rt_ = torch.as_tensor(r).T[..., None]
        peers["TorchRL loop"] = lambda: F.generalized_advantage_estimate(gamma, lam, vt, nvt, rt_, done)[0][..., 0].T
        peers["TorchRL vec"] = lambda: F.vec_generalized_advantage_estimate(gamma, lam, vt, nvt, rt_, done)[0][..., 0].T
    except ImportError:
        pass
    return peers


def cpu_main(md):
    gamma, lam = 0.99, 0.95
    lines = [f"CPU: {os.cpu_count()} cores, torch {torch.__version__}; GAE, time-major (T, N), medians", "",
             "| T x N | implementation | time us | speed-up of rl_triton (cpu) | max error vs oracle |",
             "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for T, N in CPU_SHAPES:
        rng = np.random.default_rng(T * 31 + N)
        r, v = rng.standard_normal((2, T, N)).astype(np.float32)
        ep_start = (rng.random((T, N)) < 0.02).astype(np.float32)
        last_v, last_done = rng.standard_normal(N).astype(np.float32), (rng.random(N) < 0.02).astype(np.float32)
        done = np.concatenate([ep_start[1:], last_done[None]], 0)
        nv = np.concatenate([v[1:], last_v[None]], 0)
        g32, l32 = float(np.float32(gamma)), float(np.float32(lam))
        ref = oracle.gae(r.T, v.T, nv.T, done.T, done.T, np.full((N, T), g32), np.full((N, T), l32))[0].T
        tr, tv, td, tb = map(torch.as_tensor, (r, v, done != 0, last_v))
        impls = {f"rl_triton ({b})": (lambda b=b: rt.gae(tr, tv, bootstrap_value=tb, done=td, gamma=gamma, lmbda=lam,
                                                         time_dim=0, backend=b)[0])
                 for b in ("cpu", "torch") if b != "cpu" or rt.core.cpu.AVAILABLE}
        impls.update(cpu_peers(T, N, r, v, ep_start, last_v, last_done, gamma, lam))
        times = {}
        for name, fn in impls.items():
            err = float(np.max(np.abs(np.asarray(fn(), dtype=np.float64) - ref) / (1 + np.abs(ref))))
            times[name] = median_us(fn) if err < 1e-4 else float("nan")
            ours = times.get("rl_triton (cpu)", float("nan"))
            line = (f"| {T}x{N} | {name} | {times[name]:.0f} | {times[name] / ours:.1f}x | "
                    f"{err:.1e}{'' if err < 1e-4 else ' WRONG, not timed'} |")
            lines.append(line)
            print(line, flush=True)
    if md:
        with open(md, "w") as f:
            f.write("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--shapes", default=",".join(GRID))
    p.add_argument("--cpu", action="store_true", help="CPU benchmark (the default without CUDA)")
    p.add_argument("--md", help="also write the table to this markdown file")
    args = p.parse_args()
    if args.cpu or not torch.cuda.is_available():
        return cpu_main(args.md)
    bw = copy_bandwidth_tbs()
    x = torch.empty(1, device="cuda")
    empty_full = full_call_us(lambda: _empty_kernel[(1,)](x))
    empty_dev = device_us(lambda: _empty_kernel[(1,)](x))
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
             f"Copy bandwidth (read + write): {bw:.2f} TB/s; empty Triton kernel: full call {empty_full:.1f} us, "
             f"replay {empty_dev:.2f} us", "",
             "| algorithm | rows x T | full call us | device us | floor us | floor / device |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for algo in args.algos.split(","):
        for shape in args.shapes.split(","):
            R, T = map(int, shape.split("x"))
            fn, nbytes = problem(algo, R, T)
            floor = nbytes / (bw * 1e6)
            full, dev = full_call_us(fn), device_us(fn)
            line = f"| {algo} | {R}x{T} | {full:.1f} | {dev:.2f} | {floor:.2f} | {floor / dev:.0%} |"
            lines.append(line)
            print(line, flush=True)
            del fn
            torch.cuda.empty_cache()
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
