"""What a forward pass launches first. The attention's early reads (ASYNCSPEC_ATTN_EARLY_KV, kernels/pdl.py) rely on
every pass beginning with a launch without PDL, the token embedding's torch gather, before any kernel of its layers:
that launch completes only after every earlier kernel, so what the pass's attention reads early is complete, however
the layers' launches trigger."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig
from tests.models.test_hf_equivalence import BUNDLED, run_paged


def test_a_forward_pass_begins_with_the_embedding_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig.from_pretrained(BUNDLED)
    model = load_model(BUNDLED, config, torch.float32, torch.device("cpu"))
    events: list[str] = []
    gather = F.embedding

    def recording_gather(*args, **kwargs):
        events.append("gather")
        return gather(*args, **kwargs)

    monkeypatch.setattr(F, "embedding", recording_gather)
    for name, module in model.named_modules():
        if name and not any(True for _ in module.children()):
            module.register_forward_pre_hook(lambda m, args, name=name: events.append(name))
    run_paged(model, config, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], starts=[0, 1], block_size=4, chunks=[3])
    assert events[:2] == ["model.embed_tokens", "gather"]
    # Each pass (one per chunk) begins so: no layer's module runs before its pass's gather.
    passes = [i for i, event in enumerate(events) if event == "model.embed_tokens"]
    assert len(passes) >= 2 and all(events[i + 1] == "gather" for i in passes)
    assert any(event.startswith("model.layers.") for event in events)
