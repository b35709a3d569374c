"""Token-level credit assignment against the LLM frameworks' loops, side by side in one process.

Batches of responses with random lengths (EOS padding masked), 10% of the tokens masked in
spans (tool output), a score on each response's last token plus small per-token rewards. Rows:

- verl's GAE step (its loop and masked_whiten, transcribed in rl_triton/testing/frameworks.py)
  against ``rl_triton.gae(mask=..., mask_mode="skip", whiten=True)``, padded ``[B, L]`` and
  packed (``cu_seqlens``);
- on CUDA, the device time of the call (CUDA-graph replay: the kernels alone) against the copy
  floor of its minimal bytes (the rewards, values and mask read once, advantages and returns
  written once), measured in the same run with a ``copy_`` of as many bytes, and the device time
  of the GAE scan alone (``gae(mask=...)``, no whitening);
- group advantages (GRPO) for responses in groups of 8-16 against verl's
  ``compute_grpo_outcome_advantage`` loop;
- the verl drop-in's ``compute_gae_advantage_return`` (what the patched trainer calls, a float
  mask as verl passes it) against verl's function (``--verl BxL``);
- GAE with KL shaping inside the scan (``gae(..., kl=dict(...))``) against the same GAE alone,
  per mask mode and estimator (``--kl BxL``): device time on CUDA, wall time on CPU, the first
  rows checked against the float64 oracle (a mismatch ends the run).

    python benchmarks/token_level.py                       # CPU (numba), 256x4096 and smaller
    python benchmarks/token_level.py --device cuda         # the H200 shapes
    python benchmarks/token_level.py --device cuda --kl 1024x8192 --dtypes float32,bfloat16 \
        --no-gae --groups 0 --verl ''          # KL shaping against GAE alone
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rl_triton as rt  # noqa: E402
from rl_triton.testing import frameworks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, machine, parser, ratios, spread  # noqa: E402

GAMMA, LAM = 1.0, 0.95


def batch(B, L, dtype, device, seed=0):
    """rewards, values, mask [B, L] and the packed form (tokens up to each response's end)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(L // 4, L + 1, (B,), generator=g)
    lengths[0] = L
    t = torch.arange(L)
    mask = t[None, :] < lengths[:, None]
    for _ in range(max(1, L // 640)):  # spans of 8-64 tokens: about 10% of the tokens
        start = torch.randint(0, L, (B,), generator=g)
        width = torch.randint(8, 65, (B,), generator=g)
        mask &= ~((t[None, :] >= start[:, None]) & (t[None, :] < (start + width)[:, None]))
    rewards = 0.01 * torch.randn(B, L, generator=g)
    rewards[torch.arange(B), lengths - 1] += torch.randn(B, generator=g)
    values = torch.randn(B, L, generator=g)
    rewards, values = rewards * mask, values * mask
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    within = t[None, :] < lengths[:, None]
    packed = [x[within] for x in (rewards, values, mask)]
    to = dict(device=device)
    return ([rewards.to(dtype=dtype, **to), values.to(dtype=dtype, **to), mask.to(**to)],
            [packed[0].to(dtype=dtype, **to), packed[1].to(dtype=dtype, **to), packed[2].to(**to), cu.to(**to)])


def ours(r, v, m, cu=None, max_seqlen=None):
    return rt.gae(r, v, mask=m, gamma=GAMMA, lmbda=LAM, whiten=True, cu_seqlens=cu, max_seqlen=max_seqlen)


def verl(r, v, m):
    return frameworks.verl_compute_gae_advantage_return(r, v, m.to(r.dtype), GAMMA, LAM)


def check(got, want, tol):
    for g, w in zip(got, want):
        err = (g.double() - w.double()).abs().max().item() / max(1.0, w.double().abs().max().item())
        if not err <= tol:
            raise SystemExit(f"mismatch against verl: relative error {err:.1e} > {tol:.0e}")


def device_us(fn, reps=20):
    """Device time per call: CUDA-event time of ``reps`` replays of a CUDA graph holding one call
    (no host time between the kernels), median of 5 batches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def gae_rows(shapes, dtypes, device, rounds):
    print(f"\nGAE step (skip mask, whitened advantages), gamma={GAMMA}, lambda={LAM}; times per call, "
          f"median (lowest-highest) of {rounds} alternating rounds")
    print("| B x L | dtype | verl loop ms | rl_triton padded ms | rl_triton packed ms | padded speed-up | "
          "packed speed-up |" + (" device us | GAE scan alone, device us | copy floor us | device / floor |"
                             if device == "cuda" else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|---|---|" if device == "cuda" else ""))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for B, L in shapes:
        for dtype in dtypes:
            (r, v, m), (rp, vp, mp, cu) = batch(B, L, dtype, device)
            rf, vf = r.float(), v.float()
            want = verl(rf, vf, m)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            check(ours(r, v, m), want, tol)
            within = torch.arange(L, device=device)[None, :] < (cu[1:] - cu[:-1]).to(device)[:, None]
            got_p = ours(rp, vp, mp, cu, L)
            check(got_p, [want[0][within], want[1][within]], tol)

            def timed(fn):
                def call():
                    fn()
                    sync()
                return call
            impls = {"verl": timed(lambda: verl(rf, vf, m)), "padded": timed(lambda: ours(r, v, m)),
                     "packed": timed(lambda: ours(rp, vp, mp, cu, L))}
            t = alternate(impls, rounds=rounds, batch_s=0.05)
            row = (f"| {B}x{L} | {str(dtype)[6:]} | {spread([x * 1e3 for x in t['verl']], '{:.1f}')} | "
                   f"{spread([x * 1e3 for x in t['padded']], '{:.2f}')} | "
                   f"{spread([x * 1e3 for x in t['packed']], '{:.2f}')} | "
                   f"{spread(ratios(t['verl'], t['padded']), '{:.0f}', 'x')} | "
                   f"{spread(ratios(t['verl'], t['packed']), '{:.0f}', 'x')} |")
            if device == "cuda":
                nbytes = r.numel() * (2 * r.element_size() + 1 + 2 * r.element_size())
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                dev = device_us(lambda: ours(r, v, m))
                scan = device_us(lambda: rt.gae(r, v, mask=m, gamma=GAMMA, lmbda=LAM))
                floor = device_us(lambda: dst.copy_(src))
                row += f" {dev:.1f} | {scan:.1f} | {floor:.1f} | {dev / floor:.2f}x |"
            print(row, flush=True)


def group_rows(n, device, rounds):
    print(f"\nGroup advantages (GRPO), {n} responses in groups of 8-16, shuffled; string ids (numpy) for "
          "verl's loop; rl_triton with int64 ids on the device and with the string ids")
    g = torch.Generator().manual_seed(1)
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(torch.randint(8, 17, (1,), generator=g)))
    ids = np.repeat(np.arange(len(sizes)), sizes)[:n]
    perm = torch.randperm(n, generator=g).numpy()
    ids = ids[perm]
    uid = np.array([f"prompt-{i}" for i in ids], dtype=object)
    scores = torch.randn(n, 1, generator=g)
    mask = torch.ones(n, 1)
    want = frameworks.verl_grpo(scores.clone(), mask, uid)[:, 0]
    ids_t = torch.as_tensor(ids, device=device)
    s = scores[:, 0].to(device)
    got = rt.group_advantages(s, ids_t, mode="grpo")
    check([got.cpu()], [want], 1e-5)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn):
        def call():
            fn()
            sync()
        return call
    t = alternate({"verl": timed(lambda: frameworks.verl_grpo(scores.clone(), mask, uid)),
                   "ids": timed(lambda: rt.group_advantages(s, ids_t, mode="grpo")),
                   "uid": timed(lambda: rt.group_advantages(s, uid, mode="grpo"))}, rounds=rounds, batch_s=0.05)
    print("| verl loop ms | rl_triton, tensor ids, ms | rl_triton, string ids, ms | speed-up (tensor ids) | "
          "speed-up (string ids) |" + (" device us |" if device == "cuda" else ""))
    print("|---|---|---|---|---|" + ("---|" if device == "cuda" else ""))
    row = (f"| {spread([x * 1e3 for x in t['verl']], '{:.1f}')} | {spread([x * 1e3 for x in t['ids']], '{:.3f}')} | "
           f"{spread([x * 1e3 for x in t['uid']], '{:.3f}')} | {spread(ratios(t['verl'], t['ids']), '{:.0f}', 'x')} | "
           f"{spread(ratios(t['verl'], t['uid']), '{:.0f}', 'x')} |")
    if device == "cuda":
        row += f" {device_us(lambda: rt.group_advantages(s, ids_t, mode='grpo')):.1f} |"
    print(row)


def verl_rows(shapes, device, rounds):
    from rl_triton.integrations import verl as rt_verl

    print(f"\nverl's compute_gae_advantage_return against the drop-in's, {rounds} alternating rounds")
    print("| B x L | verl ms | drop-in ms | speed-up |")
    print("|---|---|---|---|")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for B, L in shapes:
        (r, v, m), _ = batch(B, L, torch.float32, device)
        mf = m.float()
        check(rt_verl.compute_gae_advantage_return(r, v, mf, GAMMA, LAM),
              frameworks.verl_compute_gae_advantage_return(r, v, mf, GAMMA, LAM), 1e-5)

        def timed(fn):
            def call():
                fn()
                sync()
            return call
        t = alternate({"verl": timed(lambda: frameworks.verl_compute_gae_advantage_return(r, v, mf, GAMMA, LAM)),
                       "ours": timed(lambda: rt_verl.compute_gae_advantage_return(r, v, mf, GAMMA, LAM))},
                      rounds=rounds, batch_s=0.05)
        print(f"| {B}x{L} | {spread([x * 1e3 for x in t['verl']], '{:.1f}')} | "
              f"{spread([x * 1e3 for x in t['ours']], '{:.2f}')} | "
              f"{spread(ratios(t['verl'], t['ours']), '{:.0f}', 'x')} |")


KL_COEF = 0.05


def kl_rows(shapes, dtypes, device, rounds):
    """GAE with KL shaping against GAE alone, per mask mode and estimator."""
    from rl_triton.testing import oracle

    print(f"\nGAE with KL shaping in the scan against GAE alone (coef {KL_COEF}); "
          + ("device us (CUDA-graph replay)" if device == "cuda" else f"ms per call, median of {rounds} rounds"))
    print("| B x L | dtype | mask mode | estimator | GAE alone | GAE with KL | ratio |"
          + (" copy floor alone us | copy floor with KL us | floor ratio |" if device == "cuda" else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if device == "cuda" else ""))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for B, L in shapes:
        for dtype in dtypes:
            (r, v, m), _ = batch(B, L, dtype, device)
            g = torch.Generator().manual_seed(2)
            lp = (-3 * torch.rand(B, L, generator=g)).to(dtype=dtype, device=device)
            ref = (lp.float().cpu() + 0.5 * torch.randn(B, L, generator=g)).to(dtype=dtype, device=device)
            for mode in ("skip", "pad", None):
                masked = {} if mode is None else dict(mask=m, mask_mode=mode)
                for estimator in ("k1", "k3"):
                    kl = dict(log_probs=lp, ref_log_probs=ref, coef=KL_COEF, estimator=estimator)

                    def alone():
                        return rt.gae(r, v, gamma=GAMMA, lmbda=LAM, **masked)

                    def shaped():
                        return rt.gae(r, v, gamma=GAMMA, lmbda=LAM, kl=kl, **masked)
                    rows = slice(0, 4)  # rows are independent: the first few against the oracle
                    f64 = [x[rows].double().cpu().numpy() for x in (r, v, lp, ref)]
                    shaped_rewards = oracle.kl_shaped_rewards(f64[0], f64[2], f64[3], KL_COEF, estimator)
                    g, lam = np.full(f64[0].shape, GAMMA), np.full(f64[0].shape, LAM)
                    if mode is None:
                        zeros = np.zeros(f64[0].shape)
                        want = oracle.gae(shaped_rewards, f64[1], oracle.implied_next_values(f64[1]), zeros, zeros,
                                          g, lam)
                    else:
                        want = oracle.gae_masked(shaped_rewards, f64[1], m[rows].cpu().numpy(), g, lam, mode=mode)
                    tol = 1e-4 if dtype == torch.float32 else 3e-2
                    for got, w in zip(shaped(), want):
                        err = np.abs(got[rows].double().cpu().numpy() - w).max() / max(1.0, np.abs(w).max())
                        if not err <= tol:
                            raise SystemExit(f"KL-shaped GAE ({mode}, {estimator}, {dtype}) does not match the "
                                             f"oracle: relative error {err:.1e} > {tol:.0e}")
                    if device == "cuda":
                        a, b = device_us(alone), device_us(shaped)
                        # the minimal bytes: rewards, values (and the mask) read and two outputs written
                        # once, and with KL the two log-prob tensors read too
                        floors = []
                        for extra in (0, 2 * lp.element_size()):
                            nbytes = r.numel() * (4 * r.element_size() + (0 if mode is None else 1) + extra)
                            src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
                            dst = torch.empty_like(src)
                            floors.append(device_us(lambda: dst.copy_(src)))
                        cells = (f"{a:.1f} | {b:.1f} | {b / a:.3f}x | {floors[0]:.1f} | {floors[1]:.1f} | "
                                 f"{floors[1] / floors[0]:.3f}x")
                    else:
                        t = alternate({"alone": lambda: (alone(), sync()), "kl": lambda: (shaped(), sync())},
                                      rounds=rounds, batch_s=0.05)
                        a, b = statistics.median(t["alone"]) * 1e3, statistics.median(t["kl"]) * 1e3
                        cells = f"{a:.2f} | {b:.2f} | {b / a:.3f}x"
                    print(f"| {B}x{L} | {str(dtype)[6:]} | {mode or 'none'} | {estimator} | {cells} |", flush=True)


def main():
    p = parser(__doc__)
    p.add_argument("--device", default="cpu", help="cpu (numba) or cuda (Triton)")
    p.add_argument("--shapes", default=None, help="comma-separated BxL (default: per device)")
    p.add_argument("--dtypes", default="float32", help="comma-separated value dtypes")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--groups", type=int, default=8192, help="responses in the group-advantage row (0: none)")
    p.add_argument("--verl", default="64x2048", help="comma-separated BxL of the verl drop-in rows ('': none)")
    p.add_argument("--kl", default="", help="comma-separated BxL of the KL-shaping rows ('': none)")
    p.add_argument("--no-gae", action="store_true", help="leave out the GAE step rows")
    args = p.parse_args()
    default = "256x1024,1024x4096,1024x8192,256x32768" if args.device == "cuda" else "64x2048,256x4096"
    shapes = [tuple(map(int, s.split("x"))) for s in (args.shapes or default).split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {__import__('triton').__version__}")
    else:
        print(f"CPU: {machine()}")
    start = time.time()
    if not args.no_gae:
        gae_rows(shapes, dtypes, args.device, args.rounds)
    if args.groups:
        group_rows(args.groups, args.device, args.rounds)
    if args.verl:
        verl_rows([tuple(map(int, s.split("x"))) for s in args.verl.split(",")], args.device, args.rounds)
    if args.kl:
        kl_rows([tuple(map(int, s.split("x"))) for s in args.kl.split(",")], dtypes, args.device, args.rounds)
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
