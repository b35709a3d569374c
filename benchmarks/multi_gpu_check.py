"""Multi-GPU check: the kernels run on their tensors' own GPU, and GAE computed shard by shard
under torch.distributed equals the single-device result.

    python benchmarks/multi_gpu_check.py                    # every GPU present, then 2 ranks
    python benchmarks/multi_gpu_check.py --dist-backend gloo --world-size 2   # ranks on the CPU

Part 1, per GPU (with one GPU, that GPU as the current one): with each other GPU current, every
public estimator (the cases of gpu_check.py, outputs poisoned with NaN) runs on tensors on the
target GPU and is compared with the float64 oracle; the CUDA profiler must show every kernel on
the target GPU, the other GPUs' allocators must record no allocation, the current device must
be unchanged afterwards, and outputs returned without ``out=`` must live on the target GPU.

Part 2: ``--world-size`` ranks (torch.multiprocessing, NCCL with one GPU per rank when there are
enough GPUs, else gloo on the CPU; NCCL_NVLS_ENABLE=0) run a DDP-style loop: each rank computes
values with a DistributedDataParallel value network on its shard of the environments, GAE on
that shard, a value loss and an optimiser step; the advantages are all-gathered and rank 0
compares them with GAE on the whole rollout on one device and with the float64 oracle.

Part 3: the same ranks split one sequence along time (``group=``, docs/distributed.md): every
estimator and flag form of the catalog, response masks of both kinds with whitening, and group
advantages over responses spread across ranks, on uneven chunks (one empty) with flags on the
chunk boundaries, each rank's slice against the single-device call (float64 to 1e-12, float32
to 1e-5) and the float64 oracle. ``--sharded-device cuda`` with gloo puts every rank's tensors
on GPU 0 (the Triton kernels, one GPU).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.join(_here, "..")]
import rl_triton as rt  # noqa: E402
from common import parser  # noqa: E402
from gpu_check import ALGOS, GAMMA, LMBDA, actual, expected, rel_err  # noqa: E402
from rl_triton.testing import reference  # noqa: E402

TOL = 1e-5


def _allocations(device: int) -> int:
    return torch.cuda.memory_stats(device).get("allocation.all.allocated", 0)


def check_device(target: int, current: int, shape=(33, 300)) -> list[tuple[str, bool, str]]:
    """Every estimator on cuda:target while cuda:current is the current device."""
    others = [d for d in range(torch.cuda.device_count()) if d != target]
    results = []
    with torch.cuda.device(current):
        before = {d: _allocations(d) for d in others}
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            errors = {}
            for i, algo in enumerate(ALGOS):
                case = (algo, *shape, "batch-major", torch.float32)
                got = actual(case, i, torch.device("cuda", target))
                errors[algo] = max(rel_err(g, w) for g, w in zip(got, expected(case, i)))
            r = torch.randn(*shape, device=f"cuda:{target}")
            returned = rt.gae(r, r, bootstrap_value=r[:, -1], terminated=r > 2.0)
            torch.cuda.synchronize(target)
        kernel_devices = {e.device_index for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        after = {d: _allocations(d) for d in others}
        still_current = torch.cuda.current_device()
    tag = f"cuda:{target} with cuda:{current} current"
    worst = max(errors.values())
    results.append((f"{tag}: {len(errors)} estimators vs oracle", worst <= TOL,
                    f"worst rel err {worst:.1e} ({max(errors, key=errors.get)})"))
    results.append((f"{tag}: kernels ran on cuda:{target} only", kernel_devices == {target},
                    f"profiler saw kernels on {sorted(kernel_devices)}"))
    results.append((f"{tag}: no allocation on other GPUs", before == after,
                    f"allocation counts before {before}, after {after}"))
    results.append((f"{tag}: outputs on cuda:{target}",
                    all(o.device == torch.device("cuda", target) for o in returned), str([str(o.device) for o in returned])))
    results.append((f"{tag}: current device unchanged", still_current == current, f"cuda:{still_current}"))
    return results


def _rollout(n_envs: int, T: int, obs_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n_envs, T + 1, obs_dim, generator=g)  # obs t = 0..T (T: bootstrap observation)
    rewards = torch.randn(n_envs, T, generator=g)
    terminated = torch.rand(n_envs, T, generator=g) < 0.02
    return obs, rewards, terminated


def _rank(rank: int, world: int, backend: str, result_file: str, n_envs: int, T: int, iterations: int):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=f"file://{result_file}.rendezvous", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial network on every rank
    obs, rewards, terminated = (x.to(device) for x in _rollout(n_envs, T, 8))
    shard = slice(rank * n_envs // world, (rank + 1) * n_envs // world)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    worst_vs_single, worst_vs_oracle = 0.0, 0.0
    for _ in range(iterations):
        with torch.no_grad():
            values = ddp(obs[shard]).squeeze(-1)  # [n, T + 1]
            adv, ret = rt.gae(rewards[shard], values[:, :-1], bootstrap_value=values[:, -1],
                              terminated=terminated[shard], gamma=GAMMA, lmbda=LMBDA)
            gathered = [torch.empty_like(adv) for _ in range(world)]
            dist.all_gather(gathered, adv.contiguous())
            if rank == 0:  # the single-device result on the whole rollout, same network state
                full_values = net(obs).squeeze(-1)
                single = rt.gae(rewards, full_values[:, :-1], bootstrap_value=full_values[:, -1],
                                terminated=terminated, gamma=GAMMA, lmbda=LMBDA)[0]
                sharded = torch.cat(gathered, 0)
                worst_vs_single = max(worst_vs_single, rel_err(sharded.double().cpu().numpy(),
                                                               single.double().cpu().numpy()))
                ref = reference("gae", (rewards, full_values[:, :-1]), dict(
                    bootstrap_value=full_values[:, -1], terminated=terminated, gamma=GAMMA, lmbda=LMBDA))[0]
                worst_vs_oracle = max(worst_vs_oracle, rel_err(sharded.double().cpu().numpy(), ref))
        loss = (ddp(obs[shard]).squeeze(-1)[:, :-1] - ret).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients: every rank keeps the same network
        opt.step()
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"vs_single": worst_vs_single, "vs_oracle": worst_vs_oracle}, f)
    # release DDP's reducer (it holds pending gloo work) before the group goes
    del ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _sharded_rank(rank: int, world: int, backend: str, result_file: str, device: str):
    from rl_triton.testing import catalog

    dist.init_process_group(backend, init_method=f"file://{result_file}.rendezvous", rank=rank, world_size=world)
    dev = torch.device("cuda", rank if backend == "nccl" else 0) if backend == "nccl" or device == "cuda" else \
        torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = dist.group.WORLD
    lengths = [max(1, 29 + 13 * k) if k != world // 2 else 0 for k in range(world)]  # uneven, one empty
    bounds = [sum(lengths[:k]) for k in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    worst = {"vs_single_f64": 0.0, "vs_single_f32": 0.0, "vs_oracle": 0.0}

    def note(key, got, want):
        worst[key] = max(worst[key], rel_err(got.double().cpu().numpy(), want))

    for fn, variants in catalog.VARIANTS.items():
        if not catalog.takes(fn, "group"):
            continue
        for variant in variants:
            for dtype in (torch.float64, torch.float32):
                p = catalog.make(fn, (5, bounds[-1]), variant, dtype=dtype, device=dev, seed=3, p_term=0.1,
                                 p_trunc=0.05).flagged_at(bounds[1:-1])
                whole = p.call()
                got = p.steps(lo, hi).call(group=group)
                key = "vs_single_f64" if dtype == torch.float64 else "vs_single_f32"
                for g, w, e in zip(got, whole, p.expected()):
                    note(key, g, w[:, lo:hi].double().cpu().numpy())
                    note("vs_oracle", g, e[:, lo:hi])
    g = torch.Generator().manual_seed(5)
    r, v = (torch.randn(5, bounds[-1], generator=g, dtype=torch.float64).to(dev) for _ in range(2))
    mask = (torch.rand(5, bounds[-1], generator=g) < 0.7).to(dev)
    for kw in (dict(mask_mode="skip"), dict(mask_mode="pad"), dict(mask_mode="skip", whiten=True)):
        whole = rt.gae(r, v, mask=mask, **kw)
        got = rt.gae(r[:, lo:hi], v[:, lo:hi], mask=mask[:, lo:hi], group=group, **kw)
        for gt, w in zip(got, whole):
            note("vs_single_f64", gt, w[:, lo:hi].cpu().numpy())
    scores = torch.randn(4 * world, generator=g, dtype=torch.float64).to(dev)
    ids = torch.randint(0, 3, (4 * world,), generator=g).to(dev)
    tokens = (torch.rand(4 * world, 6, generator=g) < 0.8).to(dev)
    mine = slice(4 * rank, 4 * rank + 4)
    for mode in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        whole = rt.group_advantages(scores, ids, mode=mode, mask=tokens)
        got = rt.group_advantages(scores[mine], ids[mine], mode=mode, mask=tokens[mine], group=group, num_groups=3)
        note("vs_single_f64", got, whole[mine].cpu().numpy())
    for key in worst:
        t = torch.tensor([worst[key]], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst[key] = float(t)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(worst, f)
    dist.barrier()
    dist.destroy_process_group()


def check_sharded(backend: str, world: int, device: str = "cpu"):
    """Part 3; returns (name, ok, detail) lines."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        mp.spawn(_sharded_rank, args=(world, backend, result_file, device), nprocs=world, join=True)
        with open(result_file) as f:
            res = json.load(f)
    where = "one GPU per rank" if backend == "nccl" else "GPU 0" if device == "cuda" else "CPU"
    name = f"{world} ranks ({backend}, {where}), sequences split along time"
    return [(f"{name}: every estimator, masks, group advantages vs single device, float64",
             res["vs_single_f64"] <= 1e-12, f"rel err {res['vs_single_f64']:.1e}"),
            (f"{name}: every estimator vs single device, float32", res["vs_single_f32"] <= TOL,
             f"rel err {res['vs_single_f32']:.1e}"),
            (f"{name}: every estimator vs float64 oracle", res["vs_oracle"] <= TOL, f"rel err {res['vs_oracle']:.1e}")]


def check_distributed(backend: str, world: int, n_envs: int = 48, T: int = 256, iterations: int = 3):
    """Run the ranks; returns (name, ok, detail) lines."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(world, backend, result_file, n_envs, T, iterations), nprocs=world, join=True)
        with open(result_file) as f:
            res = json.load(f)
    where = "one GPU per rank" if backend == "nccl" else "CPU"
    return [(f"{world} ranks ({backend}, {where}), {iterations} DDP steps: gathered GAE vs single device",
             res["vs_single"] <= TOL, f"rel err {res['vs_single']:.1e}"),
            (f"{world} ranks ({backend}, {where}): gathered GAE vs float64 oracle", res["vs_oracle"] <= TOL,
             f"rel err {res['vs_oracle']:.1e}")]


def main():
    p = parser(__doc__)
    p.add_argument("--world-size", type=int, default=2, help="ranks of the torch.distributed part")
    p.add_argument("--dist-backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: NCCL when there is a GPU per rank, else gloo on the CPU")
    p.add_argument("--skip-devices", action="store_true", help="only the torch.distributed parts")
    p.add_argument("--sharded-device", choices=("cpu", "cuda"), default="cpu",
                   help="where gloo ranks keep the tensors of part 3 (cuda: all on GPU 0)")
    args = p.parse_args()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines = []
    if n and not args.skip_devices:
        print(f"{n} GPU(s): {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
        pairs = [(t, c) for t in range(n) for c in range(n) if t != c] or [(0, 0)]
        for target, current in pairs:
            lines += check_device(target, current)
    elif not args.skip_devices:
        print("no GPU: part 1 (device placement) not run", flush=True)
    backend = args.dist_backend
    if backend == "auto":
        backend = "nccl" if n >= args.world_size else "gloo"
    lines += check_distributed(backend, args.world_size)
    lines += check_sharded(backend, args.world_size, args.sharded_device)
    for name, ok, detail in lines:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    failures = sum(not ok for _, ok, _ in lines)
    print(f"\n{len(lines) - failures}/{len(lines)} checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
