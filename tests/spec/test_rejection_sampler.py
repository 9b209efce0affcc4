"""Rejection sampler: losslessness (chi-square, with mutated samplers proving the test's power), exact
greedy cases, padding / -1 fill / invalid rows, the vectorised reference against a literal per-row
reading of the contract, seeded randomness, and the front-end.

The helpers here (`random_case`, `naive_rejection_sample`, the chi-square machinery) are shared with
tests/kernels/test_rejection_sample_triton.py, which runs the same checks through the Triton kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from asyncspec.kernels.rejection_sample import rejection_sample_ref
from asyncspec.layers.sampler import make_generator
from asyncspec.spec.rejection_sampler import (
    BACKEND_ENV,
    RejectionSampler,
    draw_rejection_randomness,
    select_rejection_kernel,
)

Kernel = Callable[..., tuple[Tensor, Tensor]]
TINY = torch.finfo(torch.float32).tiny
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------------------------- helpers


def exponentials(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.empty(*shape).exponential_(generator=gen).clamp_min(TINY)


def naive_rejection_sample(p, x, q, c, greedy, u, e) -> tuple[Tensor, Tensor]:
    """The contract read literally, one row and one position at a time (float32 scalar arithmetic)."""
    n_rows, k1, vocab = p.shape
    k = k1 - 1
    out = torch.full((n_rows, k1), -1, dtype=torch.int64)
    accepted = torch.zeros(n_rows, dtype=torch.int64)
    for n in range(n_rows):
        cn = min(max(int(c[n]), 0), k)
        a = 0
        for j in range(cn):
            xj = int(x[n, j])
            if not 0 <= xj < vocab:
                break
            if bool(greedy[n]):
                if not bool(torch.isfinite(p[n, j]).all()) or xj != int(p[n, j].argmax()):
                    break
            else:
                qx = torch.tensor(1.0) if q is None else q[n, j, xj]
                if not bool(u[n, j] * qx < p[n, j, xj]):
                    break
            a += 1
        out[n, :a] = x[n, :a]
        pa = p[n, a]
        bad = not bool(torch.isfinite(pa).all()) or not bool(pa.max() > 0)
        if bool(greedy[n]):
            token = int(pa.argmax())
        else:
            dist = pa
            if a < cn:  # rejection at a: residual max(p - q, 0), or p when it has no mass
                qa = (torch.arange(vocab) == x[n, a]).float() if q is None else q[n, a]
                bad = bad or not bool(torch.isfinite(qa).all())
                if bool((pa - qa > 0).any()):
                    dist = (pa - qa).clamp_min(0)
            token = int((dist / e[n]).argmax())
        out[n, a] = -1 if bad else token
        accepted[n] = a
    return out, accepted


def random_case(gen: torch.Generator, n: int, k: int, vocab: int, with_q: bool = True, edge: bool = True) -> dict:
    """Mixed greedy/stochastic rows, varied c, zeros and ties in p and q, drafts that match the argmax,
    drafts sampled from q, padding, and (with edge) rows with NaN / inf / all-zero distributions,
    out-of-range drafts, p == q rows and exact-zero uniforms."""

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    p = (torch.randn(n, k + 1, vocab, generator=gen) * 2).softmax(-1)
    p = torch.where(rand(n, k + 1, vocab) < 0.3, torch.zeros_like(p), p)  # truncation leaves zeros
    p[:, :, 0] += 1e-3  # no all-zero rows by accident
    p = p / p.sum(-1, keepdim=True)
    tie_rows = rand(n, k + 1) < 0.1
    p = torch.where(tie_rows.unsqueeze(-1), torch.full_like(p, 1.0 / vocab), p)  # argmax ties: lowest index
    q = (torch.randn(n, k, vocab, generator=gen) * 2).softmax(-1)
    q = torch.where(rand(n, k, vocab) < 0.2, torch.zeros_like(q), q)
    q[:, :, -1] += 1e-3
    q = q / q.sum(-1, keepdim=True)
    same = rand(n, k) < 0.15
    q = torch.where(same.unsqueeze(-1), p[:, :k], q)  # p == q: always accepted unless out of support
    sampled = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(n, k)
    argmax = p[:, :k].argmax(-1)
    x = torch.where(rand(n, k) < 0.6, argmax, sampled)
    c = torch.randint(0, k + 1, (n,), generator=gen)
    greedy = rand(n) < 0.4
    u = rand(n, k)
    e = exponentials(gen, n, vocab)
    if edge and n >= 8 and k > 0:
        u[0] = 0.0  # accept iff p(x) > 0
        e[1, : vocab // 2] = TINY
        x[2, 0] = vocab + 3  # out-of-range valid draft: never accepted
        c[2] = max(c[2], 1)
        p[3, torch.randint(0, k + 1, (), generator=gen)] = NAN
        p[4, -1] = 0.0  # no mass at the bonus position
        p[5, 0, 1] = INF
        q[6, 0, 2] = NAN
        x[7, 0], c[7] = int(argmax[7, 0]), k  # a greedy-style draft in a row that may be stochastic
    return dict(
        target_probs=p,
        draft_token_ids=x,
        draft_probs=q if with_q else None,
        num_draft_tokens=c,
        is_greedy=greedy,
        uniform=u,
        exponential=e,
    )


def check_equal(got: tuple[Tensor, Tensor], expected: tuple[Tensor, Tensor]) -> None:
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.int64
    assert got[0].tolist() == expected[0].tolist(), (got[0], expected[0])
    assert got[1].tolist() == expected[1].tolist()


def check_output_shape(out: Tensor, accepted: Tensor, case: dict) -> None:
    """Accepted drafts at 0..a-1, one token (or -1) at a, -1 after; a <= c; ids in [-1, V)."""
    vocab = case["target_probs"].shape[-1]
    c = case["num_draft_tokens"]
    assert (accepted >= 0).all() and (accepted <= c).all()
    pos = torch.arange(out.shape[1])
    before = pos < accepted.unsqueeze(1)
    padded_x = torch.cat([case["draft_token_ids"], torch.zeros_like(c).unsqueeze(1)], 1)
    assert torch.equal(torch.where(before, out, 0), torch.where(before, padded_x, 0))
    assert (out[pos > accepted.unsqueeze(1)] == -1).all()
    assert ((out >= -1) & (out < vocab)).all()


# --------------------------------------------------------------------------------- chi-square machinery

V, K = 6, 3


def chi2_pvalue(observed: Tensor, probs: Tensor) -> float:
    """Pearson's test of counts against probabilities (cells of expected count < 5 pooled). A cell of
    probability 0 that was observed is an immediate failure (p-value 0)."""
    obs = observed.double().flatten()
    exp = probs.double().flatten() * obs.sum()
    if obs[exp == 0].sum() > 0:
        return 0.0
    keep = exp >= 5
    obs_cells = torch.cat([obs[keep], obs[~keep & (exp > 0)].sum().reshape(1)])
    exp_cells = torch.cat([exp[keep], exp[~keep & (exp > 0)].sum().reshape(1)])
    if exp_cells[-1] == 0:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    stat = ((obs_cells - exp_cells) ** 2 / exp_cells).sum()
    df = torch.tensor((len(exp_cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def markov_pair() -> tuple[Tensor, Tensor]:
    """A context-dependent target T[prev] and a draft D[prev] over V tokens that disagree enough to reject
    often, with zeros on both sides (tokens the draft never proposes / the target never produces)."""
    gen = torch.Generator().manual_seed(1234)
    target = (torch.randn(V, V, generator=gen) * 1.5).softmax(-1)
    target[:3, 5] = 0.0
    target = target / target.sum(-1, keepdim=True)
    draft = 0.4 * target + 0.6 * (torch.randn(V, V, generator=gen) * 1.5).softmax(-1)
    draft[2:, 4] = 0.0
    draft = draft / draft.sum(-1, keepdim=True)
    return target, draft


def markov_step(gen, ctx: Tensor, target: Tensor, draft: Tensor, deterministic: bool, greedy_rows: bool = False):
    """Inputs of one verification step per row from context token ctx: drafts x_j ~ draft[prev] (or its
    argmax when deterministic, with draft_probs None), p_j = target[prev_j], q_j = draft[prev_j], and a
    random c per row (the padding past c holds random ids)."""
    n = ctx.shape[0]
    prev, xs, ps, qs = ctx, [], [], []
    for _ in range(K):
        ps.append(target[prev])
        qs.append(draft[prev])
        if deterministic:
            nxt = draft[prev].argmax(-1)
        else:
            nxt = torch.multinomial(draft[prev], 1, generator=gen).squeeze(1)
        xs.append(nxt)
        prev = nxt
    ps.append(target[prev])
    x = torch.stack(xs, 1)
    c = torch.randint(0, K + 1, (n,), generator=gen)
    padding = torch.arange(K) >= c.unsqueeze(1)
    x = torch.where(padding, torch.randint(0, V, (n, K), generator=gen), x)
    return dict(
        target_probs=torch.stack(ps, 1),
        draft_token_ids=x,
        draft_probs=None if deterministic else torch.stack(qs, 1),
        num_draft_tokens=c,
        is_greedy=torch.full((n,), greedy_rows),
        uniform=torch.rand(n, K, generator=gen),
        exponential=exponentials(gen, n, V),
    )


def emitted(out: Tensor) -> Tensor:
    """Number of tokens a step emitted: the leading run before the first -1."""
    return (out != -1).to(torch.int64).cumprod(1).sum(1)


def first_two_tokens(kernel: Kernel, n: int, seed: int, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(y0, y1) of n sequences started from context 0: one step, and a second step from context y0 for
    the sequences whose first step emitted a single token."""
    target, draft = markov_pair()
    gen = torch.Generator().manual_seed(seed)
    out1, _ = kernel(**markov_step(gen, torch.zeros(n, dtype=torch.int64), target, draft, deterministic))
    y0 = out1[:, 0]
    assert (y0 >= 0).all()
    single = emitted(out1) == 1
    out2, _ = kernel(**markov_step(gen, y0[single], target, draft, deterministic))
    y1 = out1[:, 1].clone()
    y1[single] = out2[:, 0]
    return y0, y1


def lossless_pvalues(kernel: Kernel, n: int, seed: int, deterministic: bool = False) -> tuple[float, float]:
    """p-values of: y0 ~ T[0], and (y0, y1) ~ T[0](y0) T[y0](y1) (the target's joint)."""
    target, _ = markov_pair()
    y0, y1 = first_two_tokens(kernel, n, seed, deterministic)
    first = torch.bincount(y0, minlength=V)
    joint = torch.bincount(y0 * V + y1, minlength=V * V)
    return chi2_pvalue(first, target[0]), chi2_pvalue(joint, target[0].unsqueeze(1) * target)


# Deliberately wrong samplers (same signature): the chi-square tests must reject them.
def recover_from_target(**case) -> tuple[Tensor, Tensor]:
    """After a rejection, draws the replacement from p_a instead of max(p_a - q_a, 0)."""
    out, a = rejection_sample_ref(**case)
    rows = torch.arange(out.shape[0])
    rejected = a < case["num_draft_tokens"]
    from_p = (case["target_probs"][rows, a] / case["exponential"]).argmax(-1)
    out[rows, a] = torch.where(rejected, from_p, out[rows, a])
    return out, a


def bonus_after_rejection(**case) -> tuple[Tensor, Tensor]:
    """After a rejection at a, also emits a 'bonus' token at a + 1 drawn from p_{a+1}."""
    out, a = rejection_sample_ref(**case)
    rows = torch.arange(out.shape[0])
    rejected = a < case["num_draft_tokens"]
    nxt = (a + 1).clamp(max=out.shape[1] - 1)
    e = exponentials(torch.Generator().manual_seed(99), *case["exponential"].shape)
    bonus = (case["target_probs"][rows, nxt] / e).argmax(-1)
    out[rows, nxt] = torch.where(rejected, bonus, out[rows, nxt])
    return out, a


# ------------------------------------------------------------------------------------------- lossless

N_CHI2 = 40_000


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-probs", "deterministic-draft"])
def test_lossless_first_token_and_joint(deterministic: bool) -> None:
    p_first, p_joint = lossless_pvalues(rejection_sample_ref, N_CHI2, seed=7, deterministic=deterministic)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


def test_chi2_rejects_recovery_from_target() -> None:
    p_first, p_joint = lossless_pvalues(recover_from_target, N_CHI2, seed=7)
    assert p_first < 1e-9 and p_joint < 1e-9, (p_first, p_joint)


def test_chi2_rejects_bonus_after_rejection() -> None:
    p_first, p_joint = lossless_pvalues(bonus_after_rejection, N_CHI2, seed=7)
    assert p_joint < 1e-9, p_joint


def test_acceptance_rate_matches_theory() -> None:
    """P(accept draft 0) = sum_x min(p(x), q(x)) for rows with c >= 1 (the standard result)."""
    target, draft = markov_pair()
    gen = torch.Generator().manual_seed(3)
    case = markov_step(gen, torch.zeros(N_CHI2, dtype=torch.int64), target, draft, deterministic=False)
    _, a = rejection_sample_ref(**case)
    has_draft = case["num_draft_tokens"] >= 1
    rate = (a[has_draft] >= 1).double().mean()
    expected = torch.minimum(target[0], draft[0]).sum().double()
    sigma = (expected * (1 - expected) / has_draft.sum()).sqrt()
    assert abs(rate - expected) < 5 * sigma, (rate, expected)


# --------------------------------------------------------------------------------------------- greedy


def one_hot_probs(argmaxes: list[list[int]], vocab: int = 5) -> Tensor:
    """[N, K+1, V] distributions with the given argmax per position (the rest of the mass spread)."""
    p = torch.full((len(argmaxes), len(argmaxes[0]), vocab), 0.1)
    for n, row in enumerate(argmaxes):
        for j, t in enumerate(row):
            p[n, j, t] = 0.6
    return p / p.sum(-1, keepdim=True)


def greedy_cases() -> tuple[dict, list[list[int]], list[int]]:
    """Hand-built greedy rows (K = 3) with their exact expected outputs."""
    argmax = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]]
    drafts = [
        [1, 2, 3],  # all accepted -> bonus argmax(p_3)
        [1, 0, 3],  # mismatch at 1 -> argmax(p_1) there
        [1, 2, 3],  # c = 0 -> argmax(p_0), drafts (all matching) ignored
        [1, 2, 3],  # c = 2 < K, both accepted -> bonus argmax(p_2) at position 2, padding 3 ignored
        [4, 2, 3],  # c = 1, first mismatches -> argmax(p_0)
        [0, 0, 0],  # all tied rows -> lowest index
    ]
    c = [3, 3, 0, 2, 1, 3]
    expected = [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1], [1, -1, -1, -1], [0, 0, 0, 0]]
    p = one_hot_probs(argmax)
    p[5] = 0.2  # uniform rows: every token ties
    n = len(drafts)
    gen = torch.Generator().manual_seed(0)
    case = dict(
        target_probs=p,
        draft_token_ids=torch.tensor(drafts),
        draft_probs=None,
        num_draft_tokens=torch.tensor(c),
        is_greedy=torch.ones(n, dtype=torch.bool),
        uniform=torch.rand(n, 3, generator=gen),
        exponential=exponentials(gen, n, 5),
    )
    return case, expected, [3, 1, 0, 2, 0, 3]


def check_greedy_cases(kernel: Kernel) -> None:
    case, expected, accepted = greedy_cases()
    out, a = kernel(**case)
    assert out.tolist() == expected and a.tolist() == accepted
    # The same rows with draft probabilities present (a mixed batch's q) give the same outputs.
    case["draft_probs"] = torch.full((len(expected), 3, 5), 0.2)
    out, a = kernel(**case)
    assert out.tolist() == expected and a.tolist() == accepted


def test_greedy_exact_cases() -> None:
    check_greedy_cases(rejection_sample_ref)


def test_greedy_rows_equal_argmax_chain_in_a_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    case = random_case(gen, 32, 4, 50, edge=False)
    out, a = rejection_sample_ref(**case)
    g = case["is_greedy"]
    argmax = case["target_probs"].argmax(-1)
    for n in torch.nonzero(g).flatten().tolist():
        an = int(a[n])
        assert out[n, : an + 1].tolist() == argmax[n, : an + 1].tolist()
        if an < int(case["num_draft_tokens"][n]):
            assert int(case["draft_token_ids"][n, an]) != int(argmax[n, an])


# --------------------------------------------------------------------------------- stochastic details


def stochastic_case(p: Tensor, x: list[int], q: Tensor | None, c: int, u: list[float], seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        target_probs=p.unsqueeze(0),
        draft_token_ids=torch.tensor([x]),
        draft_probs=None if q is None else q.unsqueeze(0),
        num_draft_tokens=torch.tensor([c]),
        is_greedy=torch.tensor([False]),
        uniform=torch.tensor([u]),
        exponential=exponentials(gen, 1, p.shape[-1]),
    )


def check_stochastic_details(kernel: Kernel) -> None:
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]])
    # q(x) == 0 < p(x): accepted whatever u; p(x) == 0: rejected even at u == 0, and the residual
    # max(p - q, 0) = (0.5, 0, 0, 0) then forces token 0.
    out, a = kernel(**stochastic_case(p[[0, 0, 1]], [0, 2], q[[0, 0]], 2, [0.999, 0.0]))
    assert a.tolist() == [1] and out.tolist() == [[0, 0, -1]]
    # Rejected at 0 with p(x) == 0: the residual max(p - q, 0) = (0.5, 0, 0, 0) forces token 0.
    out, a = kernel(**stochastic_case(p, [2, 1], q, 2, [0.0, 0.0]))
    assert a.tolist() == [0] and out.tolist() == [[0, -1, -1]]
    # p == q and the draft outside the support: rejected, the residual is empty, fall back to p.
    case = stochastic_case(p[1:], [3], p[1:2], 1, [0.5], seed=4)
    case["target_probs"][0, 0, 3] = case["draft_probs"][0, 0, 3] = 0.0
    out, a = kernel(**case)
    expected = int((case["target_probs"][0, 0] / case["exponential"][0]).argmax())
    assert a.tolist() == [0] and out.tolist() == [[expected, -1]] and expected != 3
    # Deterministic proposer (no draft probs): accept iff u < p(x); the residual is p without x.
    out, a = kernel(**stochastic_case(p, [0, 1], None, 2, [0.49, 0.51]))
    assert a.tolist() == [1] and out[0, 0] == 0 and out[0, 1] in (0, 2, 3) and out[0, 2] == -1
    # c = 0: the bonus is sampled from p_0 (the race over p_0 / e).
    case = stochastic_case(p, [1, 1], q, 0, [0.0, 0.0], seed=9)
    out, a = kernel(**case)
    assert a.tolist() == [0]
    assert out.tolist() == [[int((p[0] / case["exponential"][0]).argmax()), -1, -1]]
    # All c < K drafts accepted: bonus from p_c at position c, -1 after it.
    case = stochastic_case(p, [1, 3], q, 1, [0.0, 0.0], seed=2)
    out, a = kernel(**case)
    assert a.tolist() == [1] and out[0, 0] == 1 and out[0, 2] == -1
    assert out[0, 1] == int((p[1] / case["exponential"][0]).argmax())


def test_stochastic_details() -> None:
    check_stochastic_details(rejection_sample_ref)


def check_invalid_rows(kernel: Kernel) -> None:
    """NaN / inf / no-mass distributions at the emitted position give -1 there; other rows unaffected."""
    gen = torch.Generator().manual_seed(11)
    n, k, vocab = 8, 3, 10
    p = (torch.randn(n, k + 1, vocab, generator=gen)).softmax(-1)
    x = p[:, :k].argmax(-1)
    q = p[:, :k].clone()  # q == p: every in-support draft accepted with u < 1
    c = torch.tensor([3, 3, 3, 2, 3, 3, 1, 3])
    greedy = torch.tensor([False, False, True, False, False, True, False, False])
    u = torch.full((n, k), 0.5)
    p[0, 0] = NAN  # whole first distribution NaN -> a = 0, -1
    p[1, 2] = NAN  # NaN at position 2 -> drafts 0, 1 accepted, -1 at 2
    p[2, 1] = NAN  # greedy: NaN at 1 -> a = 1, -1
    p[3, 2] = 0.0  # bonus position (c = 2) without mass -> -1
    p[4, 3, 4] = INF  # inf at the bonus position -> -1
    p[5, 3] = NAN  # greedy, NaN only at the bonus
    q[6, 0, 0] = NAN  # drafter NaN at 0 where x is not 0: the residual is undefined -> -1
    x[6, 0] = 1
    p[6, 0, 1] = 0.0  # forces the rejection of x = 1 at 0
    case = dict(
        target_probs=p,
        draft_token_ids=x,
        draft_probs=q,
        num_draft_tokens=c,
        is_greedy=greedy,
        uniform=u,
        exponential=exponentials(gen, n, vocab),
    )
    out, a = kernel(**case)
    assert a.tolist() == [0, 2, 1, 2, 3, 3, 0, 3]
    for row in range(7):
        assert out[row, int(a[row])] == -1 and (out[row, int(a[row]) + 1 :] == -1).all()
        assert out[row, : int(a[row])].tolist() == x[row, : int(a[row])].tolist()
    assert 0 <= out[7, 3] < vocab  # the clean row is untouched


def test_invalid_rows() -> None:
    check_invalid_rows(rejection_sample_ref)


@pytest.mark.parametrize("k,vocab", [(1, 7), (4, 100), (7, 1000), (0, 9)])
def test_reference_matches_literal_reading(k: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(k * 1000 + vocab)
    for with_q in (True, False):
        case = random_case(gen, 16, k, vocab, with_q=with_q, edge=k > 0)
        got = rejection_sample_ref(**case)
        check_equal(got, naive_rejection_sample(*case.values()))
        check_output_shape(*got, case)


def test_empty_batch() -> None:
    case = random_case(torch.Generator().manual_seed(0), 0, 3, 5)
    out, a = rejection_sample_ref(**case)
    assert out.shape == (0, 4) and a.shape == (0,)


# ------------------------------------------------------------------------------------------ randomness


def test_randomness_shapes_and_ranges() -> None:
    u, e = draw_rejection_randomness(5, 4, 300, {}, torch.Generator().manual_seed(0), "cpu")
    assert u.shape == (5, 4) and e.shape == (5, 300)
    assert u.dtype == e.dtype == torch.float32
    assert ((u >= 0) & (u < 1)).all() and (e >= TINY).all()
    u2, e2 = draw_rejection_randomness(5, 4, 300, {}, torch.Generator().manual_seed(0), "cpu")
    assert torch.equal(u, u2) and torch.equal(e, e2)


def test_seeded_rows_do_not_depend_on_neighbours() -> None:
    k, vocab = 4, 64

    def draws(rows: int, at: int, others: dict[int, int], default_seed: int):
        gens = {r: make_generator(s, "cpu") for r, s in others.items()}
        gens[at] = make_generator(42, "cpu")
        default = torch.Generator().manual_seed(default_seed)
        first = draw_rejection_randomness(rows, k, vocab, gens, default, "cpu")
        second = draw_rejection_randomness(rows, k, vocab, gens, default, "cpu")  # the next step
        return [(t[0][at], t[1][at]) for t in (first, second)]

    alone = draws(1, 0, {}, 0)
    for rows, at, others, default_seed in [(5, 3, {}, 1), (6, 0, {2: 7, 5: 8}, 2), (3, 2, {0: 42, 1: 3}, 3)]:
        for (u, e), (u_ref, e_ref) in zip(draws(rows, at, others, default_seed), alone, strict=True):
            assert torch.equal(u, u_ref) and torch.equal(e, e_ref)
    # A seeded row draws K uniforms, then V exponentials, from its generator.
    gen = make_generator(42, "cpu")
    expected_u = torch.empty(k).uniform_(generator=gen)
    expected_e = torch.empty(vocab).exponential_(generator=gen).clamp_min(TINY)
    assert torch.equal(alone[0][0], expected_u) and torch.equal(alone[0][1], expected_e)


def test_seeded_rows_with_a_fixed_uniform_budget_ignore_the_step_width() -> None:
    """With max_num_spec, a seeded row's stream does not depend on the step's K (the widest row's drafts)."""
    vocab = 32

    def two_steps(num_spec: int) -> list[Tensor]:
        gens = {1: make_generator(9, "cpu")}
        first = draw_rejection_randomness(3, num_spec, vocab, gens, None, "cpu", max_num_spec=4)
        second = draw_rejection_randomness(3, 4, vocab, gens, None, "cpu", max_num_spec=4)
        return [first[0][1], first[1][1], second[0][1], second[1][1]]

    narrow, wide = two_steps(2), two_steps(4)
    assert torch.equal(narrow[0], wide[0][:2])
    for a, b in zip(narrow[1:], wide[1:], strict=True):
        assert torch.equal(a, b)
    # Without the budget, the same seeded row drifts once the width changes (why the option exists).
    gens = {0: make_generator(9, "cpu")}
    draw_rejection_randomness(1, 2, vocab, gens, None, "cpu")
    drifted = draw_rejection_randomness(1, 4, vocab, gens, None, "cpu")[1][0]
    assert not torch.equal(drifted, wide[3])
    with pytest.raises(ValueError, match="max_num_spec"):
        draw_rejection_randomness(1, 5, vocab, gens, None, "cpu", max_num_spec=4)
    sampler = RejectionSampler("cpu", num_speculative_tokens=4)
    assert sampler.num_speculative_tokens == 4


def test_seeded_request_output_does_not_depend_on_neighbours() -> None:
    gen = torch.Generator().manual_seed(21)
    big = random_case(gen, 8, 4, 40, edge=False)
    big["is_greedy"][:] = False
    sampler = RejectionSampler("cpu")

    def run(case: dict, row: int) -> tuple[list[int], int]:
        args = {k: v for k, v in case.items() if k not in ("uniform", "exponential")}
        out, a = sampler(**args, generators={row: make_generator(5, "cpu")}, default_generator=None)
        return out[row].tolist(), int(a[row])

    single = {k: (v[5:6] if v is not None else None) for k, v in big.items()}
    assert run(big, 5) == run(single, 0)


# ------------------------------------------------------------------------------------------ front-end


def test_select_rejection_kernel(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_rejection_kernel("cpu") is rejection_sample_ref
    triton_available = True
    try:
        import triton  # noqa: F401
    except ImportError:
        triton_available = False
    assert (select_rejection_kernel("cuda") is not rejection_sample_ref) == triton_available
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_rejection_kernel("cuda") is rejection_sample_ref
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert select_rejection_kernel("cpu") is not rejection_sample_ref
    assert RejectionSampler("cpu").kernel is not rejection_sample_ref
    monkeypatch.setenv(BACKEND_ENV, "cuda-graphs")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_rejection_kernel("cpu")


def test_sampler_equals_kernel_on_drawn_randomness(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    case = random_case(torch.Generator().manual_seed(8), 12, 3, 30)
    args = {k: v for k, v in case.items() if k not in ("uniform", "exponential")}
    seeded = {2: 17, 9: 18}

    def gens() -> tuple[dict[int, torch.Generator], torch.Generator]:
        return {r: make_generator(s, "cpu") for r, s in seeded.items()}, torch.Generator().manual_seed(4)

    got = RejectionSampler("cpu")(**args, generators=gens()[0], default_generator=gens()[1])
    u, e = draw_rejection_randomness(12, 3, 30, *gens(), "cpu")
    check_equal(got, rejection_sample_ref(**args, uniform=u, exponential=e))


@pytest.mark.parametrize(("method", "expected_calls"), [("draft_model", 6), ("ngram", 3)])
def test_start_up_runs_the_rejection_kernel_at_every_k(method, expected_calls):
    """`SpeculativeDecoder.compile_kernel_variants` (the runner calls it at start-up on CUDA) runs the kernel on a
    dummy row at each k > 0 of the policy's choices, with the draft's q and without (without only for n-gram),
    and its outputs are valid: the dummy rows go through the same contract as a real step."""
    from tests.spec.spec_helpers import make_llm

    llm = make_llm(method=method, k=4)
    spec = llm.engine.engine_core.runner.spec
    calls: list[tuple[int, bool]] = []
    kernel = spec.rejection_sampler.kernel

    def recording(probs, drafts, q, counts, is_greedy, uniform, exponential):
        calls.append((drafts.shape[1], q is not None))
        out, num_accepted = kernel(probs, drafts, q, counts, is_greedy, uniform, exponential)
        assert out.shape == (1, drafts.shape[1] + 1) and 0 <= int(num_accepted[0]) <= drafts.shape[1]
        return out, num_accepted

    spec.rejection_sampler.kernel = recording
    assert spec.compile_kernel_variants([0, 1, 2, 4]) == expected_calls
    with_q = [True, False] if method == "draft_model" else [False]
    assert sorted(calls) == sorted((k, q) for k in (1, 2, 4) for q in with_q)
