"""group_advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++ with baseline) against two references:

- a transcription of verl's per-group Python loops (``verl_*`` below), run on the same inputs;
- the independent float64 oracle written from the formulas of docs/semantics.md, section 16
  (``rl_triton.testing.oracle.group_advantages``).

Both references take the same ids the library takes (strings, ints, tuples, mixed), in shuffled
order, with groups of any size from 1 to 16.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from helpers import n_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_triton.core import groups
from rl_triton.core.groups import group_advantages
from rl_triton.testing.oracle import group_advantages as oracle

MODES = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")
RFPP = "reinforce_plus_plus_baseline"
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


# ---------------------------------------------------------------------------------------------
# verl's reference loops, transcribed.
# Source: volcengine/verl, verl/trainer/ppo/core_algos.py at commit 012be9d9dcb7c38499f23616142870d2682757fc
# (the 0.5-era code whose signatures take an ``Optional[AlgoConfig]``; the group loops are the same
# in later copies that also carry compute_grpo_vectorized_outcome_advantage):
# compute_grpo_outcome_advantage, compute_rloo_outcome_advantage,
# compute_reinforce_plus_plus_baseline_outcome_advantage; and verl/utils/torch_functional.py
# (masked_sum, masked_mean, masked_var, masked_whiten) in the version whose masked_sum selects
# with torch.where and whose masked_mean divides by mask.sum() + 1e-8.
# Each function starts from token-level rewards (the score is their row sum), keeps a dict from
# id to the list of its scores, and gives a group of one the float32 tensors 0.0 / 1.0 as mean / std.
# ---------------------------------------------------------------------------------------------


def _verl_group_lists(scores, index):
    by_id = defaultdict(list)
    for i in range(scores.shape[0]):
        by_id[index[i]].append(scores[i])
    return by_id


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        by_id = _verl_group_lists(scores, index)
        mean, std = {}, {}
        for key, members in by_id.items():
            if len(members) == 1:
                mean[key], std[key] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                stacked = torch.stack(members)
                mean[key], std[key] = torch.mean(stacked), torch.std(stacked)
        for i in range(scores.shape[0]):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - mean[index[i]]
        return scores.unsqueeze(-1) * response_mask


def verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        by_id = _verl_group_lists(scores, index)
        mean = {key: torch.tensor(0.0) if len(m) == 1 else torch.mean(torch.stack(m)) for key, m in by_id.items()}
        for i in range(scores.shape[0]):
            n = len(by_id[index[i]])
            if n > 1:  # a group of one keeps its raw score
                scores[i] = scores[i] * n / (n - 1) - mean[index[i]] * n / (n - 1)
        return scores.unsqueeze(-1) * response_mask


def verl_masked_sum(values, mask, axis=None):
    return torch.where(mask.bool(), values, 0.0).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_masked_var(values, mask, unbiased=True):
    centered = values - verl_masked_mean(values, mask)
    variance = verl_masked_mean(centered**2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0 or count == 1:
            raise ValueError("verl needs at least two valid tokens")
        variance = variance * (count / (count - 1))
    return variance


def verl_masked_whiten(values, mask):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_rfpp_baseline(token_level_rewards, response_mask, index):
    length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        by_id = _verl_group_lists(scores, index)
        mean = {key: torch.tensor(0.0) if len(m) == 1 else torch.mean(torch.stack(m)) for key, m in by_id.items()}
        for i in range(scores.shape[0]):
            scores[i] = scores[i] - mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, length]) * response_mask
        return verl_masked_whiten(scores, response_mask) * response_mask


def verl_reference(scores, index, mode, mask=None, eps=1e-6):
    """verl's result for ``group_advantages(scores, index, mode=mode, mask=mask, eps=eps)``.
    The score sits in the first token of the token-level rewards (a row sum of it and zeros is exact)."""
    index = index.tolist() if isinstance(index, torch.Tensor) else index  # verl's index is host-side
    m = mask if mask is not None else torch.ones(scores.shape[0], 1, dtype=torch.int64)
    tlr = torch.zeros(m.shape, dtype=scores.dtype)
    tlr[:, 0] = scores
    if mode == "grpo":
        res = verl_grpo(tlr, m, index, epsilon=eps)
    elif mode == "drgrpo":
        res = verl_grpo(tlr, m, index, epsilon=eps, norm_adv_by_std_in_grpo=False)
    elif mode == "rloo":
        res = verl_rloo(tlr, m, index)
    else:
        res = verl_rfpp_baseline(tlr, m, index)
    return res if mask is not None else res[:, 0]


# ---------------------------------------------------------------------------------------------
# building cases
# ---------------------------------------------------------------------------------------------

ID_STYLES = ("tensor_int64", "tensor_int32", "tensor_uint8", "numpy_str", "numpy_int", "numpy_mixed", "list_str",
             "list_int", "list_mixed", "list_tuple")


def make_ids(group_of, style, rng):
    """Ids for group numbers ``group_of`` (one per response) in a given style, plus plain labels
    (hashable, one per response) for the references."""
    G = int(group_of.max()) + 1 if group_of.size else 0
    if style == "tensor_uint8":
        keys = rng.permutation(256)[:G]
    else:
        keys = rng.choice(np.arange(-10**6, 10**6), size=G, replace=False)
    if style.startswith("tensor"):
        dt = {"tensor_int64": torch.int64, "tensor_int32": torch.int32, "tensor_uint8": torch.uint8}[style]
        ids = torch.tensor(keys[group_of], dtype=dt)
        return ids, ids.tolist()
    if style == "numpy_int":
        ids = keys[group_of]
        return ids, ids.tolist()
    if style in ("numpy_str", "list_str"):
        labels = [f"uid-{keys[g]}" for g in group_of]
    elif style in ("numpy_mixed", "list_mixed"):
        labels = [f"uid-{keys[g]}" if g % 2 else int(keys[g]) for g in group_of]
    elif style == "list_tuple":
        labels = [(int(keys[g]), "p") for g in group_of]
    else:
        labels = [int(keys[g]) for g in group_of]
    if style.startswith("numpy"):
        ids = np.empty(len(labels), dtype=object)
        ids[:] = labels
        return ids, labels
    return list(labels), labels


def make_scores(B, kind, dtype, rng):
    if kind == "binary":
        x = rng.integers(0, 2, B).astype(np.float64)
    elif kind == "dyadic":
        x = rng.integers(-40, 41, B) / 8.0
    else:
        x = rng.normal(0.5, 2.0, B)
    return torch.tensor(x, dtype=dtype)


def make_mask(B, L, rng, *, dtype=torch.int64, p_valid=0.7, p_empty_row=0.15):
    """A response mask with holes and rows without any valid token; at least two valid tokens."""
    m = rng.random((B, L)) < p_valid
    m[rng.random(B) < p_empty_row] = False
    if m.sum() < 2:
        m[0, :] = True
        if m.sum() < 2:
            m = np.concatenate([m, np.zeros((B, 1), bool)], 1)
            m[0, :] = True
    return torch.tensor(m).to(dtype)


def grouping(sizes, rng):
    """Group numbers, one per response, in shuffled order."""
    return rng.permutation(np.repeat(np.arange(len(sizes)), sizes))


def assert_close(got, expected, tol, what=""):
    g = got.detach().to(torch.float64).cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    e = expected.detach().to(torch.float64).cpu().numpy() if isinstance(expected, torch.Tensor) else expected
    e = np.asarray(e, dtype=np.float64)
    assert g.shape == e.shape, f"{what}: shape {g.shape} != {e.shape}"
    if not e.size:
        return
    same_nan = np.isnan(g) == np.isnan(e)
    assert same_nan.all(), f"{what}: NaN at different places: got {g}, expected {e}"
    fin = ~np.isnan(e)
    scale = max(1.0, float(np.max(np.abs(e[fin]), initial=0.0)))
    err = np.abs(g[fin] - e[fin])
    assert (err <= tol * scale).all(), f"{what}: max abs err {err.max()} > {tol} * {scale}\ngot {g}\nexpected {e}"


# ---------------------------------------------------------------------------------------------
# agreement with verl and with the oracle
# ---------------------------------------------------------------------------------------------

# verl's whitening forms its Bessel factor count / (count - 1) from integer tensors, in float32, and its
# masked mean divides by count + 1e-8 (which vanishes in float32): float64 results agree with it to
# float32 rounding of that factor, and with the exact float64 oracle to 1e-12.
VERL_TOL = {("grpo", torch.float64): 1e-12, ("drgrpo", torch.float64): 1e-12, ("rloo", torch.float64): 1e-12,
            (RFPP, torch.float64): 1e-7}


@st.composite
def cases(draw):
    sizes = draw(st.lists(st.integers(1, 16), min_size=1, max_size=12))
    mode = draw(st.sampled_from(MODES))
    return dict(
        sizes=sizes, mode=mode, style=draw(st.sampled_from(ID_STYLES)),
        dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        kind=draw(st.sampled_from(["normal", "binary", "dyadic"])),
        masked=mode == RFPP or draw(st.booleans()), L=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2**32 - 1)),
    )


def run_case(c):
    rng = np.random.default_rng(c["seed"])
    group_of = grouping(c["sizes"], rng)
    B = group_of.size
    ids, labels = make_ids(group_of, c["style"], rng)
    dtype = c["dtype"]
    scores = make_scores(B, c["kind"], dtype, rng)
    mask = make_mask(B, c["L"], rng) if c["masked"] else None
    before = scores.clone()
    got = group_advantages(scores, ids, mode=c["mode"], mask=mask, backend=c.get("backend"))
    assert torch.equal(scores, before), "scores were modified"
    assert got.dtype == dtype and got.shape == ((B,) if mask is None else tuple(mask.shape))
    ref = verl_reference(scores.clone(), ids, c["mode"], mask)
    assert_close(got, ref, VERL_TOL.get((c["mode"], dtype), TOL[dtype]), f"verl {c}")
    exact = oracle(scores.double().numpy(), labels, c["mode"], None if mask is None else mask.numpy())
    assert_close(got, exact, TOL[dtype], f"oracle {c}")


@settings(max_examples=n_examples(30), deadline=None)
@given(c=cases())
def test_matches_verl_and_oracle(c):
    run_case(c)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sizes", [[1], [1, 1, 1, 1, 1], [1, 3, 1, 2, 1], [2], [16, 1, 7]], ids=str)
@pytest.mark.parametrize("style", ["tensor_int64", "numpy_str", "list_int"])
def test_edge_groupings(mode, dtype, sizes, style):
    """B = 1, all groups of one, groups of one among others, one group of two."""
    for kind in ("normal", "binary"):
        run_case(dict(sizes=sizes, mode=mode, style=style, dtype=dtype, kind=kind, masked=mode == RFPP, L=3,
                      seed=len(sizes)))


@pytest.mark.parametrize("mode", MODES)
def test_float32_continuous_scores_match_oracle(mode):
    """Continuous float32 scores, 60 groups: float32 accumulation agrees with float64 math on the same data."""
    rng = np.random.default_rng(7)
    group_of = grouping(rng.integers(1, 17, 60), rng)
    ids, labels = make_ids(group_of, "numpy_str", rng)
    scores = make_scores(group_of.size, "normal", torch.float32, rng)
    mask = make_mask(group_of.size, 5, rng)
    for m in (None, mask) if mode != RFPP else (mask,):
        got = group_advantages(scores, ids, mode=mode, mask=m)
        assert_close(got, oracle(scores.double().numpy(), labels, mode, None if m is None else m.numpy()), 1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_large_batch(mode):
    """8192 responses in groups of 8 to 16, shuffled, against verl's loops."""
    rng = np.random.default_rng(11)
    sizes = []
    while sum(sizes) < 8192:
        sizes.append(int(rng.integers(8, 17)))
    sizes[-1] -= sum(sizes) - 8192
    group_of = grouping([s for s in sizes if s > 0], rng)
    ids, labels = make_ids(group_of, "numpy_str", rng)
    scores = make_scores(8192, "normal", torch.float64, rng)
    mask = make_mask(8192, 16, rng) if mode == RFPP else None
    got = group_advantages(scores, ids, mode=mode, mask=mask)
    assert got.shape == ((8192,) if mask is None else (8192, 16))
    assert_close(got, verl_reference(scores.clone(), ids, mode, mask), VERL_TOL[(mode, torch.float64)])
    assert_close(got, oracle(scores.numpy(), labels, mode, None if mask is None else mask.numpy()), 1e-12)
    s32 = make_scores(8192, "binary", torch.float32, rng)
    got32 = group_advantages(s32, torch.tensor(group_of), mode=mode, mask=mask)
    assert_close(got32, verl_reference(s32.clone(), group_of.tolist(), mode, mask), 1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("style", ["tensor_int64", "tensor_int32", "tensor_uint8"])
def test_sort_path(monkeypatch, mode, style):
    """Tensor ids on an accelerator are factorised by a sort on the device; run that path on CPU."""
    rng = np.random.default_rng(3)
    group_of = grouping(rng.integers(1, 17, 12), rng)
    ids, labels = make_ids(group_of, style, rng)
    scores = make_scores(group_of.size, "normal", torch.float64, rng)
    mask = make_mask(group_of.size, 4, rng) if mode == RFPP else None
    expected = group_advantages(scores, ids, mode=mode, mask=mask)
    codes, nbuf = groups._sorted_codes(ids)
    assert nbuf == ids.numel() and codes.dtype == torch.int64
    # the same partition as the host factorisation
    uniq_codes, _ = groups._unique_codes(ids, torch.device("cpu"))
    pairs = set(zip(codes.tolist(), uniq_codes.tolist(), strict=True))
    assert len(pairs) == len(set(codes.tolist())) == len(set(uniq_codes.tolist()))
    monkeypatch.setattr(groups, "_unique_codes", lambda i, device: groups._sorted_codes(i.to(device)))
    got = group_advantages(scores, ids, mode=mode, mask=mask)
    assert_close(got, expected, 1e-12)
    assert_close(got, oracle(scores.numpy(), labels, mode, None if mask is None else mask.numpy()), 1e-12)


# ---------------------------------------------------------------------------------------------
# conventions
# ---------------------------------------------------------------------------------------------


def test_group_of_one_rules():
    s = torch.tensor([3.0, -2.0], dtype=torch.float64)
    ids = ["a", "b"]
    one_eps = float(np.float32(1.0) + np.float32(1e-6))
    assert torch.equal(group_advantages(s, ids), s / one_eps)  # float32 std 1 plus eps, as verl
    assert torch.equal(group_advantages(s, ids, mode="drgrpo"), s)
    assert torch.equal(group_advantages(s, ids, mode="rloo"), s)  # RLOO keeps the raw score of a lone response
    assert torch.equal(group_advantages(s, ids, mode="grpo", eps=0.0), s)


def test_known_values():
    s = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0, 0.5], dtype=torch.float64)
    ids = np.array(["a", "b", "a", "b", "b", "c"], dtype=object)
    # group a: mean 2, std sqrt(2); group b: mean 14/3, std sqrt(19/3); c alone
    sa, sb = np.sqrt(2.0), np.sqrt(19 / 3)
    one_eps = float(np.float32(1.0) + np.float32(1e-6))
    grpo = [-1 / (sa + 1e-6), (2 - 14 / 3) / (sb + 1e-6), 1 / (sa + 1e-6), (5 - 14 / 3) / (sb + 1e-6),
            (7 - 14 / 3) / (sb + 1e-6), 0.5 / one_eps]
    assert_close(group_advantages(s, ids), np.array(grpo), 1e-14)
    assert_close(group_advantages(s, ids, mode="drgrpo"), np.array([-1, 2 - 14 / 3, 1, 5 - 14 / 3, 7 - 14 / 3, 0.5]),
                 1e-15)
    assert_close(group_advantages(s, ids, mode="rloo"), np.array([-2, -4, 2, 0.5, 3.5, 0.5]), 1e-15)


def test_constant_groups_give_exact_zeros():
    """Equal scores in a group have deviation exactly 0 (the group sums are shifted by a member),
    so GRPO does not divide rounding noise by eps."""
    s = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], dtype=torch.float32)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2])
    for mode in ("grpo", "drgrpo", "rloo"):
        assert torch.equal(group_advantages(s, ids, mode=mode), torch.zeros(12))


def test_mask_dtypes_and_flags():
    """Any mask dtype; nonzero means valid, and masked-out positions are 0."""
    rng = np.random.default_rng(5)
    group_of = grouping([3, 1, 4, 2], rng)
    s = make_scores(group_of.size, "normal", torch.float64, rng)
    m = make_mask(group_of.size, 6, rng, dtype=torch.bool)
    for mode in MODES:
        ref = group_advantages(s, group_of, mode=mode, mask=m)
        for dt in (torch.uint8, torch.int32, torch.int64, torch.float32, torch.float64):
            assert torch.equal(group_advantages(s, group_of, mode=mode, mask=m.to(dt)), ref)
        # a non-binary mask reads as a flag
        assert torch.equal(group_advantages(s, group_of, mode=mode, mask=m.to(torch.float64) * 0.5), ref)
        if mode != RFPP:
            assert torch.equal(ref, group_advantages(s, group_of, mode=mode)[:, None] * m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_half_precision_accumulates_in_float32(dtype, mode):
    rng = np.random.default_rng(2)
    group_of = grouping([5, 1, 8, 3], rng)
    s = make_scores(group_of.size, "normal", dtype, rng)
    mask = make_mask(group_of.size, 4, rng)
    got = group_advantages(s, group_of.tolist(), mode=mode, mask=mask)
    assert got.dtype == dtype
    assert torch.equal(got, group_advantages(s.float(), group_of.tolist(), mode=mode, mask=mask).to(dtype))


def test_out():
    rng = np.random.default_rng(4)
    group_of = grouping([4, 1, 3], rng)
    s = make_scores(group_of.size, "normal", torch.float32, rng)
    mask = make_mask(group_of.size, 5, rng)
    for mode in MODES:
        m = mask if mode == RFPP else None
        expected = group_advantages(s, group_of, mode=mode, mask=m)
        out = torch.full(expected.shape, float("nan"))
        assert group_advantages(s, group_of, mode=mode, mask=m, out=out) is out
        assert torch.equal(out, expected)
    # out= may be the scores themselves (verl overwrites its scores in place)
    alias = s.clone()
    assert group_advantages(alias, group_of, out=alias) is alias
    assert torch.equal(alias, group_advantages(s, group_of))


def test_empty():
    for ids in (torch.zeros(0, dtype=torch.int64), [], np.array([], dtype=object)):
        assert group_advantages(torch.zeros(0), ids).shape == (0,)
        got = group_advantages(torch.zeros(0, dtype=torch.float64), ids, mode=RFPP, mask=torch.zeros(0, 7))
        assert got.shape == (0, 7) and got.dtype == torch.float64
        out = torch.zeros(0)
        assert group_advantages(torch.zeros(0), ids, out=out) is out


def test_id_types():
    """Integer ids of any width, and ids that do not sort (mixed types) in a numpy object array."""
    s = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    expected = group_advantages(s, [0, 1, 0, 1])
    for dt in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
               torch.uint64):
        assert torch.equal(group_advantages(s, torch.tensor([3, 9, 3, 9]).to(dt)), expected)
    mixed = np.empty(4, dtype=object)
    mixed[:] = ["x", 1, "x", 1]
    assert torch.equal(group_advantages(s, mixed), expected)
    assert torch.equal(group_advantages(s, ("x", None, "x", None)), expected)
    assert torch.equal(group_advantages(s, np.array([2.5, -1.0, 2.5, -1.0])), expected)


# ---------------------------------------------------------------------------------------------
# non-finite scores
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ("grpo", "drgrpo", "rloo"))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nan_stays_in_its_group(mode, dtype):
    rng = np.random.default_rng(9)
    group_of = grouping([4, 1, 6, 3, 1], rng)
    s = make_scores(group_of.size, "normal", dtype, rng)
    clean = group_advantages(s, group_of, mode=mode)
    # a group of four, at its first member (the one the group sums are taken relative to) and its
    # last; a group of one
    for g, k in ((0, 0), (0, -1), (1, 0)):
        bad = s.clone()
        bad[np.flatnonzero(group_of == g)[k]] = float("nan")
        got = group_advantages(bad, group_of, mode=mode)
        inside = torch.from_numpy(group_of == g)
        assert torch.isnan(got[inside]).all()
        assert torch.equal(got[~inside], clean[~inside])
        mask = make_mask(group_of.size, 3, rng)
        got_m = group_advantages(bad, group_of, mode=mode, mask=mask)
        # NaN where the group's tokens are valid; masked-out positions hold 0
        valid = mask != 0
        assert torch.isnan(got_m[inside[:, None] & valid]).all()
        assert (got_m[~valid] == 0).all()
        assert torch.equal(got_m[~inside], (clean[:, None] * mask)[~inside])


def test_nan_in_reinforce_plus_plus_baseline_reaches_the_batch_through_the_whitening():
    s = torch.tensor([1.0, float("nan"), 3.0, 0.0, 2.0], dtype=torch.float64)
    ids = [0, 0, 1, 1, 2]
    mask = torch.ones(5, 3, dtype=torch.int64)
    got = group_advantages(s, ids, mode=RFPP, mask=mask)
    assert torch.isnan(got).all()
    # a response without valid tokens does not enter the whitening: a NaN there stays out of it
    mask[4] = 0
    s2 = s.clone()
    s2[1] = 0.0
    s2[4] = float("nan")
    got = group_advantages(s2, ids, mode=RFPP, mask=mask)
    assert torch.isfinite(got).all() and (got[4] == 0).all()
    assert_close(got, oracle(s2.numpy(), ids, RFPP, mask.numpy()), 1e-12)
    clean = s2.clone()
    clean[4] = 123.0
    assert torch.equal(got, group_advantages(clean, ids, mode=RFPP, mask=mask))


# ---------------------------------------------------------------------------------------------
# bad inputs: each error names the argument
# ---------------------------------------------------------------------------------------------

S = torch.zeros(4)
IDS = [0, 0, 1, 1]


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(scores=[1.0, 2.0, 3.0, 4.0]), TypeError, "scores"),
    (dict(scores=torch.zeros(4, dtype=torch.int64)), TypeError, "scores"),
    (dict(scores=torch.zeros(2, 2)), ValueError, "scores"),
    (dict(scores=torch.tensor(1.0)), ValueError, "scores"),
    (dict(group_ids=[0, 0, 1]), ValueError, "group_ids"),
    (dict(group_ids=torch.zeros(5, dtype=torch.int64)), ValueError, "group_ids"),
    (dict(group_ids=torch.zeros(4)), TypeError, "group_ids"),
    (dict(group_ids=torch.zeros(4, dtype=torch.bool)), TypeError, "group_ids"),
    (dict(group_ids=torch.zeros(2, 2, dtype=torch.int64)), ValueError, "group_ids"),
    (dict(group_ids=np.zeros((2, 2))), ValueError, "group_ids"),
    (dict(group_ids="abcd"), TypeError, "group_ids"),
    (dict(group_ids=[[0], [0], [1], [1]]), TypeError, "group_ids"),
    (dict(mode="ppo"), ValueError, "mode"),
    (dict(mode=None), ValueError, "mode"),
    (dict(mode=RFPP), ValueError, "mask"),
    (dict(mask=torch.ones(4)), ValueError, "mask"),
    (dict(mask=torch.ones(3, 2)), ValueError, "mask"),
    (dict(mask=torch.ones(4, 2, dtype=torch.complex64)), TypeError, "mask"),
    (dict(mask=np.ones((4, 2))), TypeError, "mask"),
    (dict(eps=-1e-6), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(eps="1e-6"), TypeError, "eps"),
    (dict(eps=True), TypeError, "eps"),
    (dict(eps=torch.tensor(1e-6)), TypeError, "eps"),
    (dict(out=torch.zeros(5)), ValueError, "out"),
    (dict(out=torch.zeros(4, dtype=torch.float64)), ValueError, "out"),
    (dict(out=torch.zeros(4, 2)), ValueError, "out"),
    (dict(out=torch.zeros(1).expand(4)), ValueError, "out"),
    (dict(out=torch.zeros(4, dtype=torch.int64)), TypeError, "out"),
    (dict(mask=torch.ones(4, 2), out=torch.zeros(4)), ValueError, "out"),
    (dict(scores=torch.zeros(4, requires_grad=True), out=torch.zeros(4)), ValueError, "out"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(backend=3), TypeError, "backend"),
])
def test_bad_inputs(kwargs, exc, name):
    args = dict(scores=S, group_ids=IDS)
    args.update(kwargs)
    out_before = args["out"].clone() if "out" in args else None
    with pytest.raises(exc, match=name):
        group_advantages(args.pop("scores"), args.pop("group_ids"), **args)
    if out_before is not None:
        assert torch.equal(args["out"], out_before), "out was written on error"


def test_whitening_with_fewer_than_two_valid_tokens():
    """verl's masked_var raises there; here the arithmetic decides, with no host sync: one valid token
    gives 0/0 = NaN at it, no valid token gives an all-zero (all masked) result."""
    s = torch.tensor([1.0, 2.0, 3.0])
    got = group_advantages(s, [0, 0, 1], mode=RFPP, mask=torch.tensor([[1, 0], [0, 0], [0, 0]]))
    assert torch.isnan(got[0, 0]) and (got.flatten()[1:] == 0).all()
    assert (group_advantages(s, [0, 0, 1], mode=RFPP, mask=torch.zeros(3, 2)) == 0).all()
    with pytest.raises(ValueError, match="two"):
        verl_reference(s.clone(), [0, 0, 1], RFPP, torch.tensor([[1, 0], [0, 0], [0, 0]]))


# ---------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_gradients(mode):
    """Differentiable in the scores, with finite gradients for groups of one and groups of equal scores."""
    rng = np.random.default_rng(6)
    group_of = grouping([3, 1, 2, 4], rng)
    s = make_scores(group_of.size, "normal", torch.float64, rng).requires_grad_()
    mask = make_mask(group_of.size, 3, rng) if mode == RFPP else None
    assert torch.autograd.gradcheck(lambda x: group_advantages(x, group_of, mode=mode, mask=mask), (s,))
    flat = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.5], dtype=torch.float64, requires_grad=True)
    m = torch.ones(6, 2) if mode == RFPP else None
    group_advantages(flat, [0, 0, 1, 1, 2, 3], mode=mode, mask=m).sum().backward()
    assert torch.isfinite(flat.grad).all()


# ---------------------------------------------------------------------------------------------
# the all-pairs Triton kernel (rl_triton/core/kernels/groups.py), on CPU tensors in the Triton
# interpreter: TRITON_INTERPRET=1 set before anything imports triton, as conftest.py says
# ---------------------------------------------------------------------------------------------

from rl_triton.core import kernels as _kernels  # noqa: E402  (imports without triton: AVAILABLE is False then)

needs_interpreter = pytest.mark.skipif(
    not (_kernels.AVAILABLE and _kernels.INTERPRET),
    reason="the Triton kernel runs on CPU tensors only in the interpreter: needs triton and TRITON_INTERPRET=1 "
           "set before import",
)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 4 responses by 8, so that small batches cross tile boundaries both ways."""
    from rl_triton.core.kernels import groups as k

    monkeypatch.setattr(k, "BLOCK_I", 4)
    monkeypatch.setattr(k, "BLOCK_J", 8)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the all-pairs launches, so that a test sees which path a call took."""
    calls = []
    launch = groups._all_pairs

    def counted(*args):
        calls.append(args[0].shape[0])
        return launch(*args)

    monkeypatch.setattr(groups, "_all_pairs", counted)
    return calls


@needs_interpreter
@settings(max_examples=n_examples(15), deadline=None)
@given(c=cases())
def test_kernel_matches_verl_and_oracle(small_tiles, c):
    run_case(dict(c, backend="triton"))


@needs_interpreter
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("style", ["tensor_int64", "tensor_int32", "numpy_str", "list_int"])
def test_kernel_shuffled_groups(kernel_calls, mode, dtype, style):
    """Groups of 1 to 16 in shuffled order, several of one, at the default tiles: 300 responses,
    several tiles of the responses a program compares with, the last ones partial."""
    sizes = [1, 16, 3, 1, 9, 2, 16, 1, 12, 5, 14, 1, 7, 16, 4, 8, 11, 1, 15, 6, 10, 13, 1, 6, 2, 16, 15, 14, 13,
             12, 11, 10, 8, 5, 1, 14]
    assert sum(sizes) == 300
    for kind in ("normal", "dyadic"):
        run_case(dict(sizes=sizes, mode=mode, style=style, dtype=dtype, kind=kind, masked=mode == RFPP, L=3,
                      seed=sum(map(ord, style)), backend="triton"))
    assert kernel_calls == [300, 300]


@needs_interpreter
@pytest.mark.parametrize("B", [1, 3, 4, 5, 8, 9, 17, 40])
def test_kernel_tile_boundaries(small_tiles, kernel_calls, B):
    """B below, at and above multiples of the tiles (4 responses a program, 8 at a time)."""
    rng = np.random.default_rng(B)
    sizes, left = [], B
    while left:
        sizes.append(min(left, int(rng.integers(1, 7))))
        left -= sizes[-1]
    for mode in MODES:
        for dtype in (torch.float32, torch.float64):
            run_case(dict(sizes=sizes, mode=mode, style="tensor_int64", dtype=dtype, kind="normal",
                          masked=mode == RFPP, L=2, seed=B, backend="triton"))
    assert kernel_calls == [B] * 8


@needs_interpreter
def test_kernel_known_values_and_group_of_one():
    s = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0, 0.5], dtype=torch.float64)
    ids = torch.tensor([10, 20, 10, 20, 20, 30])
    sa, sb = np.sqrt(2.0), np.sqrt(19 / 3)
    one_eps = float(np.float32(1.0) + np.float32(1e-6))
    grpo = [-1 / (sa + 1e-6), (2 - 14 / 3) / (sb + 1e-6), 1 / (sa + 1e-6), (5 - 14 / 3) / (sb + 1e-6),
            (7 - 14 / 3) / (sb + 1e-6), 0.5 / one_eps]
    assert_close(group_advantages(s, ids, backend="triton"), np.array(grpo), 1e-14)
    assert_close(group_advantages(s, ids, mode="drgrpo", backend="triton"),
                 np.array([-1, 2 - 14 / 3, 1, 5 - 14 / 3, 7 - 14 / 3, 0.5]), 1e-15)
    assert_close(group_advantages(s, ids, mode="rloo", backend="triton"), np.array([-2, -4, 2, 0.5, 3.5, 0.5]), 1e-15)
    lone = torch.tensor([3.0, -2.0], dtype=torch.float64)
    assert torch.equal(group_advantages(lone, ["a", "b"], backend="triton"), lone / one_eps)
    assert torch.equal(group_advantages(lone, ["a", "b"], eps=0.0, backend="triton"), lone)
    for mode in ("drgrpo", "rloo"):
        assert torch.equal(group_advantages(lone, ["a", "b"], mode=mode, backend="triton"), lone)
    assert torch.equal(group_advantages(lone[:1], [7], backend="triton"), lone[:1] / one_eps)  # B = 1


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_constant_groups_give_exact_zeros(small_tiles, dtype):
    s = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 1e8, 1e8], dtype=dtype)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 5, 5])
    perm = torch.from_numpy(np.random.default_rng(1).permutation(14))
    for mode in ("grpo", "drgrpo", "rloo"):
        got = group_advantages(s[perm], ids[perm], mode=mode, backend="triton")
        assert torch.equal(got, torch.zeros(14, dtype=dtype))
        assert not torch.signbit(got).any()  # +0, not -0


@needs_interpreter
@pytest.mark.parametrize("mode", ("grpo", "drgrpo", "rloo"))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_nan_stays_in_its_group(small_tiles, mode, dtype):
    rng = np.random.default_rng(9)
    group_of = grouping([4, 1, 6, 3, 1], rng)
    ids = torch.from_numpy(group_of)
    s = make_scores(group_of.size, "normal", dtype, rng)
    clean = group_advantages(s, ids, mode=mode, backend="triton")
    assert_close(clean, oracle(s.double().numpy(), group_of.tolist(), mode), TOL[dtype])
    for g, k in ((0, 0), (0, -1), (1, 0)):
        bad = s.clone()
        bad[np.flatnonzero(group_of == g)[k]] = float("nan")
        got = group_advantages(bad, ids, mode=mode, backend="triton")
        inside = torch.from_numpy(group_of == g)
        assert torch.isnan(got[inside]).all()
        assert torch.equal(got[~inside], clean[~inside])


@needs_interpreter
def test_kernel_id_types(kernel_calls):
    """Integer tensors of every width (compared as int32 or int64), numpy arrays, lists, strings,
    ids that do not sort."""
    s = torch.tensor([1.0, 2.0, 4.0, 8.0, 3.0], dtype=torch.float64)
    expected = torch.from_numpy(oracle(s.numpy(), [0, 1, 0, 1, 2], "grpo"))
    for dt in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
               torch.uint64):
        assert_close(group_advantages(s, torch.tensor([3, 9, 3, 9, 100]).to(dt), backend="triton"), expected, 1e-14)
    big = torch.tensor([2**62, 2**62 + 2**32, 2**62, 2**62 + 2**32, -2**62])  # equal low 32 bits across groups
    assert_close(group_advantages(s, big, backend="triton"), expected, 1e-14)
    mixed = np.empty(5, dtype=object)
    mixed[:] = ["x", 1, "x", 1, (2, "y")]
    for ids in (mixed, ["x", None, "x", None, 2.5], np.array(["u", "v", "u", "v", "w"]),
                np.array([2.5, -1, 2.5, -1, 0])):
        assert_close(group_advantages(s, ids, backend="triton"), expected, 1e-14)
    assert kernel_calls == [5] * 13


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision(dtype):
    """Half-precision scores are read as they are and accumulate in float32."""
    rng = np.random.default_rng(2)
    group_of = grouping([5, 1, 8, 3], rng)
    s = make_scores(group_of.size, "normal", dtype, rng)
    for mode in ("grpo", "rloo"):
        got = group_advantages(s, torch.from_numpy(group_of), mode=mode, backend="triton")
        assert got.dtype == dtype
        want = oracle(s.double().numpy(), group_of.tolist(), mode)
        assert_close(got, want, 1e-2 if dtype == torch.bfloat16 else 2e-3)


@needs_interpreter
def test_kernel_out_mask_and_empty(small_tiles):
    rng = np.random.default_rng(4)
    group_of = grouping([4, 1, 3, 2], rng)
    ids = torch.from_numpy(group_of)
    s = make_scores(group_of.size, "normal", torch.float32, rng)
    mask = make_mask(group_of.size, 5, rng, dtype=torch.bool)
    for mode in MODES:
        m = mask if mode == RFPP else None
        want = oracle(s.double().numpy(), group_of.tolist(), mode, None if m is None else m.numpy())
        out = torch.full(want.shape, float("nan"))
        assert group_advantages(s, ids, mode=mode, mask=m, out=out, backend="triton") is out
        assert_close(out, want, 1e-6)
        # the mask broadcasts the advantages over the valid tokens, 0 elsewhere
        got = group_advantages(s, ids, mode=mode, mask=mask, backend="triton")
        assert got.shape == mask.shape and (got[~mask] == 0).all()
        assert_close(got, oracle(s.double().numpy(), group_of.tolist(), mode, mask.numpy()), 1e-6)
    alias = s.clone()  # out= the scores themselves: the kernel writes a buffer, copied after it has read them all
    assert group_advantages(alias, ids, out=alias, backend="triton") is alias
    assert_close(alias, oracle(s.double().numpy(), group_of.tolist(), "grpo"), 1e-6)
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64), backend="triton").shape == (0,)
    got = group_advantages(torch.zeros(0), [], mode=RFPP, mask=torch.zeros(0, 3), backend="triton")
    assert got.shape == (0, 3)


@needs_interpreter
def test_kernel_size_switch(monkeypatch, kernel_calls):
    """Above PAIRS_MAX_B responses the call takes the sort / scatter path, with the same results."""
    rng = np.random.default_rng(8)
    group_of = grouping([3, 1, 5, 2, 4], rng)
    ids = torch.from_numpy(group_of)
    s = make_scores(group_of.size, "normal", torch.float64, rng)
    want = oracle(s.numpy(), group_of.tolist(), "grpo")
    monkeypatch.setattr(groups, "PAIRS_MAX_B", group_of.size)
    assert_close(group_advantages(s, ids, backend="triton"), want, 1e-12)
    assert kernel_calls == [group_of.size]
    monkeypatch.setattr(groups, "PAIRS_MAX_B", group_of.size - 1)
    assert_close(group_advantages(s, ids, backend="triton"), want, 1e-12)
    assert kernel_calls == [group_of.size]  # not called again


@needs_interpreter
def test_kernel_leaves_gradients_and_other_backends_to_torch(kernel_calls):
    s = torch.tensor([1.0, 2.0, 4.0, 0.5], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 0, 1, 1])
    got = group_advantages(s, ids, backend="triton")
    assert got.grad_fn is not None and kernel_calls == []
    assert torch.autograd.gradcheck(lambda x: group_advantages(x, ids, backend="triton"), (s,))
    with torch.no_grad():
        group_advantages(s, ids, backend="triton")
    assert kernel_calls == [4]
    group_advantages(s.detach(), ids, backend="torch")
    assert kernel_calls == [4]


# ---------------------------------------------------------------------------------------------
# huge and infinite scores: every backend alike (the all-pairs kernel's one-pass sums once
# overflowed to NaN and gave +-2e26 where the torch path gives 0)
# ---------------------------------------------------------------------------------------------

GROUP_BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_huge_scores_overflow_to_an_infinite_std(small_tiles, backend, scale):
    """float32 statistics of [1, -1, 3] * 1e20: the squared deviations overflow, so the std is
    inf and the GRPO advantages are +-0; the deviations themselves are finite."""
    s = torch.tensor([1.0, -1.0, 3.0], dtype=torch.float32) * scale
    ids = torch.zeros(3, dtype=torch.int64)
    got = group_advantages(s, ids, backend=backend)
    assert torch.equal(got.abs(), torch.zeros(3))
    dev = group_advantages(s, ids, mode="drgrpo", backend=backend).double()
    assert_close(dev, s.double().numpy() - s.double().mean().item(), 1e-6)
    # finite M2 although S2 of an outlying response overflows: a group of many equal scores and one apart
    s = torch.tensor([1.5e19] * 15 + [0.0], dtype=torch.float32)
    ids = torch.zeros(16, dtype=torch.int64)
    assert_close(group_advantages(s, ids, backend=backend), oracle(s.double().numpy(), [0] * 16, "grpo"), 1e-5)


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ("grpo", "drgrpo", "rloo"))
def test_infinite_score_makes_its_group_nan_in_any_order(small_tiles, backend, dtype, mode):
    inf = float("inf")
    for scores in ([inf, 2.0], [2.0, inf], [1.0, -inf, 5.0], [inf, -inf, 0.0]):
        s = torch.tensor(scores + [0.5, 1.5], dtype=dtype)
        ids = torch.tensor([0] * len(scores) + [1, 1])
        got = group_advantages(s, ids, mode=mode, backend=backend)
        assert torch.isnan(got[:len(scores)]).all(), (scores, got)
        assert torch.equal(got[len(scores):], group_advantages(s[len(scores):], ids[len(scores):], mode=mode,
                                                               backend=backend))
    lone = torch.tensor([inf, 1.0], dtype=dtype)  # a group of one keeps its rule: s / (1 + eps), s
    assert torch.equal(group_advantages(lone, [0, 1], mode=mode, backend=backend)[:1].isinf(), torch.tensor([True]))
