"""Shared helpers of the engine-level speculative decoding tests (not a test module).

Every test is parametrized over METHODS: once the draft-model proposer lands, adding "draft_model" there
runs the whole suite against it too (`spec_kwargs` already knows how to configure it).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Hashable, Sequence
from pathlib import Path

import torch

from asyncspec import LLM
from asyncspec.outputs import RequestOutput
from tests.conftest import TARGET_MODEL

METHODS = ["ngram", "draft_model"]
"""Proposers under test. Adding "draft_model" runs every test against the draft-model proposer too (with the
bundled draft for the bundled target, and a tiny target as its own draft)."""

CPU = dict(device="cpu", dtype="float32")


def spec_kwargs(method: str, k: int, draft_model: str | Path | None = None) -> dict:
    """Engine options that turn on `method` with k draft tokens. `draft_model` (a directory) is used by
    "draft_model" only; None means the bundled draft (valid for the bundled target only)."""
    if method == "ngram":
        return dict(speculative_method="ngram", num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=5)
    if method == "draft_model":
        options: dict = dict(speculative_method="draft_model", num_speculative_tokens=k)
        if draft_model is not None:
            options["draft_model"] = str(draft_model)
        return options
    raise ValueError(f"unknown speculative method {method!r}")


def make_llm(model: str | Path = TARGET_MODEL, method: str | None = None, k: int = 0, **overrides) -> LLM:
    """An LLM on the CPU in fp32; speculative when `method` is given. For "draft_model" with a model
    other than the bundled target, the target itself serves as its own draft (pass draft_model= to
    override)."""
    kwargs: dict = dict(CPU)
    if method is not None:
        draft = overrides.pop("draft_model", None)
        if method == "draft_model" and draft is None and Path(model).resolve() != TARGET_MODEL.resolve():
            draft = model
        kwargs.update(spec_kwargs(method, k, draft))
    kwargs.update(overrides)
    return LLM(str(model), **kwargs)


def script_k(llm, pattern: Sequence[int]) -> None:
    """Makes an LLM's speculation policy follow `pattern` (cycled), one k per choice (one per plan); no probing.
    The policy asks its step cost about k = 0 first at every choice: that is when the next k is taken."""
    ks = itertools.cycle(pattern)
    state = {"k": pattern[0]}

    def cost(num_decodes: int, k: int) -> float:
        if k == 0:
            state["k"] = next(ks)
        # Other k cost far more than any host time the policy adds to them: no measured step can flip the script.
        return 1e3 if k != state["k"] else 1e-6

    policy = llm.engine.engine_core.scheduler.spec_policy
    policy.step_cost = cost
    policy.probe_interval = 0


def record_plans(llm) -> list[tuple[int, int, int]]:
    """(k verified, drafts proposed, steps) of every plan the LLM's scheduler makes from now on."""
    scheduler = llm.engine.engine_core.scheduler
    schedule = scheduler.schedule
    plans: list[tuple[int, int, int]] = []

    def recording():
        so = schedule()
        plans.append((so.num_speculative_tokens, so.num_proposals, so.num_steps))
        return so

    scheduler.schedule = recording
    return plans


def spec_runner(llm):
    """The speculative decoder of an LLM's worker (for monkeypatching its rejection sampler)."""
    spec = llm.engine.engine_core.runner.spec
    assert spec is not None, "this LLM does not speculate"
    return spec


# ------------------------------------------------------------------------------------------ comparisons


def first_difference(a: Sequence, b: Sequence) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_outputs(
    ref: Sequence[RequestOutput], got: Sequence[RequestOutput], what: str = "", check_text: bool = True
) -> None:
    """Token ids, text, finish_reason and stop_reason of `got` equal `ref`, request by request."""
    assert len(ref) == len(got)
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        where = f"{what} request {i}"
        if r.token_ids != g.token_ids:
            at = first_difference(r.token_ids, g.token_ids)
            raise AssertionError(
                f"{where}: token ids differ from the non-speculative run at output index {at} "
                f"(len {len(r.token_ids)} vs {len(g.token_ids)}):\n  ref {r.token_ids}\n  got {g.token_ids}"
            )
        if check_text:
            assert r.text == g.text, f"{where}: text differs: {r.text!r} vs {g.text!r}"
        assert (r.finish_reason, r.stop_reason) == (g.finish_reason, g.stop_reason), (
            f"{where}: finish (reason, stop_reason) {(r.finish_reason, r.stop_reason)} vs "
            f"{(g.finish_reason, g.stop_reason)}"
        )


def stats_delta(before: dict, after: dict) -> dict:
    """Counters accumulated between two llm.stats() snapshots (gauges are taken from `after`)."""
    keys = set(before) | set(after)
    return {key: after.get(key, 0) - before.get(key, 0) for key in keys}


def assert_spec_counters_consistent(delta: dict, outs: Sequence[RequestOutput], k: int) -> None:
    """The global speculative counters of one generate call (`delta`, from stats_delta) agree with the
    per-request ones and with each other."""
    drafts, draft_tokens, accepted = (
        delta["spec_num_drafts"],
        delta["spec_num_draft_tokens"],
        delta["spec_num_accepted_tokens"],
    )
    assert sum(o.num_accepted_tokens for o in outs) == accepted, "per-request accepted counts != global counter"
    assert sum(o.num_draft_tokens for o in outs) == draft_tokens, "per-request draft counts != global counter"
    assert 0 <= accepted <= draft_tokens <= k * drafts, (drafts, draft_tokens, accepted)
    for o in outs:
        assert 0 <= o.num_accepted_tokens <= o.num_draft_tokens, (o.request_id, o.num_draft_tokens)
    per_position = [delta.get(f"spec_accepted_at_position_{i}", 0) for i in range(k + 1)]
    assert per_position[k] == 0, f"an accepted draft at position {k} with k={k}: {per_position}"
    assert sum(per_position) == accepted, f"accepted per position {per_position} does not sum to {accepted}"
    # Draft j is accepted only after drafts 0..j-1 were: the per-position counts never increase.
    assert all(a >= b for a, b in zip(per_position, per_position[1:], strict=False)), per_position


# ------------------------------------------------------------------------------------------- statistics


def chi2_two_sample(a: Sequence[Hashable], b: Sequence[Hashable], min_count: int = 10) -> tuple[float, int]:
    """Pearson's chi-square test of homogeneity of two samples of categories: (p-value, degrees of freedom).
    Categories seen fewer than `min_count` times in both samples together are pooled into one cell (dropped
    if that cell is empty); a single category left means nothing to test (p = 1)."""
    count_a, count_b = collections.Counter(a), collections.Counter(b)
    cats = set(count_a) | set(count_b)
    common = sorted((c for c in cats if count_a[c] + count_b[c] >= min_count), key=repr)
    rare = [c for c in cats if count_a[c] + count_b[c] < min_count]
    table = [[count[c] for c in common] + [sum(count[c] for c in rare)] for count in (count_a, count_b)]
    if not rare:
        table = [row[:-1] for row in table]
    observed = torch.tensor(table, dtype=torch.float64)
    df = observed.shape[1] - 1
    if df < 1:
        return 1.0, 0
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    stat = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)), df


def prefix_pvalues(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], n: int) -> list[float]:
    """p-values of chi2_two_sample on the first token, the first two tokens (joint), ... up to n tokens."""
    return [chi2_two_sample([tuple(x[: i + 1]) for x in a], [tuple(x[: i + 1]) for x in b])[0] for i in range(n)]
