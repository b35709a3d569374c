"""Token-level PPO (GAE) or GRPO on a synthetic policy, its advantage step SkyRL's own: SkyRL's
``compute_advantages_and_returns``, which looks the estimator up in its
``AdvantageEstimatorRegistry``, either with SkyRL's estimators (their Python loops) or with
rl_triton's drop-ins registered there by ``rl_triton.integrations.skyrl.patched()``.

Install (from the repository root, in an environment of its own after torch, as docs/skyrl.md
says):

    pip install -e ".[cpu,skyrl]" matplotlib tqdm

Run:

    python examples/skyrl_token_ppo.py                      # GAE, rl_triton in SkyRL's registry
    python examples/skyrl_token_ppo.py --no-fast            # GAE, SkyRL's own loop
    python examples/skyrl_token_ppo.py --estimator grpo     # GRPO (also rloo, reinforce++)
    python examples/skyrl_token_ppo.py --compare            # both, side by side

The policy is a small autoregressive model with no dependencies beyond torch: the previous token
and the position, embedded, through an MLP, into a policy head over ``--vocab`` tokens and a
value head. Each iteration samples ``--group-size`` responses to each of ``--prompts`` prompts (a
prompt is a first token) of up to ``--max-new`` tokens, the last token of the vocabulary (odd,
rare at first) ending a response (right padding after it), scores each response (the share of its tokens that are even: a toy reward the policy
can learn) on its last token, computes the advantages through SkyRL's dispatch and runs one PPO
update (clipped ratio, plus a value loss for GAE). Prints the advantage step's time and its share
of the update, and writes iterations.csv and scores.png under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm_token_ppo import plot_scores, ppo_loss, report  # noqa: E402  (the plot, table and loss it shares)
from rl_triton._scripts import parser, progress, require  # noqa: E402

INSTALL = "pip install -e '.[cpu,skyrl]' matplotlib tqdm"


def parse_args():
    p = parser(__doc__)
    p.add_argument("--estimator", choices=("gae", "grpo", "rloo", "reinforce++"), default="gae",
                   help="SkyRL's advantage estimator")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="rl_triton's drop-ins in SkyRL's registry (--no-fast: SkyRL's own loops)")
    p.add_argument("--compare", action="store_true", help="run SkyRL's loops and rl_triton, print both")
    p.add_argument("--iterations", type=int, default=40, help="PPO iterations")
    p.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new", type=int, default=256, help="response tokens at most")
    p.add_argument("--vocab", type=int, default=16, help="vocabulary size")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--gamma", type=float, default=1.0, help="discount")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--seed", type=int, default=1, help="random seed")
    p.add_argument("--out", default="runs/skyrl_token_ppo", help="output folder")
    return p.parse_args()


class Policy(torch.nn.Module):
    """Logits and a value for the next token from the previous token and the position."""

    def __init__(self, vocab, max_len, hidden):
        super().__init__()
        self.token = torch.nn.Embedding(vocab, hidden)
        self.position = torch.nn.Embedding(max_len, hidden)
        self.body = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                                        torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
        self.pi = torch.nn.Linear(hidden, vocab)
        self.v = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            self.pi.bias[vocab - 1] = -6.0  # EOS rare at first: long responses

    def forward(self, previous, positions):
        h = self.body(self.token(previous) + self.position(positions))
        return self.pi(h), self.v(h).squeeze(-1)


@torch.no_grad()
def sample(policy, first, max_new, eos):
    """``(tokens, valid)``: responses of up to ``max_new`` tokens, each ended by ``eos`` (kept,
    valid) and padded with it (not valid)."""
    B = first.shape[0]
    tokens = torch.zeros(B, max_new, dtype=torch.long)
    valid = torch.zeros(B, max_new, dtype=torch.bool)
    alive = torch.ones(B, dtype=torch.bool)
    previous = first
    for t in range(max_new):
        logits, _ = policy(previous, torch.full((B,), t))
        nxt = torch.distributions.Categorical(logits=logits).sample()
        tokens[:, t] = torch.where(alive, nxt, eos)
        valid[:, t] = alive
        alive &= nxt != eos
        previous = tokens[:, t]
    return tokens, valid


def run(args, fast, ppo_utils):
    import rl_triton.integrations.skyrl as rt_skyrl

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    policy = Policy(args.vocab, args.max_new, args.hidden)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    B = args.prompts * args.group_size
    positions = torch.arange(args.max_new).expand(B, -1)
    rows, adv_ms, update_ms = [], [], []
    bar = progress(args.iterations, f"{'rl_triton' if fast else 'SkyRL loop'} {args.estimator}", unit="it")
    with rt_skyrl.patched() if fast else contextlib.nullcontext():
        for it in range(args.iterations):
            first = torch.randint(0, args.vocab - 1, (args.prompts,), generator=gen).repeat_interleave(args.group_size)
            uid = np.array([f"prompt-{it}-{i // args.group_size}" for i in range(B)], dtype=object)
            tokens, valid = sample(policy, first, args.max_new, args.vocab - 1)
            mask = valid.float()
            scores = ((tokens % 2 == 0) & valid).sum(1) / valid.sum(1)
            last = valid & (valid.cumsum(1) == valid.sum(1, keepdim=True))
            token_rewards = torch.where(last, scores[:, None], 0.0)
            previous = torch.cat([first[:, None], tokens[:, :-1]], 1)
            with torch.no_grad():
                logits, values = policy(previous, positions)
                old_logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
            start = time.perf_counter()
            adv, returns = ppo_utils.compute_advantages_and_returns(
                token_level_rewards=token_rewards, response_mask=mask, index=uid, adv_estimator=args.estimator,
                config=None, values=values, gamma=args.gamma, lambd=args.lam)
            adv_time = time.perf_counter() - start
            logits, new_values = policy(previous, positions)
            logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
            loss = ppo_loss(logp, old_logp, adv, mask, args.clip,
                            new_values - returns if args.estimator == "gae" else None)
            opt.zero_grad()
            loss.backward()
            opt.step()
            update_time = time.perf_counter() - start
            adv_ms.append(adv_time * 1e3)
            update_ms.append(update_time * 1e3)
            rows.append(dict(iteration=it, score=scores.mean().item(), advantage_ms=adv_time * 1e3,
                             update_ms=update_time * 1e3, tokens=int(valid.sum())))
            if bar is not None:
                bar.set_postfix(score=f"{rows[-1]['score']:.3f}", refresh=False)
                bar.update(1)
    if bar is not None:
        bar.close()
    return rows, statistics.median(adv_ms), statistics.median(update_ms)


def main():
    args = parse_args()
    require("skyrl", "matplotlib", install=INSTALL)
    from rl_triton.testing.frameworks import skyrl_ppo_utils

    ppo_utils = skyrl_ppo_utils()
    os.makedirs(args.out, exist_ok=True)
    variants = [False, True] if args.compare else [args.fast]
    results = {fast: run(args, fast, ppo_utils) for fast in variants}
    names = {False: "SkyRL loop", True: "rl_triton"}
    report(results, args.out, f"\n{args.estimator} on {args.prompts * args.group_size} responses of up to "
           f"{args.max_new} tokens, CPU; medians over {args.iterations} iterations", names)
    fig = plot_scores(results, args.estimator, names, f"token-level {args.estimator} through SkyRL's registry")
    fig.savefig(os.path.join(args.out, "scores.png"), dpi=100)
    print(f"wrote {os.path.join(args.out, 'iterations.csv')} and scores.png")

if __name__ == "__main__":
    main()
