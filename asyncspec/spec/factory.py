"""Builds the speculative decoder an EngineConfig asks for (None without speculation)."""

from __future__ import annotations

import torch

from asyncspec.config import EngineConfig
from asyncspec.spec.ngram_proposer import NgramProposer
from asyncspec.spec.spec_decoder import SpeculativeDecoder


def make_speculative_decoder(
    config: EngineConfig, vocab_size: int, max_num_reqs: int, device: torch.device
) -> SpeculativeDecoder | None:
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        return SpeculativeDecoder(config.num_speculative_tokens, proposer, max_num_reqs, vocab_size, device)
    raise NotImplementedError(f"speculative_method={config.speculative_method!r}")
