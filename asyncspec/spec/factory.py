"""Builds the speculative decoder an EngineConfig asks for (None without speculation)."""

from __future__ import annotations

import torch

from asyncspec.config import EngineConfig
from asyncspec.models.model_config import ModelConfig
from asyncspec.spec.draft_model_proposer import DraftModelProposer
from asyncspec.spec.ngram_proposer import NgramProposer
from asyncspec.spec.spec_decoder import SpeculativeDecoder


def make_speculative_decoder(
    config: EngineConfig,
    target_config: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> SpeculativeDecoder | None:
    k = config.num_speculative_tokens
    proposer: NgramProposer | DraftModelProposer
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        proposer = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        draft_path = config.draft_model_path
        assert draft_path is not None  # EngineConfig validated it
        proposer = DraftModelProposer(
            draft_path,
            target_config,
            config.model,
            k,
            max_model_len,
            config.block_size,
            dtype,
            device,
            config.load_format,
            config.seed,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_draft_lag,
        )
    return SpeculativeDecoder(k, proposer, config.max_num_seqs, target_config.vocab_size, device)
