"""GAE over a sequence split along time across ranks: the sharded call against all-gather-then-scan.

Each rank holds T/W steps of every row (rewards, values, done flags; one time-major rollout cut
along time): with ``--layout contiguous`` one chunk, rank k's the k-th; with ``--layout zigzag``
Megatron-LM's context-parallel split, the window cut into 2W pieces and rank k holding pieces k
and 2W-1-k (``rl_triton.Shards.zigzag``). Rows of the table, per shape, timed side by side in one
run (every rank runs the same calls in lock step; a call's time is that of the slowest rank):

- ``sharded``: ``rl_triton.gae(..., group=group)`` on the chunk (rl_triton/core/sharded.py), with
  ``group=rl_triton.Shards.zigzag(group)`` for the zig-zag layout;
- ``all-gather``: what frameworks do today (slime under context parallelism): all-gather every
  input's chunks, put the pieces in time order into the whole sequence, run ``rl_triton.gae`` on
  it, keep this rank's pieces;
- ``local``: ``rl_triton.gae`` on the chunk alone, no collective (the scan a rank cannot avoid);
- ``collective``: one all-gather of as many bytes as the sharded call's map exchange (its fixed
  cost);
- ``sharded, graph`` (CUDA): the sharded call captured in a CUDA graph (its collective included)
  and replayed: its device work without the host path.

The bound of a sharded call is the chunk's own scan plus one all-gather of the maps (``local +
collective``). On CUDA, ``launches`` counts the device operations (kernels, copies, fills) the
profiler records for one repeated call of each way. A sharded call whose result differs from the
baseline's or, where the window has at most ``ORACLE_STEPS`` steps in all, from the float64 oracle
(rl_triton/testing/oracle.py) on the rank's steps (relative to 1 + |expected|: 1e-4 in float32,
1e-10 in float64) fails the run.

With ``--layout slime``, each row of a shape is one response of T tokens after a prompt of
``--prompt`` tokens, split as slime splits it under context parallelism (the sequence cut into 2W
pieces, a response token in the piece of the logits that score it; no done flags), and the rows
are:

- ``sharded``: ``rl_triton.integrations.slime.context_parallel_gae`` on the rank's pieces (what
  ``get_advantages_and_returns_batch`` runs once patched): one sharded call;
- ``slime``: slime's own path, transcribed (rl_triton/testing/frameworks.py: each response's
  values and rewards all-reduced from zero-padded pieces, its chunked-matmul GAE on the whole
  batch on every rank, the rank's pieces sliced back out);
- ``slime + drop-in``: the same with rl_triton's ``chunked_gae`` drop-in as its scan (the
  context-parallel path before the sharded call).

``--estimator reinforce++`` times REINFORCE++'s returns the same way: ``sharded`` is
``context_parallel_reinforce_plus_plus_returns`` (the drop-in ``get_reinforce_plus_plus_returns``
once patched), ``slime`` its transcribed ``get_reinforce_plus_plus_returns`` (each response's KL
all-reduced, the token rewards and the chunked-matmul discounted return of the whole batch on
every rank, the pieces sliced back out), ``slime + drop-in`` that with the
``chunked_discounted_returns`` drop-in.

Bytes are those each rank hands to the collectives per call (all-gathers and all-reduces). With no launcher, the script
spawns ``--world`` processes itself (gloo on the CPU, or NCCL with one GPU each); under
``torchrun`` it takes the launcher's world.

    python benchmarks/distributed.py --world 4                          # gloo, CPU, 4 ranks
    python benchmarks/distributed.py --world 4 --layout zigzag --shapes 8x131072   # zig-zag shards
    python benchmarks/distributed.py --world 2 --layout slime --shapes 8x131072      # slime's CP path
    python benchmarks/distributed.py --world 2 --layout slime --estimator reinforce++ --shapes 8x131072
    python benchmarks/distributed.py --world 1 --device cuda            # NCCL, one GPU
    torchrun --nproc_per_node 2 benchmarks/distributed.py --device cuda # NCCL, two GPUs
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, parser, spread  # noqa: E402

SHAPES = "256x32768,64x131072,8x1048576"
WAYS = ("sharded", "all-gather", "local", "collective")
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
ORACLE_STEPS = 1 << 21  # the oracle (a Python loop over every step) checks windows up to this size


def held(layout: str, world: int) -> list:
    """The pieces (global indices in time order) each rank holds, in its local order."""
    if layout == "zigzag":
        return [[k, 2 * world - 1 - k] for k in range(world)]
    return [[k] for k in range(world)]


def _piece(B, steps, index, dtype, seed):
    """Piece ``index`` of the rollout: rewards, values, done ([steps, B]), from its own seed."""
    g = torch.Generator().manual_seed(seed * 1000 + index)
    return (torch.randn(steps, B, generator=g, dtype=dtype), torch.randn(steps, B, generator=g, dtype=dtype),
            torch.rand(steps, B, generator=g) < 0.001)


def _chunk(B, T, pieces, rank, dtype, device, seed=0):
    """This rank's steps of rewards, values, done (time-major, [Tk, B]: its pieces of ``pieces``
    in its order) and the bootstrap value; every piece drawn from its own seed, so the pieces of
    all ranks make up one rollout."""
    steps = T // sum(len(p) for p in pieces)
    parts = [_piece(B, steps, i, dtype, seed) for i in pieces[rank]]
    boot = torch.randn(B, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return [x.to(device) for x in (*(torch.cat(xs) for xs in zip(*parts)), boot)]


def oracle_error(got, B, T, pieces, rank, dtype, seed=0) -> float:
    """The largest relative difference of ``got`` (this rank's outputs) from the float64 oracle on
    this rank's steps of the whole rollout."""
    from rl_triton.testing import catalog

    n = sum(len(p) for p in pieces)
    r, v, d = (torch.cat(xs) for xs in zip(*(_piece(B, T // n, i, dtype, seed) for i in range(n))))
    boot = torch.randn(B, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    want = catalog.reference("gae", (r, v), dict(done=d, bootstrap_value=boot, time_dim=0))
    mine = torch.tensor(pieces[rank])
    return relative_error(got, [torch.from_numpy(w).view(n, T // n, B)[mine].reshape(-1, B) for w in want])


class Counter:
    """Bytes handed to all-gathers and all-reduces while ``on``."""

    def __init__(self, dist):
        self.on, self.bytes = False, 0
        gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        for name, local_at in ((gather, 1), ("all_reduce", 0)):
            setattr(dist, name, self._counted(getattr(dist, name), local_at))

    def _counted(self, original, local_at):
        def counted(*args, **kwargs):
            if self.on:
                self.bytes += args[local_at].numel() * args[local_at].element_size()
            return original(*args, **kwargs)
        return counted


def _ways(rt, dist, group, world, chunk, gather_bytes, pieces):
    r, v, d, boot = chunk
    n = sum(len(p) for p in pieces)
    layout = group if n == world else rt.Shards(group, pieces)
    mine = torch.tensor(pieces[dist.get_rank(group)], device=r.device)
    # the gathered pieces (rank order, each rank's in its order) in time order
    order = torch.tensor(sorted(range(n), key=lambda j: [i for p in pieces for i in p][j]), device=r.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fixed = torch.empty(max(1, gather_bytes // 4), dtype=torch.float32, device=r.device)
    fixed_out = torch.empty(world * fixed.numel(), dtype=torch.float32, device=r.device)

    def sharded():
        return rt.gae(r, v, done=d, bootstrap_value=boot, time_dim=0, group=layout)

    def all_gather():
        whole = []
        for x in (r, v, d):
            out = torch.empty((world * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
            gather(out, x, group=group)  # time-major chunks in rank order
            if n > world:  # the pieces in time order: the whole sequence
                out = out.view(n, -1, x.shape[1]).index_select(0, order).view(out.shape)
            whole.append(out)
        adv, ret = rt.gae(whole[0], whole[1], done=whole[2], bootstrap_value=boot, time_dim=0)
        if n == world:
            lo = dist.get_rank(group) * r.shape[0]
            return adv[lo:lo + r.shape[0]], ret[lo:lo + r.shape[0]]
        return tuple(x.view(n, -1, x.shape[1]).index_select(0, mine).view(r.shape) for x in (adv, ret))

    def local():
        return rt.gae(r, v, done=d, bootstrap_value=boot, time_dim=0)

    def collective():
        gather(fixed_out, fixed, group=group)

    return {"sharded": sharded, "all-gather": all_gather, "local": local, "collective": collective}


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream), as a replay;
    None and the reason where capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - reported in the table
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:120]
    return graph.replay, None


def launches(fn) -> int:
    """Device operations (kernels, copies, fills) the CUDA profiler records for one call of ``fn``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def relative_error(got, want) -> float:
    """The largest |got - want| / (1 + |want|) over the outputs (on the CPU: the oracle's are
    there, a GPU run's on the GPU)."""
    pairs = ((g.double().cpu(), w.double().cpu()) for g, w in zip(got, want))
    return max(((g - w).abs() / (1 + w.abs())).max().item() for g, w in pairs)


def failures(rows, dtype: str) -> list:
    """The shapes whose sharded result is off the baseline's, or the oracle's (None: not checked),
    by more than the tolerance."""
    return [shape for shape, _, _, _, err, _, _, oracle in rows
            if not err <= TOLERANCE[dtype] or (oracle is not None and not oracle <= TOLERANCE[dtype])]


def _time(fn, calls, dist, group, device):
    """Seconds per call of the slowest rank over ``calls`` back-to-back calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.barrier(group)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    took = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return float(took)


def slime_sequences(B, T, prompt, dtype, seed=0):
    """``B`` whole responses of ``T`` tokens after prompts of ``prompt``: total and response
    lengths, rewards, values (float ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    rewards = [torch.randn(T, generator=g).to(dtype) for _ in range(B)]
    values = [torch.randn(T, generator=g).to(dtype) for _ in range(B)]
    return [prompt + T] * B, [T] * B, rewards, values


def _slime_ways(dist, group, world, B, T, prompt, dtype, device, estimator="gae", gamma=1.0):
    """The ways of ``--layout slime`` on this rank's pieces, each giving a tuple of lists of
    per-response outputs, and the float64 oracle's first output of them."""
    import numpy as np

    import rl_triton.integrations.slime as rt_slime
    from rl_triton.testing import frameworks, oracle

    rank = dist.get_rank(group)
    totals, lengths, rewards, values = slime_sequences(B, T, prompt, dtype)

    def mine(x, t, n):
        return frameworks.slime_slice_log_prob_with_cp(x, t, n, rank, world).to(device)

    local_r, local_v = ([mine(x, t, n) for x, t, n in zip(xs, totals, lengths)] for xs in (rewards, values))
    lambd = 0.95
    if estimator == "reinforce++":
        return _slime_rpp_ways(rank, world, group, totals, lengths, rewards, local_r, gamma, dtype, device, mine)

    def want():
        r, v = (torch.stack(xs).double().numpy() for xs in (rewards, values))
        zeros, ones = np.zeros_like(r), np.ones_like(r)
        adv, _ = oracle.gae(r, v, oracle.implied_next_values(v), zeros, zeros, gamma * ones, lambd * ones)
        return [mine(torch.from_numpy(np.asarray(a)), t, n) for a, t, n in zip(adv, totals, lengths)]

    def sharded():
        return rt_slime.context_parallel_gae(totals, lengths, local_v, local_r, gamma, lambd, group=group)

    def slime(scans=None):
        return frameworks.slime_get_advantages_and_returns_batch(totals, lengths, local_v, local_r, gamma, lambd,
                                                                 rank, world, group, scans=scans)

    return {"sharded": sharded, "slime": slime, "slime + drop-in": lambda: slime(rt_slime)}, want


def _slime_rpp_ways(rank, world, group, totals, lengths, kl, local_kl, gamma, dtype, device, mine):
    """``--estimator reinforce++``: the ways on this rank's pieces of the per-token KL ``kl``
    (loss masks off on about a tenth of the tokens, one reward per response), and the float64
    oracle's returns."""
    import numpy as np

    import rl_triton.integrations.slime as rt_slime
    from rl_triton.testing import frameworks, oracle

    g = torch.Generator().manual_seed(1)
    masks = [(torch.rand(n, generator=g) > 0.1).int().to(device) for n in lengths]
    seq_rewards = torch.randn(len(lengths), generator=g).to(dtype).to(device)
    kl_coef = 0.05
    args = (seq_rewards, local_kl, masks, lengths, totals, kl_coef, gamma)

    def want():
        out = []
        for reward, x, m, t, n in zip(seq_rewards.tolist(), kl, masks, totals, lengths):
            keep = m.cpu().numpy() != 0
            r = -kl_coef * x.double().numpy() * keep
            r[np.nonzero(keep)[0][-1]] += reward
            zeros = np.zeros_like(r[None])
            out.append(mine(torch.from_numpy(np.asarray(oracle.discounted_return(r[None], zeros, zeros,
                                                                                 gamma + zeros))[0]), t, n))
        return out

    def sharded():
        return (rt_slime.context_parallel_reinforce_plus_plus_returns(*args, group=group),)

    def slime(scans=None):
        return (frameworks.slime_get_reinforce_plus_plus_returns(*args, rank, world, group, scans=scans),)

    return {"sharded": sharded, "slime": slime, "slime + drop-in": lambda: slime(rt_slime)}, want


def slime_worker(rank, world, group, dist, counter, args, device):
    """``--layout slime``: per shape, the ways' bytes and results checked, then timed in rounds."""
    dtype = getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes.split(","):
        B, T = (int(n) for n in shape.split("x"))
        ways, want = _slime_ways(dist, group, world, B, T, args.prompt, dtype, device, args.estimator, args.gamma)
        sent = {}
        results = {}
        for way, fn in ways.items():
            counter.on, counter.bytes = True, 0
            results[way] = fn()
            counter.on = False
            sent[way] = counter.bytes
        def diff(got, expected):  # 0 where the rank holds no token
            got, expected = torch.cat(got), torch.cat(expected)
            return relative_error([got], [expected]) if got.numel() else 0.0

        err = torch.tensor([max(diff(a, b) for a, b in zip(results["sharded"], results["slime"]))],
                           dtype=torch.float64)
        oracle = None
        if B * T <= ORACLE_STEPS:
            err = torch.cat([err, torch.tensor([diff(results["sharded"][0], want())], dtype=torch.float64)])
        dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
        if B * T <= ORACLE_STEPS:
            oracle = float(err[1])
        calls = max(1, min(args.max_calls, int(args.batch_s / max(_time(ways["slime"], 1, dist, group, device),
                                                                   1e-6))))
        names = tuple(ways)
        times = {way: [] for way in names}
        for k in range(args.rounds):
            for way in names[k % len(names):] + names[:k % len(names)]:
                times[way].append(_time(ways[way], calls, dist, group, device))
        rows.append((shape, times, sent, float(err[0]), oracle))
    if rank == 0:
        _slime_report(rows, world, args, device)


def _slime_report(rows, world, args, device):
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    what = "REINFORCE++ returns" if args.estimator == "reinforce++" else "GAE"
    print(f"\nslime's context-parallel {what} over {world} rank(s) ({'NCCL' if device.type == 'cuda' else 'gloo'}, "
          f"{where}), responses after prompts of {args.prompt} tokens, gamma {args.gamma}, {args.dtype}, median ms "
          f"per call of the slowest rank (lowest-highest of {args.rounds} rounds)\n")
    print("| B x T | sharded | slime | slime + drop-in | slime / sharded | bytes per rank: sharded | slime | "
          "max relative diff from slime | vs oracle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, times, sent, err, oracle in rows:
        ms = {way: spread([t * 1e3 for t in ts], "{:.3f}") for way, ts in times.items()}
        speedup = [a / s for a, s in zip(times["slime"], times["sharded"])]
        print(f"| {shape} | {ms['sharded']} | {ms['slime']} | {ms['slime + drop-in']} | "
              f"{spread(speedup, '{:.1f}', 'x')} | {sent['sharded']} | {sent['slime']} | {err:.1e} | "
              f"{'-' if oracle is None else f'{oracle:.1e}'} |")
    bad = [shape for shape, _, _, err, oracle in rows
           if not err <= TOLERANCE[args.dtype] or (oracle is not None and not oracle <= TOLERANCE[args.dtype])]
    if bad:
        print(f"FAILED: the sharded result differs from slime's at {', '.join(bad)}", file=sys.stderr)
        sys.exit(1)


def worker(rank, world, port, args):
    import torch.distributed as dist

    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank % max(1, torch.cuda.device_count())}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    import rl_triton as rt

    counter = Counter(dist)
    if args.layout == "slime":
        try:
            slime_worker(rank, world, group, dist, counter, args, device)
        finally:
            dist.destroy_process_group()
        return
    dtype = getattr(torch, args.dtype)
    rows = []
    try:
        for shape in args.shapes.split(","):
            B, T = (int(n) for n in shape.split("x"))
            pieces = held(args.layout, world)
            chunk = _chunk(B, T, pieces, rank, dtype, device)
            # the sharded call's bytes, counted on one call; and its result against the baseline's
            counter.on, counter.bytes = True, 0
            got = _ways(rt, dist, group, world, chunk, 4, pieces)["sharded"]()
            counter.on = False
            sent = counter.bytes
            ways = _ways(rt, dist, group, world, chunk, sent // 2, pieces)
            counter.on, counter.bytes = True, 0
            want = ways["all-gather"]()
            counter.on = False
            gathered = counter.bytes
            err = relative_error(got, want)
            oracle = None
            if B * T <= ORACLE_STEPS:
                oracle = torch.tensor([oracle_error(got, B, T, pieces, rank, dtype)], dtype=torch.float64,
                                      device=device)
                dist.all_reduce(oracle, op=dist.ReduceOp.MAX, group=group)
                oracle = float(oracle)
            for fn in ways.values():  # compile and warm up
                fn()
            counts, note = {}, None
            if device.type == "cuda":
                counts = {way: launches(ways[way]) for way in ("sharded", "all-gather", "local")}
                replay, note = _graphed(ways["sharded"])
                if replay is not None:
                    ways["sharded, graph"] = replay
            calls = max(1, min(args.max_calls, int(args.batch_s / max(_time(ways["all-gather"], 1, dist, group,
                                                                                device), 1e-6))))
            names = tuple(ways)
            times = {way: [] for way in names}
            for k in range(args.rounds):
                for way in names[k % len(names):] + names[:k % len(names)]:
                    times[way].append(_time(ways[way], calls, dist, group, device))
            rows.append((shape, times, sent, gathered, err, counts, note, oracle))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _report(rows, world, args, device)


def _report(rows, world, args, device):
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    print(f"\nGAE over T split across {world} rank(s) ({'NCCL' if device.type == 'cuda' else 'gloo'}, {where}), "
          f"{args.layout} layout, {args.dtype}, median ms per call of the slowest rank (lowest-highest of {args.rounds} rounds)\n")
    print("| B x T | sharded | sharded, graph | all-gather | local | collective | bound: local + collective | "
          "sharded / bound | all-gather / sharded | launches: sharded / all-gather / local | "
          "bytes per rank: sharded | all-gather | max relative diff | vs oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, times, sent, gathered, err, counts, note, oracle in rows:
        ms = {way: spread([t * 1e3 for t in ts], "{:.3f}") for way, ts in times.items()}
        bound = [lo + c for lo, c in zip(times["local"], times["collective"])]
        speedup = [a / s for a, s in zip(times["all-gather"], times["sharded"])]
        floor = [s / b for s, b in zip(times["sharded"], bound)]
        B = int(shape.split("x")[0])
        graph = ms.get("sharded, graph", "-" if note is None else f"({note})")
        count = " / ".join(str(counts[w]) for w in ("sharded", "all-gather", "local")) if counts else "-"
        print(f"| {shape} | {ms['sharded']} | {graph} | {ms['all-gather']} | {ms['local']} | {ms['collective']} | "
              f"{spread([b * 1e3 for b in bound], '{:.3f}')} | {spread(floor, '{:.2f}', 'x')} | "
              f"{spread(speedup, '{:.1f}', 'x')} | {count} | {sent} ({sent / B:.0f} B/row) | {gathered} | "
              f"{err:.1e} | {'-' if oracle is None else f'{oracle:.1e}'} |")
    print(f"\nmedian of all-gather / sharded at {rows[-1][0]}: "
          f"{statistics.median(a / s for a, s in zip(rows[-1][1]['all-gather'], rows[-1][1]['sharded'])):.1f}x")
    bad = failures(rows, args.dtype)
    if bad:
        print(f"FAILED: the sharded result differs from the baseline's at {', '.join(bad)}", file=sys.stderr)
        sys.exit(1)


def main():
    p = parser(__doc__)
    p.add_argument("--world", type=int, default=4, help="ranks to spawn when not under torchrun")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo on the CPU or NCCL on GPUs")
    p.add_argument("--shapes", default=SHAPES, help="comma-separated BxT (T divisible by the pieces: W, or 2W)")
    p.add_argument("--layout", choices=("contiguous", "zigzag", "slime"), default="contiguous",
                   help="one chunk per rank in rank order, Megatron's pieces k and 2W-1-k, or slime's "
                        "context-parallel GAE (rows: responses)")
    p.add_argument("--estimator", choices=("gae", "reinforce++"), default="gae",
                   help="--layout slime: GAE (get_advantages_and_returns_batch) or REINFORCE++'s returns "
                        "(get_reinforce_plus_plus_returns)")
    p.add_argument("--gamma", type=float, default=1.0, help="--layout slime: the discount (slime's default 1)")
    p.add_argument("--prompt", type=int, default=512, help="--layout slime: the prompt length before each response")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="float dtype")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the side-by-side timing")
    p.add_argument("--batch-s", type=float, default=0.3, help="seconds of calls per timed batch (about)")
    p.add_argument("--max-calls", type=int, default=200, help="at most this many calls per timed batch")
    args = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.device == "cpu":  # the cores shared out among the ranks
        threads = str(max(1, (os.cpu_count() or 1) // args.world))
        os.environ.setdefault("NUMBA_NUM_THREADS", threads)
        os.environ.setdefault("OMP_NUM_THREADS", threads)
    mp.spawn(worker, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
