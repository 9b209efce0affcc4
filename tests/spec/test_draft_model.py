"""The bundled draft/target pair: acceptance at k=4, the draft's KV in lockstep (a self-draft accepts
everything), and start-up refusal of a draft that does not match the target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncspec import LLM, EngineConfig, SamplingParams
from asyncspec.errors import ConfigError
from tests.conftest import DRAFT_MODEL, TARGET_MODEL, load_prompts

CONFIG = dict(device="cpu", dtype="float32", max_model_len=640, num_kv_blocks=600, max_num_batched_tokens=1024)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_bundled_pair_accepts_at_least_3_3_tokens_per_step_at_k4_and_report_ngram(one_thread):
    prompts = load_prompts(16)
    rates = {}
    for method in ("draft_model", "ngram"):
        llm = LLM(str(TARGET_MODEL), speculative_method=method, num_speculative_tokens=4, **CONFIG)
        llm.generate(prompts, GREEDY)
        stats = llm.stats()
        rates[method] = stats["spec_mean_acceptance_length"]
        by_position = [stats[f"spec_accepted_at_position_{i}"] / stats["spec_num_drafts"] for i in range(4)]
        print(f"{method}: {rates[method]:.3f} tokens per target step; acceptance by position {by_position}")
    assert rates["draft_model"] >= 3.3, rates
    assert rates["ngram"] > 1.0, rates


def test_default_draft_is_the_bundled_one_only_for_the_bundled_target(tmp_path):
    config = EngineConfig(model=str(TARGET_MODEL), speculative_method="draft_model", num_speculative_tokens=4)
    assert Path(config.draft_model_path or "").resolve() == DRAFT_MODEL.resolve()
    other = tmp_path / "my-model"
    shutil.copytree(TARGET_MODEL, other)
    with pytest.raises(ConfigError, match="draft_model"):
        EngineConfig(model=str(other), speculative_method="draft_model", num_speculative_tokens=4)


def test_self_draft_accepts_every_token(one_thread):
    """The target as its own draft: every greedy draft is right, so any loss of acceptance would
    mean the draft's KV (catch-up, shared block tables, garbage past the verified run) is wrong."""
    llm = LLM(
        str(TARGET_MODEL),
        speculative_method="draft_model",
        draft_model=str(TARGET_MODEL),
        num_speculative_tokens=4,
        **{**CONFIG, "max_num_batched_tokens": 96, "max_num_seqs": 8, "num_kv_blocks": 200},
    )
    llm.generate(load_prompts(8), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 100
    assert stats["spec_num_accepted_tokens"] >= stats["spec_num_draft_tokens"] - 2, stats


def _copy_draft(tmp_path: Path) -> Path:
    draft = tmp_path / "draft"
    shutil.copytree(DRAFT_MODEL, draft)
    return draft


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(vocab_size=8000), "vocab_size"),
        (dict(eos_token_id=5), "eos_token_ids"),
        (dict(bos_token_id=7), "bos_token_id"),
    ],
)
def test_mismatched_draft_is_refused_naming_the_mismatch(tmp_path, change, field):
    draft = _copy_draft(tmp_path)
    _edit_config(draft, **change)
    if "eos_token_id" in change:
        (draft / "generation_config.json").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=field):
        LLM(
            str(TARGET_MODEL),
            speculative_method="draft_model",
            draft_model=str(draft),
            num_speculative_tokens=2,
            **CONFIG,
        )


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    draft = _copy_draft(tmp_path)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "_changed"] = vocab.pop(first)
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(
            str(TARGET_MODEL),
            speculative_method="draft_model",
            draft_model=str(draft),
            num_speculative_tokens=2,
            **CONFIG,
        )


def test_missing_draft_directory_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="draft|config.json|no such|not found"):
        LLM(
            str(TARGET_MODEL),
            speculative_method="draft_model",
            draft_model=str(tmp_path / "nope"),
            num_speculative_tokens=2,
            **CONFIG,
        )


def _tiny_pair(tmp_path: Path, family: str) -> tuple[Path, Path]:
    """A random tiny target of `family` and an unrelated random tiny Llama draft (same vocabulary,
    special ids and tokenizer): the draft is mostly wrong, so most drafts are rejected."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.engine.test_tiny_families import _TINY, FAMILIES
    from tests.hf_tiny_models import save_random_hf_model

    target, draft = tmp_path / "target", tmp_path / "draft"
    cfg_cls, model_cls, overrides = FAMILIES[family]
    save_random_hf_model(cfg_cls, model_cls, {**_TINY, **overrides}, target)
    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)
    save_random_hf_model(LlamaConfig, LlamaForCausalLM, {**_TINY, **small}, draft)
    for path in (target, draft):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TARGET_MODEL / name, path / name)
    return target, draft


@pytest.mark.parametrize("family", ["llama-untied", "llama-tied-bias", "llama3-rope", "mistral", "qwen2", "qwen3"])
def test_random_tiny_draft_many_rejections_greedy_unchanged(one_thread, tmp_path, family):
    target, draft = _tiny_pair(tmp_path, family)
    config = dict(
        device="cpu",
        dtype="float32",
        block_size=4,
        max_model_len=64,
        num_kv_blocks=24,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        skip_tokenizer_init=True,
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (12 + 3 * i,), generator=gen).tolist() for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target), **config).generate(prompts, params)
    llm = LLM(str(target), speculative_method="draft_model", draft_model=str(draft), num_speculative_tokens=3, **config)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 50
    assert stats["spec_num_accepted_tokens"] < 0.5 * stats["spec_num_draft_tokens"], "expected many rejections"
    assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
