"""NgramProposer: the vectorised device proposer against a per-request pure-Python reference."""

from __future__ import annotations

import random

import pytest
import torch

from asyncspec.errors import ConfigError
from asyncspec.spec.ngram_proposer import NgramProposer

try:  # a bare GPU box may lack hypothesis; only the fuzz test needs it
    from hypothesis import given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover
    HAVE_HYPOTHESIS = False


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """Longest n in [min_n, max_n], most recent earlier occurrence, up to k following tokens below T."""
    t = len(tokens)
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        suffix = tokens[t - n :]
        for s in range(t - 1 - n, -1, -1):
            if tokens[s : s + n] == suffix:
                drafts = tokens[s + n : s + n + k]
                return drafts + [tokens[-1]] * (k - len(drafts)), len(drafts)
    return [tokens[-1]] * k, 0


def propose_lists(
    seqs: list[list[int]], k: int, min_n: int, max_n: int, width: int | None = None, device: str = "cpu"
) -> tuple[list[list[int]], list[int]]:
    """Pack `seqs` into a buffer (garbage -1 beyond each length, rows reversed) and run the proposer."""
    width = width or max(len(s) for s in seqs)
    buf = torch.full((len(seqs) + 1, width), -1, dtype=torch.long)
    rows = list(range(len(seqs), 0, -1))
    for r, s in zip(rows, seqs, strict=True):
        buf[r, : len(s)] = torch.tensor(s)
    out, num = NgramProposer(k, min_n, max_n).propose(
        buf.to(device),
        torch.tensor(rows, device=device),
        torch.tensor([len(s) for s in seqs], device=device),
        max(len(s) for s in seqs),
    )
    return out.tolist(), num.tolist()


def random_batch(rng: random.Random, num_reqs: int, width: int, vocab: int):
    """A buffer of random garbage (in-vocabulary, so unmasked stale data would match) with random-length
    requests, some built from a repeated motif, in random rows; plus the per-request token lists."""
    num_rows = num_reqs + rng.randrange(4)
    buf = torch.tensor([[rng.randrange(vocab) for _ in range(width)] for _ in range(num_rows)])
    rows = rng.sample(range(num_rows), num_reqs)
    lengths = [rng.randint(1, width) for _ in range(num_reqs)]
    seqs = []
    for r, t in zip(rows, lengths, strict=True):
        if rng.random() < 0.3:  # repeated motif with a little noise
            motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            seq = [motif[i % len(motif)] if rng.random() > 0.1 else rng.randrange(vocab) for i in range(t)]
        else:
            seq = [rng.randrange(vocab) for _ in range(t)]
        buf[r, :t] = torch.tensor(seq)
        seqs.append(seq)
    return buf, torch.tensor(rows), torch.tensor(lengths), seqs


def check_batch(buf, rows, lengths, seqs, k, min_n, max_n, max_num_tokens) -> None:
    out, num = NgramProposer(k, min_n, max_n).propose(buf, rows, lengths, max_num_tokens)
    assert out.shape == (len(seqs), k) and out.dtype == torch.long
    assert num.shape == (len(seqs),) and num.dtype == torch.long
    for i, seq in enumerate(seqs):
        assert (out[i].tolist(), int(num[i])) == reference(seq, k, min_n, max_n), (seq, k, min_n, max_n)


LOOKUPS = [(1, 1), (1, 3), (2, 4), (3, 3), (2, 8), (5, 6)]


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("min_n,max_n", LOOKUPS)
def test_matches_reference_random(k: int, min_n: int, max_n: int) -> None:
    rng = random.Random(1000 * k + 10 * min_n + max_n)
    for _ in range(25):
        width = rng.randint(1, 40)
        buf, rows, lengths, seqs = random_batch(rng, rng.randint(1, 12), width, vocab=rng.randint(2, 8))
        # max_num_tokens: the true maximum, or any looser bound up to the buffer width
        bound = rng.choice([int(lengths.max()), width])
        check_batch(buf, rows, lengths, seqs, k, min_n, max_n, bound)


if HAVE_HYPOTHESIS:

    @settings(max_examples=200, deadline=None)
    @given(
        seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=6),
        k=st.sampled_from([1, 4, 7]),
        lookup=st.sampled_from(LOOKUPS),
        garbage=st.integers(0, 3),
    )
    def test_matches_reference_fuzz(seqs, k, lookup, garbage) -> None:
        width = max(len(s) for s in seqs) + 3
        buf = torch.full((len(seqs), width), garbage, dtype=torch.long)
        for i, s in enumerate(seqs):
            buf[i, : len(s)] = torch.tensor(s)
        rows = torch.arange(len(seqs)).flip(0)
        min_n, max_n = lookup
        check_batch(buf.flip(0), rows, torch.tensor([len(s) for s in seqs]), seqs, k, min_n, max_n, width)


def test_repeated_pattern() -> None:
    seq = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    out, num = propose_lists([seq], k=4, min_n=1, max_n=3)
    # suffix [5, 1, 2] occurs at s=4, followed by 3, 4, 5, 1
    assert out == [[3, 4, 5, 1]] and num == [4]


def test_prefers_longest_then_most_recent() -> None:
    # n=1 suffix [9] recurs at s=5 (followed by 7), n=2 suffix [8, 9] only at s=0 (followed by 6)
    seq = [8, 9, 6, 6, 6, 9, 7, 8, 9]
    assert propose_lists([seq], k=2, min_n=1, max_n=2) == ([[6, 6]], [2])
    assert propose_lists([seq], k=2, min_n=1, max_n=1) == ([[7, 8]], [2])
    # two occurrences of [1, 2]: the later one (s=3) wins
    assert propose_lists([[1, 2, 5, 1, 2, 6, 1, 2]], k=1, min_n=2, max_n=2) == ([[6]], [1])


def test_no_match_pads_with_last_token() -> None:
    out, num = propose_lists([[5, 6, 7, 8], [3]], k=4, min_n=1, max_n=3)
    assert num == [0, 0]
    assert out == [[8] * 4, [3] * 4]


def test_match_near_end_gives_fewer_drafts() -> None:
    # suffix [7, 7] occurs at s=3 (ending at T-2): only one following token exists
    out, num = propose_lists([[1, 2, 3, 7, 7, 7]], k=4, min_n=2, max_n=2)
    assert num == [1] and out == [[7, 7, 7, 7]]
    out, num = propose_lists([[4, 1, 2, 9, 3, 1, 2]], k=5, min_n=2, max_n=3)
    assert num == [4] and out == [[9, 3, 1, 2, 2]]


def test_too_short_for_min() -> None:
    # T = min_n: no earlier window of length min_n can exist
    assert propose_lists([[2, 2, 2]], k=3, min_n=3, max_n=4)[1] == [0]
    # T = min_n + 1: the only candidate is s = 0
    assert propose_lists([[2, 2, 2, 2]], k=3, min_n=3, max_n=4) == ([[2, 2, 2]], [1])


def test_stale_data_beyond_t_is_ignored() -> None:
    buf = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3]])
    # T=4: [1] matches at s=0 and drafts must stop at position 3
    out, num = NgramProposer(4, 1, 3).propose(buf, torch.tensor([0]), torch.tensor([4]), 9)
    assert num.tolist() == [3] and out.tolist() == [[2, 3, 1, 1]]
    # T=2: nothing earlier, stale [1, 2, ...] must not match
    out, num = NgramProposer(4, 1, 3).propose(buf, torch.tensor([0]), torch.tensor([2]), 9)
    assert num.tolist() == [0] and out.tolist() == [[2, 2, 2, 2]]


def test_padding_is_never_negative() -> None:
    rng = random.Random(7)
    buf, rows, lengths, _ = random_batch(rng, 32, 30, vocab=6)
    out, num = NgramProposer(7, 2, 5).propose(buf, rows, lengths, 30)
    assert bool((out >= 0).all()) and bool((out < 6).all())
    assert bool(((num >= 0) & (num <= 7)).all())


def test_tiny_max_num_tokens() -> None:
    buf = torch.tensor([[4, 0, 0], [5, 0, 0]])
    out, num = NgramProposer(3, 1, 2).propose(buf, torch.tensor([1, 0]), torch.tensor([1, 1]), 1)
    assert out.tolist() == [[5] * 3, [4] * 3] and num.tolist() == [0, 0]


@pytest.mark.parametrize(
    "args,field",
    [((0, 1, 2), "num_speculative_tokens"), ((4, 0, 2), "prompt_lookup_min"), ((4, 3, 2), "prompt_lookup_max")],
)
def test_config_validation(args, field) -> None:
    with pytest.raises(ConfigError, match=field):
        NgramProposer(*args)


@pytest.mark.gpu
def test_cuda_matches_cpu_without_sync() -> None:
    gen = torch.Generator().manual_seed(0)
    num_rows, width, num_reqs = 80, 4096, 64
    buf = torch.randint(0, 8, (num_rows, width), generator=gen)
    rows = torch.randperm(num_rows, generator=gen)[:num_reqs]
    lengths = torch.randint(1, width + 1, (num_reqs,), generator=gen)
    lengths[:4] = torch.tensor([1, 2, 3, width])
    for k, min_n, max_n in [(4, 1, 3), (7, 2, 5), (1, 3, 8)]:
        proposer = NgramProposer(k, min_n, max_n)
        ref_out, ref_num = proposer.propose(buf, rows, lengths, width)
        dev = (buf.cuda(), rows.cuda(), lengths.cuda())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, num = proposer.propose(*dev, width)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out.cpu(), ref_out) and torch.equal(num.cpu(), ref_num)
        assert int(ref_num.gt(0).sum()) > num_reqs // 2  # vocab 8: most requests match


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay() -> None:
    """Capture fails on any host sync; replay must track new buffer contents and lengths in place."""
    num_rows, width, num_reqs = 40, 512, 32
    buf = torch.randint(0, 6, (num_rows, width), device="cuda")
    rows = torch.randperm(num_rows, device="cuda")[:num_reqs]
    lengths = torch.randint(1, width + 1, (num_reqs,), device="cuda")
    proposer = NgramProposer(5, 2, 4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up the allocator off the capture
        proposer.propose(buf, rows, lengths, width)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, num = proposer.propose(buf, rows, lengths, width)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        buf.copy_(torch.randint(0, 6, buf.shape, device="cuda", generator=gen))
        lengths.copy_(torch.randint(1, width + 1, lengths.shape, device="cuda", generator=gen))
        graph.replay()
        ref_out, ref_num = proposer.propose(buf, rows, lengths, width)
        assert torch.equal(out, ref_out) and torch.equal(num, ref_num)
