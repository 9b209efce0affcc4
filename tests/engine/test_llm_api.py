"""LLM: the offline API. Validation before any work, per-prompt params, output fields and order, text and
token-id prompts, logprobs against an HF forward pass, stats counters."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncspec import LLM, RequestOutput, SamplingParams
from asyncspec.errors import ConfigError, InvalidRequestError, InvalidSamplingParamsError, ModelLoadError
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import (
    BUNDLED_VOCAB,
    assert_ids_in_vocab,
    assert_kv_free,
    bundled_llm,
    bundled_target_with_generation_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
STAT_KEYS = {
    "num_steps",
    "num_preemptions",
    "num_admission_deferrals",
    "num_prompt_tokens_computed",
    "num_prompt_tokens",
    "num_prompt_tokens_cached",
    "num_generation_tokens",
    "num_finished_requests",
    "num_running_requests",
    "num_waiting_requests",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_kv_blocks",
    "num_free_kv_blocks",
    "kv_cache_usage",
}


@pytest.fixture(scope="module")
def llm(one_thread):
    return bundled_llm(max_model_len=128, num_kv_blocks=48, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def prompts():
    return [p[: 20 + 7 * i] for i, p in enumerate(load_prompts(4))]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return llm.generate(prompts, GREEDY)


@pytest.fixture(autouse=True)
def _kv_whole_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_kv_free(request.getfixturevalue("llm").stats())


def test_output_fields_and_prompt_order(llm, prompts, reference):
    # Different max_tokens per prompt, so they finish in reverse order of submission.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 6, 4, 2)]
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    assert len({o.request_id for o in outs}) == len(outs)
    tok = llm.get_tokenizer()
    for prompt, p, out, ref in zip(prompts, params, outs, reference, strict=True):
        assert isinstance(out, RequestOutput)
        assert isinstance(out.request_id, str) and out.request_id
        assert out.prompt_token_ids == prompt
        assert out.token_ids == ref.token_ids[: p.max_tokens]
        assert out.text == tok.decode(out.token_ids)
        assert out.finish_reason == "length" and out.finished
        assert out.num_draft_tokens == 0 and out.num_accepted_tokens == 0
        assert out.logprobs is None
        assert_ids_in_vocab(out.token_ids)


def test_single_prompt_forms(llm, prompts, reference):
    one = llm.generate(prompts[0], GREEDY)
    assert len(one) == 1 and one[0].token_ids == reference[0].token_ids
    text = llm.get_tokenizer().decode(prompts[1])
    by_text = llm.generate(text, GREEDY)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False).ids
    by_ids = llm.generate([ids], GREEDY)
    assert by_text[0].prompt_token_ids == ids
    assert by_text[0].token_ids == by_ids[0].token_ids
    assert by_text[0].text == by_ids[0].text
    assert llm.generate([], GREEDY) == []
    # Tensors: a 1-D tensor is one prompt, a 2-D tensor a batch, a list of tensors a batch.
    t = torch.tensor(prompts[0])
    assert [o.token_ids for o in llm.generate(t, GREEDY)] == [reference[0].token_ids]
    assert [o.token_ids for o in llm.generate(torch.stack([t, t]), GREEDY)] == [reference[0].token_ids] * 2
    assert [o.token_ids for o in llm.generate([t], GREEDY)] == [reference[0].token_ids]
    # NumPy: an array or a list of its integers is one prompt; a generator of prompts is a batch.
    import numpy as np

    as_numpy = np.array(prompts[0], dtype=np.int64)
    assert [o.token_ids for o in llm.generate(list(as_numpy), GREEDY)] == [reference[0].token_ids]
    assert [o.token_ids for o in llm.generate(as_numpy, GREEDY)] == [reference[0].token_ids]
    batch = llm.generate((p for p in prompts[:2]), GREEDY)
    assert [o.token_ids for o in batch] == [r.token_ids for r in reference[:2]]


def test_mixed_text_and_token_prompts(llm, prompts, reference):
    tok = llm.get_tokenizer()
    text = "import os\nimport sys\n\n\ndef main("
    outs = llm.generate([prompts[0], text, prompts[2]], GREEDY)
    assert outs[0].token_ids == reference[0].token_ids
    assert outs[2].token_ids == reference[2].token_ids
    assert outs[1].prompt_token_ids == tok.encode(text, add_special_tokens=False).ids
    assert outs[1].text == tok.decode(outs[1].token_ids)


@pytest.mark.parametrize(
    "bad, error",
    [
        ([], InvalidRequestError),
        ([1, 2, BUNDLED_VOCAB], InvalidRequestError),
        ([3, -1], InvalidRequestError),
        ([7] * 128, InvalidRequestError),  # no position left under max_model_len=128
        (None, InvalidRequestError),
        (b"import os", InvalidRequestError),  # bytes are ints too, never meant as token ids
        ({"prompt": "import os"}, InvalidRequestError),
        ([1, True, 2], InvalidRequestError),
    ],
)
def test_bad_prompt_raises_before_any_work(llm, prompts, reference, bad, error):
    before = llm.stats()
    with pytest.raises(error):
        llm.generate([prompts[0], bad, prompts[1]], GREEDY)
    after = llm.stats()
    assert after["num_steps"] == before["num_steps"], "no step may run for a batch with a bad prompt"
    assert after["num_finished_requests"] == before["num_finished_requests"]
    assert_kv_free(after)
    outs = llm.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference[:2]]


def test_bad_params_raise_before_any_work(llm, prompts):
    before = llm.stats()["num_steps"]
    with pytest.raises(InvalidRequestError):
        llm.generate(prompts[:2], [GREEDY])  # one SamplingParams for two prompts
    with pytest.raises(InvalidSamplingParamsError):
        llm.generate(prompts[:2], [GREEDY, SamplingParams(stop_token_ids=[BUNDLED_VOCAB])])
    with pytest.raises(InvalidRequestError):
        llm.generate(prompts[:2], [GREEDY, {"temperature": 0.0}])
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(temperature=float("nan"))
    # A dict of options, or a single prompt's worth of anything but SamplingParams, names what is expected.
    with pytest.raises(InvalidRequestError, match="sampling_params must be a SamplingParams or a list"):
        llm.generate(prompts[:2], {"temperature": 0.0})
    # A priority the fcfs engine would ignore is refused, as vLLM does.
    with pytest.raises(InvalidRequestError, match="scheduling_policy 'priority'"):
        llm.generate(prompts[:2], GREEDY, priority=[0, 3])
    for bad in (b"import os", {"prompt": "import os"}, 7):
        with pytest.raises(InvalidRequestError, match="prompts must be"):
            llm.generate(bad, GREEDY)
    assert llm.stats()["num_steps"] == before


def test_unknown_engine_option_is_config_error():
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(str(TARGET_MODEL), device="cpu", no_such_option=1)


def test_stats_counters(llm, prompts):
    before = llm.stats()
    assert STAT_KEYS <= set(before)
    llm.generate(prompts[:2], GREEDY)
    after = llm.stats()
    assert after["num_steps"] > before["num_steps"]
    assert after["num_finished_requests"] == before["num_finished_requests"] + 2
    assert after["num_generation_tokens"] == before["num_generation_tokens"] + 16
    assert after["num_prompt_tokens_computed"] >= before["num_prompt_tokens_computed"]
    assert after["kv_cache_usage"] == 0.0


# -- logprobs --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(TARGET_MODEL, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=3),
    ],
    ids=["greedy", "sampled"],
)
def test_logprobs_match_hf(llm, prompts, hf_model, params):
    outs = llm.generate(prompts[:2], params)
    for prompt, out in zip(prompts[:2], outs, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = hf_model(full).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + i]
            assert lp.token_ids[0] == token
            assert len(lp.token_ids) == len(lp.logprobs) == 4
            assert_ids_in_vocab(lp.token_ids)
            torch.testing.assert_close(torch.tensor(lp.logprobs[0]), row[token], atol=1e-4, rtol=0)
            top_lp, top_ids = row.topk(3)
            torch.testing.assert_close(torch.tensor(lp.logprobs[1:]), top_lp, atol=1e-4, rtol=0)
            assert lp.token_ids[1:] == top_ids.tolist()
            assert lp.sampled_token_rank == int((row > row[token]).sum()) + 1
            if params.temperature == 0.0:
                assert lp.sampled_token_rank == 1 and lp.token_ids[1] == token
    if params.temperature > 0:
        assert any(lp.sampled_token_rank > 1 for o in outs for lp in o.logprobs), "nothing but top-1 was sampled"


def test_logprobs_zero_and_truncated_by_stop_string(llm, prompts, reference):
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))[0]
    assert [len(lp.token_ids) for lp in out.logprobs] == [1] * 8
    text = reference[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.token_ids)


def _with_bos_post_processor(tmp_path):
    """The bundled target with a Llama-style tokenizer.json: its post-processor puts a BOS token (id 0 here) first."""
    import json
    import shutil

    model = tmp_path / "bos-model"
    shutil.copytree(TARGET_MODEL, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    bos = tokenizer["added_tokens"][0]["content"]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [tokenizer["added_tokens"][0]["id"]], "tokens": [bos]}},
    }
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


def test_text_prompts_get_the_tokenizers_special_tokens_as_in_hugging_face(tmp_path):
    """Llama and Mistral tokenizers put <s> / <|begin_of_text|> first, which their models expect: a text prompt
    is encoded as Hugging Face's tokenizer (and vLLM) encode it; token-id prompts are taken as they are."""
    from transformers import AutoTokenizer

    model = _with_bos_post_processor(tmp_path)
    text = "import os\n"
    hf_ids = AutoTokenizer.from_pretrained(model)(text).input_ids
    plain = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False).input_ids
    assert hf_ids == [0, *plain]
    llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=16)
    by_text, by_ids = llm.generate([text, plain], GREEDY)
    assert by_text.prompt_token_ids == hf_ids
    assert by_ids.prompt_token_ids == plain
    assert by_text.token_ids == llm.generate([hf_ids], GREEDY)[0].token_ids


def test_a_tokenizer_with_ids_past_the_models_vocabulary_fails_the_request_not_the_engine(tmp_path):
    """A tokenizer whose added tokens lie past the model's rows (a mismatched tokenizer, some fine-tunes): a text
    prompt that uses one is refused with InvalidRequestError before any work, and the engine serves on."""
    import json
    import shutil

    model = tmp_path / "wide-tokenizer"
    shutil.copytree(TARGET_MODEL, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append(
        {
            "id": BUNDLED_VOCAB + 5,
            "content": "<tool>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=16)
    with pytest.raises(InvalidRequestError, match=r"token id \d+ \('<tool>'\), outside the model's vocabulary"):
        llm.generate(["import os\n", "x = <tool>"], GREEDY)
    assert llm.stats()["num_steps"] == 0
    assert len(llm.generate(["import os\n"], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_a_missing_model_directory_says_so(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist or is not a directory"):
        LLM(str(tmp_path / "no-such-model"), device="cpu")


def test_a_kv_pool_too_small_on_the_cpu_names_the_settings_that_size_it():
    with pytest.raises(ConfigError, match="raise num_kv_blocks / kv_cache_bytes or lower max_model_len"):
        LLM(str(TARGET_MODEL), device="cpu", max_model_len=256, num_kv_blocks=4, block_size=16)


def test_generate_without_params_samples_as_the_models_generation_config_says(tmp_path, prompts):
    """As vLLM's LLM: no sampling params means the model's generation_config.json recommendations (here greedy
    and 5 tokens), an explicit SamplingParams is used as given, and generation_config="none" ignores the file."""
    model = bundled_target_with_generation_config(tmp_path / "m", {"temperature": 0.0, "max_new_tokens": 5})
    llm = bundled_llm(model=model)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    greedy = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=5))
    assert [o.token_ids for o in llm.generate(prompts[:2])] == [o.token_ids for o in greedy]
    assert all(len(o.token_ids) == 5 for o in greedy)

    unset = bundled_llm(model=model, generation_config="none")
    assert unset.get_default_sampling_params() == SamplingParams()
    assert len(unset.generate(prompts[0], None)[0].token_ids) == 16
    sampled = SamplingParams(max_tokens=24, seed=1, ignore_eos=True)  # temperature 1.0 as given
    explicit = llm.generate(prompts[0], sampled)[0].token_ids
    assert explicit == unset.generate(prompts[0], sampled)[0].token_ids
    assert (
        explicit
        != llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].token_ids
    )


@pytest.mark.parametrize("gen,field", [({"temperature": -0.5}, "temperature"), ({"max_new_tokens": 0}, "max_tokens")])
def test_a_bad_recommendation_in_generation_config_fails_auto_and_none_ignores_it(tmp_path, gen, field):
    model = bundled_target_with_generation_config(tmp_path / "m", gen)
    with pytest.raises(
        ModelLoadError, match=rf"generation_config.json .*SamplingParams.{field}.*generation_config='none'"
    ):
        bundled_llm(model=model)
    for ignore in ("none", "vllm"):  # vLLM's name for it
        assert bundled_llm(model=model, generation_config=ignore).get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_an_unreadable_generation_config_fails_auto_and_none_ignores_it(tmp_path, text):
    """A generation_config.json that is not a JSON object: "auto" would take its sampling defaults, so it refuses to
    start and names the file; "none" and "vllm" never take them and start without it (vLLM falls back the same)."""
    model = bundled_target_with_generation_config(tmp_path / "m", {})
    (tmp_path / "m" / "generation_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=r"generation_config.json: .*generation_config='none'"):
        bundled_llm(model=model)
    for ignore in ("none", "vllm"):
        llm = bundled_llm(model=model, generation_config=ignore)
        assert llm.get_default_sampling_params() == SamplingParams()
        assert llm.generate("def f(", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0].token_ids
