"""Penalties through the engine (device-resident token statistics) against a hand-rolled reference
loop over Hugging Face logits: greedy decoding of the penalised logits, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncspec import LLM, SamplingParams
from tests.conftest import TARGET_MODEL, load_prompts

MAX_TOKENS = 20


def reference_greedy_with_penalties(model, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        counts = torch.zeros_like(logits)
        for t in out:
            counts[t] += 1
        seen = counts > 0
        seen[torch.tensor(prompt)] = True
        rep = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
        token = int(logits.argmax())
        out.append(token)
        tokens.append(token)
    return out


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(TARGET_MODEL, dtype=torch.float32).eval()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_penalised_greedy_matches_reference_with_neighbours_and_preemption(hf_model, device):
    prompts = [p[:60] for p in load_prompts(5)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=2.0),
        SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=2.0, repetition_penalty=0.9
        ),
        SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=1.0, presence_penalty=1.0
        ),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),  # unpenalised neighbour
    ]
    preempted_after_output = []
    original_preempt = None
    llm = LLM(
        str(TARGET_MODEL),
        device=device,
        dtype="float32",
        max_model_len=96,
        block_size=8,
        num_kv_blocks=24,
        max_num_batched_tokens=48,
        max_num_seqs=5,
    )
    scheduler = llm.engine.engine_core.scheduler
    original_preempt = scheduler._preempt

    def recording_preempt(request):
        if request.output_token_ids and request.sampling_params.uses_penalties:
            preempted_after_output.append((request.request_id, request.num_output_tokens))
        original_preempt(request)

    scheduler._preempt = recording_preempt
    outs = llm.generate(prompts, params)
    # A penalised request resumed after preemption must get its output statistics back.
    assert preempted_after_output, "the small pool was meant to preempt a penalised request mid-output"
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids == reference_greedy_with_penalties(hf_model, prompt, p)
    plain = outs[4].token_ids
    assert outs[0].token_ids != plain or outs[1].token_ids != plain  # the penalties did change something
