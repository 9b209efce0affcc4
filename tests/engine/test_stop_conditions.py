"""Stop conditions are exact: max_tokens, max_model_len, EOS, stop_token_ids, stop strings, min_tokens.

Greedy (deterministic) runs first tell where a token or a string appears; a second run with that stop
condition must end exactly there, and the KV pool must be whole again after every test.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncspec import LLM, AsyncEngine, SamplingParams
from asyncspec.config import make_config
from asyncspec.errors import InvalidRequestError
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import assert_ids_in_vocab, assert_kv_free, bundled_llm

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(one_thread):
    return bundled_llm(max_model_len=128, num_kv_blocks=48, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def prompts():
    return [p[:40] for p in load_prompts(6)]


@pytest.fixture(scope="module")
def greedy_runs(llm, prompts):
    return llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))


@pytest.fixture(autouse=True)
def _kv_whole_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_kv_free(request.getfixturevalue("llm").stats())


# -- length ------------------------------------------------------------------------------------------
def test_max_tokens_exact(llm, prompts, greedy_runs):
    for n in (1, 2, 7):
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, **GREEDY))
        for out, ref in zip(outs, greedy_runs, strict=True):
            assert out.finish_reason == "length" and out.stop_reason is None
            assert out.token_ids == ref.token_ids[:n]
            assert_ids_in_vocab(out.token_ids)


def test_max_model_len_exact(llm, prompts):
    max_len = llm.engine.max_model_len
    assert max_len == 128
    for prompt_len in (max_len - 1, max_len - 9, 100):
        prompt = (prompts[0] * 4)[:prompt_len]
        for max_tokens in (None, 1000):
            out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0]
            assert len(prompt) + len(out.token_ids) == max_len
            assert out.finish_reason == "length"
    with pytest.raises(InvalidRequestError):
        llm.generate([(prompts[0] * 4)[:max_len]], SamplingParams(max_tokens=1))


# -- stop token ids ------------------------------------------------------------------------------------
def test_stop_token_ids_exact(llm, prompts, greedy_runs):
    params, expected = [], []
    for ref in greedy_runs:
        stop_id = ref.token_ids[5]
        cut = ref.token_ids.index(stop_id) + 1
        params.append(SamplingParams(max_tokens=40, stop_token_ids=[stop_id], **GREEDY))
        expected.append((ref.token_ids[:cut], stop_id))
    outs = llm.generate(prompts, params)
    tok = llm.get_tokenizer()
    for out, (tokens, stop_id) in zip(outs, expected, strict=True):
        assert out.token_ids == tokens, "the output must end at the first stop token, inclusive"
        assert out.finish_reason == "stop" and out.stop_reason == stop_id
        # As vLLM: the stop token's text is left out of the text (kept with include_stop_str_in_output).
        assert out.text == tok.decode(tokens[:-1])
    for p in params:
        p.include_stop_str_in_output = True
    outs = llm.generate(prompts, params)
    for out, (tokens, _stop_id) in zip(outs, expected, strict=True):
        assert out.token_ids == tokens and out.text == tok.decode(tokens)


def test_stop_token_at_max_tokens_is_stop(llm, prompts, greedy_runs):
    ref = greedy_runs[1]
    stop_id = ref.token_ids[4]
    cut = ref.token_ids.index(stop_id) + 1
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=cut, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.token_ids == ref.token_ids[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_blocks_stop_token_ids(llm, prompts, greedy_runs):
    ref = greedy_runs[2]
    stop_id = ref.token_ids[1]
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=[stop_id], **GREEDY))[0]
    assert stop_id not in out.token_ids[:6], "a stop token was sampled before min_tokens"
    assert len(out.token_ids) >= 6
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_id and stop_id not in out.token_ids[:-1]
    else:
        assert len(out.token_ids) == 12


# -- stop strings -------------------------------------------------------------------------------------
def _token_char_ends(tokenizer, token_ids) -> list[int]:
    return [len(tokenizer.decode(token_ids[: i + 1])) for i in range(len(token_ids))]


def _stop_string_case(tokenizer, ref, token_index: int) -> tuple[str, str, int]:
    """A stop string that spans the boundary between tokens token_index and token_index + 1.

    Returns (stop, text before its first occurrence, number of tokens up to the one completing it)."""
    text = ref.text
    ends = _token_char_ends(tokenizer, ref.token_ids)
    assert text == tokenizer.decode(ref.token_ids)
    a, b = ends[token_index] - 2, ends[token_index] + 2
    stop = text[a:b]
    assert len(stop) == 4
    first = text.index(stop)
    n_tokens = next(i + 1 for i, e in enumerate(ends) if e >= first + len(stop))
    return stop, text[:first], n_tokens


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_exact(llm, prompts, greedy_runs, include):
    tok = llm.get_tokenizer()
    params, cases = [], []
    for i, ref in enumerate(greedy_runs):
        stop, before, n_tokens = _stop_string_case(tok, ref, 8 + i)
        params.append(SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=include, **GREEDY))
        cases.append((stop, before, n_tokens))
    outs = llm.generate(prompts, params)
    for out, ref, (stop, before, n_tokens) in zip(outs, greedy_runs, cases, strict=True):
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (before + stop if include else before)
        assert out.token_ids == ref.token_ids[:n_tokens], "no token past the one completing the stop string"


def test_stop_string_earliest_of_several_wins_and_max_tokens_tie(llm, prompts, greedy_runs):
    tok = llm.get_tokenizer()
    ref = greedy_runs[0]
    early, before_early, n_early = _stop_string_case(tok, ref, 5)
    late, _, _ = _stop_string_case(tok, ref, 20)
    if ref.text.index(late) <= ref.text.index(early):
        pytest.skip("the chosen strings overlap")
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=40, stop=[late, early], **GREEDY))[0]
    assert (out.text, out.stop_reason, out.finish_reason) == (before_early, early, "stop")
    # The token completing the stop string is also the max_tokens-th: the stop string wins.
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=n_early, stop=[early], **GREEDY))[0]
    assert (out.text, out.stop_reason, out.finish_reason) == (before_early, early, "stop")
    assert out.token_ids == ref.token_ids[:n_early]


def test_text_made_at_the_end_equals_the_streamed_text(llm, prompts):
    """A whole output with no stop string gets its text once, at the end (finished or aborted): the same text
    as a streamed request's deltas, and a full decode of its tokens."""
    engine, tok = llm.engine, llm.get_tokenizer()
    params = SamplingParams(max_tokens=30, **GREEDY)
    whole = [engine.make_request(p, params, f"whole-{i}") for i, p in enumerate(prompts[:3])]
    streamed = [engine.make_request(p, params, f"streamed-{i}") for i, p in enumerate(prompts[:3])]
    aborted = engine.make_request(prompts[3], params, "aborted")
    for r in whole + [aborted]:
        engine.add_request(r, stream_deltas=False)
    for r in streamed:
        engine.add_request(r, stream_deltas=True)
    finals, deltas = {}, {}
    for _ in range(6):
        for out in engine.step():
            deltas[out.request_id] = deltas.get(out.request_id, "") + out.text
    detok = engine.output_processor.states["whole-0"].detokenizer
    assert detok is not None and detok.num_output_tokens == 0, "a whole output is not detokenized step by step"
    (abort_out,) = engine.abort_requests(["aborted"])
    assert abort_out.token_ids and abort_out.text == tok.decode(abort_out.token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id.startswith("whole"):
                finals[out.request_id] = out
            else:
                deltas[out.request_id] = deltas.get(out.request_id, "") + out.text
    for i in range(3):
        out = finals[f"whole-{i}"]
        assert out.finish_reason == "length" and out.text == deltas[f"streamed-{i}"] == tok.decode(out.token_ids)


def test_stop_string_never_streamed(prompts, greedy_runs, llm):
    """AsyncEngine deltas: the running text is always a prefix of the final (cut) text."""
    tok = llm.get_tokenizer()
    cases = []
    for i, ref in enumerate(greedy_runs[:4]):
        stop, before, n_tokens = _stop_string_case(tok, ref, 10 + 2 * i)
        cases.append((stop, before, n_tokens, ref))
    engine = AsyncEngine(
        make_config(
            str(TARGET_MODEL),
            device="cpu",
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=48,
            max_num_batched_tokens=64,
        )
    )

    async def one(i, prompt, stop, before):
        text = ""
        tokens = []
        last = None
        async for delta in engine.generate(
            prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY), request_id=f"s{i}"
        ):
            assert stop not in delta.text
            text += delta.text
            tokens += delta.token_ids
            assert before.startswith(text), f"streamed text {text!r} went past the stop point"
            last = delta
        return text, tokens, last

    async def main():
        try:
            return await asyncio.gather(*(one(i, prompts[i], c[0], c[1]) for i, c in enumerate(cases)))
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    for (text, tokens, last), (stop, before, n_tokens, ref) in zip(results, cases, strict=True):
        assert text == before
        assert tokens == ref.token_ids[:n_tokens]
        assert last.finish_reason == "stop" and last.stop_reason == stop
    assert_kv_free(engine.stats())


def test_min_tokens_ignores_early_stop_string(llm, prompts, greedy_runs):
    tok = llm.get_tokenizer()
    ref = greedy_runs[3]
    stop, before, n_tokens = _stop_string_case(tok, ref, 3)
    assert n_tokens <= 6
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=40, min_tokens=n_tokens, stop=[stop], **GREEDY))[0]
    # The occurrence completed by token n_tokens does not count; a later one may.
    later = ref.text.find(stop, len(before) + 1)
    if later == -1:
        assert out.finish_reason == "length" and out.token_ids == ref.token_ids
    else:
        assert out.finish_reason == "stop" and out.text == ref.text[:later]


# -- EOS (a tiny model whose EOS id is a token it is known to emit) -------------------------------------
VOCAB = 256


@pytest.fixture(scope="module")
def tiny_eos_model(tmp_path_factory, one_thread):
    path = tmp_path_factory.mktemp("tiny-eos")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET_MODEL / name, path / name)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (6, 13, 21)]
    # Choose as EOS a token that the greedy continuation of prompt 0 emits at position 4 and
    # that appears in the other prompts' continuations only where it does.
    probe = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32, block_size=4)
    free = probe.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    eos = free[0].token_ids[4]
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = eos
        (path / name).write_text(json.dumps(data))
    hf.generation_config.eos_token_id = eos
    hf.config.eos_token_id = eos
    return path, hf, prompts, free, eos


def _hf_generate(hf, prompt, eos, max_new, min_new=0):
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_eos_stops_exactly_and_min_tokens_blocks_it(tiny_eos_model):
    path, hf, prompts, free, eos = tiny_eos_model
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32, block_size=4)
    assert eos in llm.engine.eos_token_ids
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    for prompt, out, ref in zip(prompts, outs, free, strict=True):
        if eos in ref.token_ids:
            cut = ref.token_ids.index(eos) + 1
            assert out.token_ids == ref.token_ids[:cut], "EOS is the last token, inclusive"
            assert out.finish_reason == "stop"
            assert out.stop_reason is None  # EOS, not a user stop token
        else:
            assert out.token_ids == ref.token_ids and out.finish_reason == "length"
        assert out.token_ids == _hf_generate(hf, prompt, eos, 20)
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 5
    # ignore_eos keeps going; min_tokens blocks EOS exactly as HF's min_new_tokens does.
    again = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    assert [o.token_ids for o in again] == [r.token_ids for r in free]
    for min_tokens in (3, 8):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=min_tokens))
        for prompt, out in zip(prompts, outs, strict=True):
            assert eos not in out.token_ids[:min_tokens]
            assert out.token_ids == _hf_generate(hf, prompt, eos, 20, min_new=min_tokens)
    assert_kv_free(llm.stats())
