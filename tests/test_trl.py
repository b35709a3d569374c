"""TRL's PPO step (transcribed below) against rl_triton.integrations.trl: compute_advantages for
the GAE loop, the returns, the whitening and the fill; whiten_rewards for the reward whitening.
Inputs are built as TRL builds them: responses truncated at the stop token, the padding masks,
values and log-probs filled, the score at the first padding token. The tests marked ``framework``
run against the real TRL 1.12.0 (.ci/run's frameworks stage installs it): TRL's own block of
PPOTrainer.train in float32 and float64, the transcriptions against TRL's functions, and
docs/trl.md's diff applied to the real trainer's source."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import textwrap
import types

import pytest
import torch

from rl_triton.core import kernels
from rl_triton.integrations.trl import compute_advantages, whiten_rewards
from rl_triton.testing import frameworks

from helpers import run_python_block

F64, F32 = torch.float64, torch.float32
BACKENDS = ["cpu", "torch"] + (["triton"] if kernels.AVAILABLE and kernels.INTERPRET else [])
PAD, EOS, VOCAB = 0, 1, 40


# -- TRL, transcribed ---------------------------------------------------------------------------
# TRL 1.12.0 (the PyPI wheel; the same code in 1.0.0 and at huggingface/trl commit
# d6196b61d8c275f2b2d2d76faef3fcf9982972f6; 1.13.0 removed the PPO trainer):
# trl/experimental/ppo/ppo_trainer.py, masked_mean, masked_var, masked_whiten, truncate_response
# and, in PPOTrainer.train, the block from the padding masks to the fill of the advantages;
# trl/experimental/utils.py, first_true_indices.
INVALID_LOGPROB = 1.0


def trl_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def trl_masked_var(values, mask):
    mean = trl_masked_mean(values, mask)
    variance = trl_masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    if mask_sum == 0:
        raise ValueError("The sum of the mask is zero")
    return variance * (mask_sum / (mask_sum - 1))  # int64 / int64: torch's default float dtype


def trl_masked_whiten(values, mask, shift_mean=True):
    mean, var = trl_masked_mean(values, mask), trl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def trl_first_true_indices(bools):
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(torch.long) + torch.arange(row_len, dtype=torch.long)
    return torch.min(zero_or_index, dim=-1).values


def trl_truncate_response(stop_token_id, pad_token_id, responses):
    trunc_idxs = trl_first_true_indices(responses == stop_token_id).unsqueeze(-1)
    idxs = torch.arange(responses.shape[1]).view(1, responses.shape[1])
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_token_id)


def trl_rollout(responses, logprobs, ref_logprobs, values, scores, stop_token_id, pad_token_id, kl_coef,
                kl_estimator):
    """The tensors of train() at "6. compute advantages and returns"."""
    postprocessed = trl_truncate_response(stop_token_id, pad_token_id, responses)
    sequence_lengths = trl_first_true_indices(postprocessed == pad_token_id) - 1
    response_idxs = torch.arange(responses.shape[1]).repeat(responses.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > sequence_lengths_p1.unsqueeze(1)
    values = torch.masked_fill(values, padding_mask_p1, 0)
    logr = ref_logprobs - logprobs
    kl = -logr if kl_estimator == "k1" else (logr.exp() - 1) - logr
    rewards = (-kl_coef * kl).clone()
    actual_start = torch.arange(rewards.size(0))
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
    rewards[actual_start, actual_end] += scores
    return rewards, values, padding_mask, padding_mask_p1


def trl_whiten_rewards(rewards, padding_mask_p1):
    rewards = trl_masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
    return torch.masked_fill(rewards, padding_mask_p1, 0)


def trl_advantages(rewards, values, padding_mask, gamma, lam):
    # TRL's GAE loop is OpenRLHF's, token for token, without its action mask
    advantages, returns = frameworks.openrlhf_gae(values, rewards, None, gamma, lam)
    advantages = trl_masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return advantages, returns


@contextlib.contextmanager
def default_dtype(dtype):
    """TRL's Bessel factor is an int64 / int64 division, which gives torch's default float dtype;
    float64 as the default keeps a float64 transcription exact (float32 rounds it, 6e-8)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


# -- data ---------------------------------------------------------------------------------------
def rollout(B, T, dtype, seed, pad_is_eos=False, kl_estimator="k1"):
    """Responses as TRL's generation gives them: stop tokens at random places (the first one
    counts), tokens after it that truncate_response pads, rows that never stop, and every edge:
    a stop at token 0 (with pad == eos: a row with no response token), at T - 1, none."""
    g = torch.Generator().manual_seed(seed)
    stop = PAD if pad_is_eos else EOS
    responses = torch.randint(2, VOCAB, (B, T), generator=g)
    where = torch.randint(0, T, (B,), generator=g)
    stops = torch.rand(B, generator=g) < 0.8
    for i, (t, s) in enumerate(zip(where.tolist(), stops.tolist())):
        edge = (0, T - 1, None)[i % 3] if i < 3 else (t if s else None)
        if edge is not None:
            responses[i, edge] = stop
            if i % 2 and edge + 1 < T:
                responses[i, edge + 1:] = stop  # a second stop token after the first
    logprobs = -torch.rand(B, T, generator=g, dtype=F64).to(dtype) * 3
    ref_logprobs = -torch.rand(B, T, generator=g, dtype=F64).to(dtype) * 3
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    scores = torch.randn(B, generator=g, dtype=F64).to(dtype) * 2
    return trl_rollout(responses, logprobs, ref_logprobs, values, scores, stop, PAD, 0.05, kl_estimator)


def _close(actual, expected, dtype):
    tol = 1e-12 if dtype == F64 else 1e-6
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True)


SHAPES = [(1, 1), (5, 1), (7, 12), (16, 48)]
COEFFICIENTS = [(1.0, 0.95), (0.99, 0.9), (0.9, 1.0)]  # TRL's defaults are gamma 1, lam 0.95


@pytest.fixture
def use_backend(request, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", request.param)
    return request.param


# -- compute_advantages -------------------------------------------------------------------------
@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("gamma,lam", COEFFICIENTS)
@pytest.mark.parametrize("pad_is_eos", [False, True])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0/0 = NaN
def test_matches_trl_float64(use_backend, B, T, gamma, lam, pad_is_eos):
    rewards, values, padding_mask, _ = rollout(B, T, F64, seed=B * 100 + T, pad_is_eos=pad_is_eos)
    adv, ret = compute_advantages(rewards, values, padding_mask, gamma, lam)
    if padding_mask.all():  # (1, 1) with pad == eos: TRL raises, the call gives 0 (test_degenerate_batches)
        with pytest.raises(ValueError):
            trl_advantages(rewards, values, padding_mask, gamma, lam)
        assert (adv == 0).all()
        return
    with default_dtype(F64):  # one response token, at (1, 1): NaN there in both
        want_adv, want_ret = trl_advantages(rewards, values, padding_mask, gamma, lam)
    assert adv.dtype == ret.dtype == F64 and adv.shape == ret.shape == rewards.shape
    _close(adv, want_adv, F64)
    _close(ret, want_ret, F64)
    assert (adv[padding_mask] == 0).all()


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
@pytest.mark.parametrize("whiten", [False, True])
def test_matches_trl_float32(use_backend, kl_estimator, whiten):
    B, T = (12, 24) if use_backend == "triton" else (32, 80)  # the interpreter is slow
    rewards, values, padding_mask, padding_mask_p1 = rollout(B, T, F32, seed=7, kl_estimator=kl_estimator)
    want_rewards = trl_whiten_rewards(rewards, padding_mask_p1) if whiten else rewards
    got_rewards = whiten_rewards(rewards, padding_mask_p1) if whiten else rewards
    _close(got_rewards, want_rewards, F32)
    want_adv, want_ret = trl_advantages(want_rewards, values, padding_mask, 1.0, 0.95)
    adv, ret = compute_advantages(want_rewards, values, padding_mask, 1.0, 0.95)
    assert adv.dtype == ret.dtype == F32
    _close(adv, want_adv, F32)
    _close(ret, want_ret, F32)


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
def test_whiten_rewards_float64(use_backend):
    rewards, _, _, padding_mask_p1 = rollout(9, 14, F64, seed=3)
    with default_dtype(F64):
        want = trl_whiten_rewards(rewards, padding_mask_p1)
    got = whiten_rewards(rewards, padding_mask_p1)
    _close(got, want, F64)
    assert (got[padding_mask_p1] == 0).all()


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
def test_any_mask_and_unfilled_inputs(use_backend):
    """The loop's result for any inputs: masks with holes (no TRL mask has them, the call does
    not care) and values that are not zero past the response."""
    g = torch.Generator().manual_seed(11)
    rewards, values = torch.randn(2, 6, 10, generator=g, dtype=F64)
    padding_mask = torch.rand(6, 10, generator=g) < 0.4
    padding_mask[0] = True  # a row with no valid token
    with default_dtype(F64):
        want_adv, want_ret = trl_advantages(rewards, values, padding_mask, 0.97, 0.9)
    adv, ret = compute_advantages(rewards, values, padding_mask, 0.97, 0.9)
    _close(adv, want_adv, F64)
    _close(ret, want_ret, F64)
    # an integer mask (nonzero = padding) reads the same as the bool one
    adv_int, _ = compute_advantages(rewards, values, padding_mask.to(torch.uint8), 0.97, 0.9)
    _close(adv_int, want_adv, F64)


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
def test_padding_mask_p1_fills_what_trl_fills(use_backend):
    g = torch.Generator().manual_seed(5)
    B, T = 5, 11
    raw_values = torch.randn(B, T, generator=g, dtype=F64)
    logprobs, ref_logprobs = -torch.rand(2, B, T, generator=g, dtype=F64)
    responses = torch.randint(2, VOCAB, (B, T), generator=g)
    responses[torch.arange(B), torch.tensor([0, 3, 9, 10, 4])] = EOS
    rewards, values, padding_mask, padding_mask_p1 = trl_rollout(responses, logprobs, ref_logprobs, raw_values,
                                                                 torch.randn(B, generator=g, dtype=F64), EOS,
                                                                 PAD, 0.1, "k1")
    with default_dtype(F64):
        want_adv, want_ret = trl_advantages(rewards, values, padding_mask, 0.99, 0.95)
    adv, ret = compute_advantages(rewards, raw_values, padding_mask, 0.99, 0.95, padding_mask_p1=padding_mask_p1)
    _close(adv, want_adv, F64)
    _close(ret, want_ret, F64)


def test_trl_rounds_its_bessel_factor_to_float32():
    """Verbatim TRL under torch's default float32 forms n / (n - 1) in float32: a relative 1e-7
    off the exact formula (what compute_advantages computes), and nothing more."""
    rewards, values, padding_mask, _ = rollout(16, 40, F64, seed=2)
    want_adv, want_ret = trl_advantages(rewards, values, padding_mask, 1.0, 0.95)
    adv, ret = compute_advantages(rewards, values, padding_mask, 1.0, 0.95)
    _close(ret, want_ret, F64)
    assert not torch.equal(adv, want_adv)
    torch.testing.assert_close(adv, want_adv, rtol=1e-7, atol=1e-7)


def test_degenerate_batches():
    """No response token in the whole batch: TRL's masked_var raises, compute_advantages (no host
    sync) gives advantages that are all 0. One response token: NaN there, as TRL."""
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 3, 4, generator=g, dtype=F64)
    everything = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError):
        trl_advantages(rewards, values, everything, 1.0, 0.95)
    adv, ret = compute_advantages(rewards, values, everything, 1.0, 0.95)
    assert (adv == 0).all()
    with default_dtype(F64):
        one = everything.clone()
        one[1, 2] = False
        want_adv, want_ret = trl_advantages(rewards, values, one, 1.0, 0.95)
    adv, ret = compute_advantages(rewards, values, one, 1.0, 0.95)
    assert torch.isnan(adv[1, 2]) and torch.isnan(want_adv[1, 2])
    _close(adv, want_adv, F64)
    _close(ret, want_ret, F64)


def test_dtypes_and_gradients():
    rewards, values, padding_mask, _ = rollout(8, 20, F64, seed=4)
    with default_dtype(F64):
        want_adv, want_ret = trl_advantages(rewards.float(), values, padding_mask, 1.0, 0.95)
    adv, ret = compute_advantages(rewards.float(), values, padding_mask, 1.0, 0.95)  # promoted, as the loop
    assert adv.dtype == ret.dtype == F64
    _close(adv, want_adv, torch.float32)  # float32 rewards: float32 rounding
    for dtype in (torch.bfloat16, torch.float16):
        adv, ret = compute_advantages(rewards.to(dtype), values.to(dtype), padding_mask, 1.0, 0.95)
        assert adv.dtype == ret.dtype == dtype
        ref_adv, ref_ret = compute_advantages(rewards.to(dtype).double(), values.to(dtype).double(), padding_mask,
                                              1.0, 0.95)
        torch.testing.assert_close(adv.double(), ref_adv, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(ret.double(), ref_ret, rtol=2e-2, atol=2e-2)
    # TRL runs the step under no_grad; so does the call, whatever its inputs
    adv, ret = compute_advantages(rewards.requires_grad_(), values, padding_mask, 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


def test_does_not_write_its_inputs():
    rewards, values, padding_mask, padding_mask_p1 = rollout(4, 9, F32, seed=8)
    copies = [t.clone() for t in (rewards, values, padding_mask, padding_mask_p1)]
    compute_advantages(rewards, values, padding_mask, 1.0, 0.95, padding_mask_p1=padding_mask_p1)
    whiten_rewards(rewards, padding_mask_p1)
    for t, c in zip((rewards, values, padding_mask, padding_mask_p1), copies):
        assert torch.equal(t, c)


def test_bad_inputs():
    r = torch.zeros(3, 5)
    m = torch.zeros(3, 5, dtype=torch.bool)
    with pytest.raises(TypeError, match="rewards"):
        compute_advantages([0.0], r, m, 1.0, 0.95)
    with pytest.raises(TypeError, match="values"):
        compute_advantages(r, None, m, 1.0, 0.95)
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(torch.zeros(5), torch.zeros(5), m, 1.0, 0.95)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(r, torch.zeros(3, 4), m, 1.0, 0.95)
    with pytest.raises(ValueError, match="padding_mask"):
        compute_advantages(r, r, m[:, :4], 1.0, 0.95)
    with pytest.raises(TypeError, match="padding_mask"):
        compute_advantages(r, r, m.float(), 1.0, 0.95)
    with pytest.raises(TypeError, match="padding_mask"):
        compute_advantages(r, r, "mask", 1.0, 0.95)
    with pytest.raises(ValueError, match="padding_mask_p1"):
        compute_advantages(r, r, m, 1.0, 0.95, padding_mask_p1=m[:2])
    with pytest.raises(ValueError, match="gamma"):
        compute_advantages(r, r, m, 1.5, 0.95)
    with pytest.raises(TypeError, match="rewards"):
        whiten_rewards(r.numpy(), m)
    with pytest.raises(ValueError, match="padding_mask_p1"):
        whiten_rewards(r, m.T)


# -- the real TRL, where it is installed (.ci/run's frameworks stage installs TRL 1.12.0) ----------
TRL_PPO = "trl.experimental.ppo.ppo_trainer"
DOCS_TRL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "trl.md")


def _real_ppo():
    return pytest.importorskip(TRL_PPO, reason="TRL 1.0-1.12 (trl.experimental.ppo) not installed")


def real_trl_block(source, last="torch.masked_fill(advantages, padding_mask, 0)"):
    """The lines of PPOTrainer.train from the padding masks to the fill of the advantages (or to
    the line holding ``last``), as code."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if "response_idxs = torch.arange(" in line)
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def docs_diff():
    """docs/trl.md's diff of PPOTrainer.train: (the lines it removes, the lines it puts there),
    each with its context lines, as text."""
    text = open(DOCS_TRL).read()
    (diff,) = re.findall(r"```diff\n(.*?)```", text, re.S)
    lines = diff.splitlines()  # an empty line is an empty context line
    old = [line[1:] for line in lines if line[:1] in ("", " ", "-")]
    new = [line[1:] for line in lines if line[:1] in ("", " ", "+")]
    return "\n".join(old), "\n".join(new)


def trl_inputs(ppo, B, T, dtype, seed, stop=EOS):
    """What train() holds before the padding masks, built with TRL's own truncate_response and
    first_true_indices."""
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(2, VOCAB, (B, T), generator=g)
    responses[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = stop
    responses[0, 0] = stop
    responses[-1] = torch.randint(2, VOCAB, (T,), generator=g)  # a row that never stops
    postprocessed = ppo.truncate_response(stop, PAD, responses)
    sequence_lengths = ppo.first_true_indices(postprocessed == PAD) - 1
    logprobs, ref_logprobs = (-torch.rand(2, B, T, generator=g, dtype=F64) * 3).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    scores = torch.randn(B, generator=g, dtype=F64).to(dtype)
    return dict(responses=responses, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores,
                sequence_lengths=sequence_lengths)


def run_block(ppo, block, inputs, **args):
    args = types.SimpleNamespace(**{**dict(kl_estimator="k3", kl_coef=0.05, whiten_rewards=False, gamma=1.0,
                                           lam=0.95), **args})
    env = dict(torch=torch, masked_whiten=ppo.masked_whiten, INVALID_LOGPROB=ppo.INVALID_LOGPROB, args=args,
               empty_cache=lambda: None, compute_advantages=compute_advantages, whiten_rewards=whiten_rewards,
               **{k: x.clone() for k, x in inputs.items()})
    exec(block, env)
    return env


@pytest.mark.framework
def test_real_trl():
    """TRL's own block (TRL 1.0-1.12, where trl.experimental.ppo exists), run on TRL-built
    inputs, against compute_advantages and whiten_rewards."""
    ppo = _real_ppo()
    block = real_trl_block(inspect.getsource(ppo))
    inputs = trl_inputs(ppo, 12, 30, F32, seed=12)
    envs = {}
    for whiten in (False, True):
        env = envs[whiten] = run_block(ppo, block, inputs, whiten_rewards=whiten)
        adv, ret = compute_advantages(env["rewards"], env["values"], env["padding_mask"], 1.0, 0.95)
        _close(adv, env["advantages"], F32)
        _close(ret, env["returns"], F32)
    _close(whiten_rewards(envs[False]["rewards"], envs[False]["padding_mask_p1"]), envs[True]["rewards"], F32)


@pytest.mark.framework
@pytest.mark.parametrize("use_backend", ["cpu", "torch"], indirect=True)
@pytest.mark.parametrize("pad_is_eos", [False, True])
@pytest.mark.parametrize("B,T", [(1, 1), (5, 1), (9, 17)])
def test_real_trl_float64(use_backend, B, T, pad_is_eos):
    """TRL's block in float64 (torch's default dtype float64, so that its Bessel factor is exact)
    against compute_advantages to 1e-12, with pad == eos too and rows of every length."""
    ppo = _real_ppo()
    block = real_trl_block(inspect.getsource(ppo))
    inputs = trl_inputs(ppo, B, T, F64, seed=B * 10 + T, stop=PAD if pad_is_eos else EOS)
    for gamma, lam in COEFFICIENTS:
        with default_dtype(F64):
            try:
                env = run_block(ppo, block, inputs, gamma=gamma, lam=lam, kl_estimator="k1")
            except ValueError:  # no response token in the batch: TRL's masked_var raises
                env = None
        if env is None:
            continue
        adv, ret = compute_advantages(env["rewards"], env["values"], env["padding_mask"], gamma, lam)
        assert adv.dtype == ret.dtype == F64
        _close(adv, env["advantages"], F64)
        _close(ret, env["returns"], F64)


@pytest.mark.framework
@pytest.mark.parametrize("dtype", [F64, F32])
def test_real_trl_is_the_transcription(dtype):
    """This file's transcriptions (the oracle of the tests above) give TRL's own results."""
    ppo = _real_ppo()
    g = torch.Generator().manual_seed(21)
    values = torch.randn(6, 13, generator=g, dtype=F64).to(dtype)
    mask = torch.rand(6, 13, generator=g) < 0.7
    with default_dtype(dtype):
        for shift_mean in (True, False):
            _close(trl_masked_whiten(values, mask, shift_mean), ppo.masked_whiten(values, mask, shift_mean), dtype)
        _close(trl_masked_var(values, mask), ppo.masked_var(values, mask), dtype)
    responses = torch.randint(0, 5, (40, 9), generator=g)
    assert torch.equal(trl_first_true_indices(responses == EOS), ppo.first_true_indices(responses == EOS))
    assert torch.equal(trl_truncate_response(EOS, PAD, responses), ppo.truncate_response(EOS, PAD, responses))


@pytest.mark.framework
@pytest.mark.parametrize("whiten", [False, True])
def test_real_trl_with_the_docs_diff(whiten):
    """docs/trl.md's diff applies to the real PPOTrainer.train as it stands (its removed and
    context lines are there, in that order, indented as shown), and the edited step gives TRL's
    advantages, returns and whitened rewards."""
    ppo = _real_ppo()
    source = inspect.getsource(ppo)
    old, new = docs_diff()
    assert source.count(old) == 1, "docs/trl.md's diff does not apply to this TRL's ppo_trainer.py"
    edited = source.replace(old, new)
    inputs = trl_inputs(ppo, 10, 21, F32, seed=31)
    theirs = run_block(ppo, real_trl_block(source, last="empty_cache()"), inputs, whiten_rewards=whiten)
    ours = run_block(ppo, real_trl_block(edited, last="empty_cache()"), inputs, whiten_rewards=whiten)
    assert "lastgaelam" in theirs and "lastgaelam" not in ours  # the loop ran in TRL's only
    for name in ("advantages", "returns", "rewards"):
        _close(ours[name], theirs[name], F32)


@pytest.mark.framework
@pytest.mark.parametrize("page", ["trl"])
def test_framework_page_first_snippet_runs(page, tmp_path):
    """docs/trl.md's first ```python block runs as written in a fresh process, in the environment
    that has TRL (tests/test_docs.py runs the other framework pages')."""
    _real_ppo()
    done = run_python_block(f"docs/{page}.md", tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
