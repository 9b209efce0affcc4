"""Our paged, chunked forward pass against transformers' full forward, for every supported family."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from asyncspec.kernels.slot_mapping import compute_slot_mapping_ref
from asyncspec.layers.attention_metadata import AttentionMetadata
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig
from tests.hf_tiny_models import save_random_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED = os.path.join(REPO, "models", "stdlib-coder-target")

_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

CASES = {
    "llama-untied-bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    ),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "mistral-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=4, head_dim=16)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2-window": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, num_key_value_heads=4)),
    "qwen3-bias": (Qwen3Config, Qwen3ForCausalLM, dict(attention_bias=True)),
}


def _save_random_hf_model(cfg_cls, model_cls, overrides, path: str) -> torch.nn.Module:
    return save_random_hf_model(cfg_cls, model_cls, {**_TINY, **overrides}, path)


def run_paged(
    model,
    config: ModelConfig,
    prompts: list[list[int]],
    starts: list[int],
    block_size: int,
    chunks: list[int],
    seed: int = 0,
) -> list[torch.Tensor]:
    """Feed each prompt through `model` in chunks (sizes from `chunks`, then 1 at a time), all requests batched
    together with ragged lengths, over a shuffled block table; request b joins at step starts[b].
    Returns each prompt's logits [len, vocab] collected across steps."""
    gen = torch.Generator().manual_seed(seed)
    need = [(len(p) + block_size - 1) // block_size for p in prompts]
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(prompts), max(need) + 2, dtype=torch.int32)
    for b, n in enumerate(need):
        block_tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    dtype = model.model.embed_tokens.weight.dtype
    kv_caches = [
        (torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
        for _ in range(config.num_hidden_layers)
    ]
    done = [0] * len(prompts)
    steps = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        active = [b for b, p in enumerate(prompts) if done[b] < len(p) and step >= starts[b]]
        ids, pos, q_lens = [], [], []
        for b in active:
            n = chunks[steps[b]] if steps[b] < len(chunks) else 1
            n = min(n, len(prompts[b]) - done[b])
            ids += prompts[b][done[b] : done[b] + n]
            pos += list(range(done[b], done[b] + n))
            q_lens.append(n)
        step += 1
        if not active:
            continue
        num_pad = 2  # padded rows, as a CUDA-graph batch would have
        ids_t = torch.tensor(ids + [0] * num_pad)
        pos_t = torch.tensor(pos + [0] * num_pad)
        qsl = torch.zeros(len(active) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
        seq_lens = torch.tensor([done[b] + n for b, n in zip(active, q_lens, strict=True)], dtype=torch.int32)
        tables = block_tables[active]
        md = AttentionMetadata(
            slot_mapping=compute_slot_mapping_ref(tables, qsl, pos_t, block_size),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=max(q_lens),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
        )
        with torch.no_grad():
            hidden = model(ids_t, pos_t, kv_caches, md)
            out = model.compute_logits(hidden)
        assert out.dtype == torch.float32 and out.shape == (len(ids) + num_pad, config.vocab_size)
        for i, b in enumerate(active):
            logits[b].append(out[int(qsl[i]) : int(qsl[i + 1])])
            done[b] += q_lens[i]
            steps[b] += 1
    return [torch.cat(x) for x in logits]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_logits(case: str, tmp_path) -> None:
    cfg_cls, model_cls, overrides = CASES[case]
    hf = _save_random_hf_model(cfg_cls, model_cls, overrides, str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    model = load_model(str(tmp_path), config, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (13, 9, 20)]
    ours = run_paged(model, config, prompts, starts=[0, 1, 3], block_size=4, chunks=[5, 3])
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_bundled_model_matches_hf() -> None:
    from tokenizers import Tokenizer

    config = ModelConfig.from_pretrained(BUNDLED)
    model = load_model(BUNDLED, config, torch.float32, torch.device("cpu"))
    tok = Tokenizer.from_file(os.path.join(BUNDLED, "tokenizer.json"))
    prompt = tok.encode("import os\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n").ids
    ours = run_paged(model, config, [prompt], starts=[0], block_size=16, chunks=[len(prompt) - 4])[0]
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
