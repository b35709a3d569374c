"""Token-level PPO (or GRPO) on a small causal language model, its advantage step either the
frameworks' Python loop over tokens (verl's, as transcribed in rl_triton/testing/frameworks.py)
or rl_triton's fused calls.

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/llm_token_ppo.py                      # GAE, rl_triton
    python examples/llm_token_ppo.py --no-fast            # GAE, verl's loop
    python examples/llm_token_ppo.py --estimator grpo     # GRPO group advantages
    python examples/llm_token_ppo.py --compare            # both, side by side

The model is a randomly initialised Llama built from a transformers config (nothing is
downloaded) with a linear value head. Each iteration samples ``--group-size`` responses for each
of ``--prompts`` random prompts (up to ``--max-new`` tokens, EOS padding), marks random spans of
the responses as tool output (mask 0: the policy did not generate them), scores each response
(the share of its generated tokens that are even: a toy reward the policy can learn), computes
the advantages (GAE with verl's skip semantics and whitening, or GRPO), and runs one PPO update.
Prints the advantage phase's time and its share of the update, and writes iterations.csv and
scores.png under --out. Runs on CUDA with --cuda (or when a GPU is present).
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rl_triton as rt  # noqa: E402
from rl_triton._scripts import parser, progress, require  # noqa: E402
from rl_triton.testing import frameworks  # noqa: E402

EOS, PAD = 1, 0


def parse_args():
    p = parser(__doc__)
    p.add_argument("--estimator", choices=("gae", "grpo"), default="gae", help="advantage estimator")
    p.add_argument("--fast", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="rl_triton's fused calls (--no-fast: verl's loop over tokens)")
    p.add_argument("--compare", action="store_true", help="run the loop and rl_triton, print both")
    p.add_argument("--iterations", type=int, default=30, help="PPO iterations")
    p.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens")
    p.add_argument("--max-new", type=int, default=48, help="response tokens at most")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate")
    p.add_argument("--gamma", type=float, default=1.0, help="discount")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--tool-span", type=float, default=0.1, help="share of response tokens marked as tool output")
    p.add_argument("--seed", type=int, default=1, help="random seed")
    p.add_argument("--cuda", action=__import__("argparse").BooleanOptionalAction, default=None,
                   help="run on CUDA (default: when available)")
    p.add_argument("--out", default="runs/llm_token_ppo", help="output folder")
    return p.parse_args()


class Policy(torch.nn.Module):
    """A causal LM and a value head on its last hidden states."""

    def __init__(self, args):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=args.prompt_len + args.max_new + 1, bos_token_id=2,
                             eos_token_id=EOS, pad_token_id=PAD)
        self.lm = LlamaForCausalLM(config)
        self.value = torch.nn.Linear(args.hidden, 1)

    def forward(self, tokens, attention):
        out = self.lm(input_ids=tokens, attention_mask=attention, output_hidden_states=True)
        return out.logits, self.value(out.hidden_states[-1]).squeeze(-1)


@torch.no_grad()
def sample(policy, prompts, max_new):
    """Responses sampled token by token with the model's key-value cache; after EOS a response
    is padded (PAD, attention 0)."""
    alive = torch.ones(prompts.shape[0], dtype=torch.bool, device=prompts.device)
    attention = torch.ones_like(prompts)
    out = policy.lm(input_ids=prompts, attention_mask=attention, use_cache=True)
    tokens = prompts
    for _ in range(max_new):
        nxt = torch.distributions.Categorical(logits=out.logits[:, -1].float()).sample()
        nxt = torch.where(alive, nxt, PAD)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        attention = torch.cat([attention, alive[:, None].long()], 1)
        alive &= nxt != EOS
        out = policy.lm(input_ids=nxt[:, None], attention_mask=attention, past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, attention


def tool_spans(valid, share, generator):
    """Marks random spans of the valid response tokens as tool output (mask 0)."""
    B, L = valid.shape
    mask = valid.clone()
    for _ in range(max(1, int(share * L / 6))):
        start = torch.randint(0, L, (B, 1), generator=generator)
        width = torch.randint(2, 9, (B, 1), generator=generator)
        t = torch.arange(L)[None, :]
        mask &= ~((t >= start) & (t < start + width)).to(mask.device)
    return mask


def advantages(args, fast, token_rewards, values, mask, scores, uid):
    """The advantage phase: (advantages, returns) of the response tokens."""
    if args.estimator == "grpo":
        if fast:
            adv = rt.group_advantages(scores, uid, mode="grpo", mask=mask)
        else:
            adv = frameworks.verl_grpo(token_rewards.clone(), mask.to(token_rewards.dtype), uid)
        return adv, adv
    if fast:
        return rt.gae(token_rewards, values, mask=mask, gamma=args.gamma, lmbda=args.lam, whiten=True)
    return frameworks.verl_compute_gae_advantage_return(token_rewards, values, mask.to(values.dtype), args.gamma,
                                                        args.lam)


def run(args, fast, device):
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    policy = Policy(args).to(device)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    B = args.prompts * args.group_size
    rows, adv_ms, update_ms = [], [], []
    bar = progress(args.iterations, f"{'rl_triton' if fast else 'verl loop'} {args.estimator}", unit="it")
    for it in range(args.iterations):
        prompts = torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=gen)
        prompts = prompts.repeat_interleave(args.group_size, 0).to(device)
        uid = [f"prompt-{it}-{i // args.group_size}" for i in range(B)]
        tokens, attention = sample(policy, prompts, args.max_new)
        P = args.prompt_len
        response = tokens[:, P:]
        valid = attention[:, P:].bool()
        mask = tool_spans(valid.cpu(), args.tool_span, gen).to(device)
        generated = response[:, :] % 2 == 0
        scores = (generated & mask).sum(1).float() / mask.sum(1).clamp(min=1)
        last = (valid.cumsum(1) == valid.sum(1, keepdim=True)) & valid
        token_rewards = torch.where(last, scores[:, None], 0.0)
        with torch.no_grad():
            logits, values = policy(tokens, attention)
            old_logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, response[..., None])[..., 0]
            values = values[:, P - 1:-1].float()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        adv, returns = advantages(args, fast, token_rewards, values, mask, scores, uid)
        if device.type == "cuda":
            torch.cuda.synchronize()
        adv_time = time.perf_counter() - start
        logits, new_values = policy(tokens, attention)
        logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, response[..., None])[..., 0]
        value_error = new_values[:, P - 1:-1] - returns if args.estimator == "gae" else None
        loss = ppo_loss(logp, old_logp, adv, mask, args.clip, value_error)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        update_time = time.perf_counter() - start
        adv_ms.append(adv_time * 1e3)
        update_ms.append(update_time * 1e3)
        rows.append(dict(iteration=it, score=scores.mean().item(), advantage_ms=adv_time * 1e3,
                         update_ms=update_time * 1e3, tokens=int(mask.sum())))
        if bar is not None:
            bar.set_postfix(score=f"{rows[-1]['score']:.3f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows, statistics.median(adv_ms), statistics.median(update_ms)


def ppo_loss(logp, old_logp, adv, mask, clip, value_error=None):
    """PPO's clipped policy loss averaged over the valid tokens (``mask``), plus half the mean
    squared ``value_error`` over them where given."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    ratio = torch.exp(logp - old_logp)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    loss = (pg * m).sum() / n
    if value_error is not None:
        loss = loss + 0.5 * ((value_error ** 2) * m).sum() / n
    return loss


NAMES = {False: "verl loop", True: "rl_triton"}
# rl_triton's curve is drawn dashed over the loop's solid one: with the same seed the two runs can
# give the same scores, and both curves stay visible where they coincide
STYLES = {False: dict(linestyle="-", linewidth=3.0, alpha=0.6, marker="o"),
          True: dict(linestyle="--", linewidth=1.5, marker="x")}


def report(results, out, header, names=NAMES):
    """Prints ``header`` and a table of each variant of ``results`` (fast -> (rows, advantage ms,
    update ms)), named by ``names``, and writes ``out``/iterations.csv."""
    print(header)
    print("| advantage step | advantage ms | update ms | advantage share | final score |")
    print("|---|---|---|---|---|")
    for fast, (rows, adv, update) in results.items():
        print(f"| {names[fast]} | {adv:.2f} | {update:.1f} | {adv / update:.1%} | {rows[-1]['score']:.3f} |")
    with open(os.path.join(out, "iterations.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["variant", "iteration", "score", "advantage_ms", "update_ms", "tokens"])
        w.writeheader()
        for fast, (rows, _, _) in results.items():
            for row in rows:
                w.writerow(dict(variant=names[fast], **row))


def plot_scores(results, estimator, names=NAMES, title=None):
    """The mean score per iteration of each variant in ``results`` (fast -> (rows, ...)), named by
    ``names``, with integer iteration ticks; the matplotlib figure, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for fast, (rows, _, _) in sorted(results.items()):
        ax.plot([r["iteration"] for r in rows], [r["score"] for r in rows], label=names[fast], **STYLES[fast])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean score")
    ax.set_title(title or f"token-level {estimator.upper()} on a toy reward")
    ax.legend()
    fig.tight_layout()
    return fig


def main():
    args = parse_args()
    require("transformers")
    device = torch.device("cuda" if (args.cuda if args.cuda is not None else torch.cuda.is_available()) else "cpu")
    os.makedirs(args.out, exist_ok=True)
    variants = [False, True] if args.compare else [args.fast]
    results = {fast: run(args, fast, device) for fast in variants}
    B, L = args.prompts * args.group_size, args.max_new
    report(results, args.out, f"\n{args.estimator.upper()} on {B} responses of up to {L} tokens, {device}; medians "
           f"over {args.iterations} iterations")
    fig = plot_scores(results, args.estimator)
    if fig is None:
        return
    fig.savefig(os.path.join(args.out, "scores.png"), dpi=100)
    print(f"wrote {os.path.join(args.out, 'iterations.csv')} and scores.png")


if __name__ == "__main__":
    main()
