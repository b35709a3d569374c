"""GAE over one long rollout split along time across the ranks of a process group (context
parallelism): each rank computes its slice of the advantages with ``rl_triton.gae(...,
group=group)`` on its own chunk of the time axis, against the plain way of gathering every
rank's chunk onto every rank and running the whole sequence there.

Run (from the repository root, after ``pip install -e .``), two ranks on this machine:

    torchrun --nproc_per_node 2 examples/distributed_gae.py

(``python examples/distributed_gae.py`` runs it as a world of one rank.) On CPU the ranks talk
through gloo; with a GPU the default is nccl, rank k on ``cuda:LOCAL_RANK`` (``--backend``
picks). Every rank builds the same rollout of ``--rows`` rows x ``--steps`` steps from
``--seed`` (rewards, values, a bootstrap value per row, done flags at about ``--done-rate``)
and keeps its contiguous chunk of the time axis (``torch.tensor_split``: the chunks may differ
in length). Each iteration times both ways of getting this rank's slice:

- **sharded**: ``rl_triton.gae`` on the chunk with ``group=``; the ranks exchange two
  all-gathers of a few numbers per row, whatever the number of steps;
- **all-gather**: ``dist.all_gather`` of the chunks of rewards, values and done flags (padded
  to the longest chunk), then ``rl_triton.gae`` on the whole sequence and this rank's slice.

The two must agree (max abs diff below 1e-4 in float32, asserted on every rank), and rank 0
checks that the sharded slices put together equal the single-process call on the whole rollout.
Rank 0 prints a markdown table (median ms per call of the slowest rank, speedup over the
all-gather way, bytes each rank hands to the collectives per call) and writes timings.csv and,
with matplotlib, timings.png under ``--out``. One untimed call of each way comes first: it
compiles the kernels and counts the bytes (by wrapping the all-gather functions of
``torch.distributed`` in this process while nothing is timed).
"""

from __future__ import annotations

import contextlib
import csv
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rl_triton as rt  # noqa: E402
from rl_triton._scripts import parser, progress  # noqa: E402

WAYS = ("sharded", "all-gather")
TOLERANCE = 1e-4
# collectives whose bytes are counted: name -> position of the tensor this rank hands in
COLLECTIVES = {"all_gather_single": 1, "all_gather_into_tensor": 1, "all_gather": 1, "all_reduce": 0}


def parse_args():
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=8, help="rows (environments, sequences) of the rollout")
    p.add_argument("--steps", type=int, default=200_000, help="time steps of the whole rollout, over all ranks")
    p.add_argument("--iterations", type=int, default=5, help="timed calls of each way")
    p.add_argument("--seed", type=int, default=0, help="seed of the rollout (the same on every rank)")
    p.add_argument("--done-rate", type=float, default=0.02, help="share of steps that end an episode")
    p.add_argument("--gamma", type=float, default=0.99, help="discount")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="torch.distributed backend (None: nccl with CUDA, else gloo)")
    p.add_argument("--out", default="runs/distributed_gae", help="output folder (rank 0 writes it)")
    args = p.parse_args()
    if args.iterations < 1 or args.rows < 1 or args.steps < 1:
        p.error("--iterations, --rows and --steps must be at least 1")
    return args


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def init(backend: str | None):
    """The process group of the torchrun environment (or a world of one under plain python) and
    this rank's device."""
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = _free_port()
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend)
    return dist.group.WORLD, device


def rollout(args, device):
    """The whole rollout, the same on every rank: rewards, values, done flags [rows, steps] and
    the bootstrap value V(s_T) per row."""
    gen = torch.Generator().manual_seed(args.seed)
    B, T = args.rows, args.steps
    done = torch.rand(B, T, generator=gen) < args.done_rate
    rewards = torch.randn(B, T, generator=gen) * 0.1 + torch.where(done, 1.0, 0.0)
    values = torch.randn(B, T + 1, generator=gen)
    return rewards.to(device), values[:, :T].contiguous().to(device), done.to(device), values[:, T].to(device)


@contextlib.contextmanager
def counting(sent: list):
    """Appends to ``sent`` the bytes this rank hands to each collective called inside (the
    outermost call only, where one collective calls another)."""
    originals, depth = {}, [0]
    for name, position in COLLECTIVES.items():
        if not hasattr(dist, name):
            continue
        originals[name] = original = getattr(dist, name)

        def wrapped(*args, _fn=original, _position=position, **kwargs):
            if depth[0] == 0:
                tensor = args[_position] if len(args) > _position else \
                    kwargs.get("input_tensor", kwargs.get("tensor"))
                sent.append(tensor.numel() * tensor.element_size())
            depth[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(dist, name, wrapped)
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def gather_time(x, lengths, group):
    """The whole sequence from every rank's chunk ``x`` of the time axis (dim 1): each chunk
    padded to the longest, all-gathered, trimmed and concatenated in rank order."""
    longest = max(lengths)
    padded = torch.nn.functional.pad(x, (0, longest - x.shape[1])) if x.shape[1] < longest else x.contiguous()
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:, :n] for part, n in zip(parts, lengths)], 1)


def sharded(args, chunk, group):
    rewards, values, done, boot = chunk
    adv, _ = rt.gae(rewards, values, done=done, bootstrap_value=boot, gamma=args.gamma, lmbda=args.lam, group=group)
    return adv


def all_gather_way(args, chunk, lengths, rank, group):
    rewards, values, done, boot = chunk
    whole_r, whole_v = gather_time(rewards, lengths, group), gather_time(values, lengths, group)
    # bool travels as uint8 (one byte a step, as on the host)
    whole_d = gather_time(done.view(torch.uint8), lengths, group).view(torch.bool)
    adv, _ = rt.gae(whole_r, whole_v, done=whole_d, bootstrap_value=boot, gamma=args.gamma, lmbda=args.lam)
    lo = sum(lengths[:rank])
    return adv[:, lo:lo + lengths[rank]]


def timed(fn, device, group):
    """(result, seconds) of ``fn()``, started together on every rank."""
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def main():
    args = parse_args()
    group, device = init(args.backend)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rewards, values, done, boot = rollout(args, device)
    parts = [x.tensor_split(world, dim=1) for x in (rewards, values, done)]
    lengths = [p.shape[1] for p in parts[0]]
    chunk = (*(p[rank].contiguous() for p in parts), boot)
    ways = {"sharded": lambda: sharded(args, chunk, group),
            "all-gather": lambda: all_gather_way(args, chunk, lengths, rank, group)}

    # untimed: compiles the kernels, counts the bytes, checks the two ways and the whole
    sent = {}
    results = {}
    for way, fn in ways.items():
        with counting([]) as counted:
            results[way] = fn()
        sent[way] = sum(counted)
    diff = (results["sharded"] - results["all-gather"]).abs().max() if lengths[rank] else torch.zeros((), device=device)
    assert diff.item() < TOLERANCE, f"rank {rank}: sharded and all-gather differ by {diff.item():.3g}"
    pieces = gather_time(results["sharded"], lengths, group)
    if rank == 0:
        single, _ = rt.gae(rewards, values, done=done, bootstrap_value=boot, gamma=args.gamma, lmbda=args.lam)
        whole_diff = (pieces - single).abs().max().item()
        assert whole_diff < TOLERANCE, f"sharded slices and the single-process call differ by {whole_diff:.3g}"
    diff = diff.reshape(1).float()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)

    seconds = torch.zeros(args.iterations, len(WAYS), dtype=torch.float64)
    bar = progress(args.iterations, f"distributed gae, {world} ranks", unit="it") if rank == 0 else None
    for it in range(args.iterations):
        for j, way in enumerate(WAYS):
            _, seconds[it, j] = timed(ways[way], device, group)
        if bar is not None:
            bar.set_postfix(sharded_ms=f"{seconds[it, 0] * 1e3:.1f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    slowest = seconds.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # each call's slowest rank
    ms = (slowest.cpu() * 1e3).tolist()

    if rank == 0:
        medians = {way: statistics.median(row[j] for row in ms) for j, way in enumerate(WAYS)}
        print(f"\nGAE on {args.rows} rows x {args.steps} steps split over {world} rank(s) ({dist.get_backend(group)}, "
              f"{device.type}; chunks of {min(lengths)}-{max(lengths)} steps); medians over {args.iterations} "
              f"iterations of the slowest rank")
        print("| way | ms per call | speedup | bytes per rank to collectives |")
        print("|---|---|---|---|")
        for way in WAYS:
            print(f"| {way} | {medians[way]:.2f} | {medians['all-gather'] / medians[way]:.2f}x | {sent[way]:,} |")
        print(f"max abs diff: sharded vs all-gather {diff.item():.2e}, sharded vs single process {whole_diff:.2e}")
        write_outputs(args, ms, sent, world)
    dist.destroy_process_group()


def write_outputs(args, ms, sent, world):
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "timings.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration", "way", "ms", "bytes"])
        for it, row in enumerate(ms):
            for j, way in enumerate(WAYS):
                w.writerow([it, way, f"{row[j]:.4f}", sent[way]])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print(f"wrote {path} (no matplotlib: no timings.png)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, way in enumerate(WAYS):
        ax.plot(range(len(ms)), [row[j] for row in ms], marker="o", label=way)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("ms per call (slowest rank)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"GAE on {args.rows} rows x {args.steps:,} steps split along time over {world} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "timings.png"), dpi=100)
    plt.close(fig)
    print(f"wrote {path} and timings.png")


if __name__ == "__main__":
    main()
