"""OutputProcessor: a step's tokens through the detokenizer into outputs, without a model."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from asyncspec.core.scheduler_output import EngineCoreOutput
from asyncspec.engine.output_processor import OutputProcessor
from asyncspec.sampling_params import SamplingParams
from tests.conftest import TARGET_MODEL


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TARGET_MODEL / "tokenizer.json"))


@pytest.mark.parametrize("stream_deltas", [True, False], ids=["deltas", "whole"])
@pytest.mark.parametrize("ended_by", ["stop token", "eos"])
def test_stop_string_and_stop_token_in_one_step_report_the_stop_string(tok, stream_deltas, ended_by):
    """One step of several tokens (speculation, or a multi-step plan) completes a stop string and then ends on a
    stop token or EOS: the output ends at the stop string and names it, not the token it cut (as vLLM)."""
    prompt = tok.encode("def f(x):").ids
    ids = tok.encode(" return x\n\nprint").ids  # "\n\n" is complete before the last token
    if ended_by == "stop token":
        tokens, stop_token_ids, core_stop_reason = ids, [ids[-1]], ids[-1]
    else:
        tokens, stop_token_ids, core_stop_reason = [*ids[:-1], 0], [], None  # 0: EOS, no stop reason
    processor = OutputProcessor(tok)
    processor.add_request(
        "r", prompt, SamplingParams(stop=["\n\n"], stop_token_ids=stop_token_ids, max_tokens=50), stream_deltas
    )
    core = EngineCoreOutput("r", tokens, finish_reason="stop", stop_reason=core_stop_reason)
    output = processor.process_outputs([core]).outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason == "\n\n"
    assert output.text == " return x"
    assert output.token_ids == ids[: len(output.token_ids)] and len(output.token_ids) < len(tokens)


@pytest.mark.parametrize("stream_deltas", [True, False], ids=["deltas", "whole"])
@pytest.mark.parametrize("core_finish", ["length", "stop"])
def test_a_request_ending_inside_a_character_still_stops_at_a_stop_string_before_it(tok, stream_deltas, core_finish):
    """The last token holds a space and a character's first byte: the space completes the stop string "= ", so the
    output ends there with finish "stop", whether the core ended it at max_tokens or on EOS right after."""
    ids = tok.encode("a = €").ids
    tokens = next(ids[:n] for n in range(1, len(ids)) if tok.decode(ids[:n]) == "a = \ufffd")
    if core_finish == "stop":
        tokens = [*tokens, 0]  # EOS
    processor = OutputProcessor(tok)
    processor.add_request("r", tok.encode("x = 1\n").ids, SamplingParams(stop=["= "], max_tokens=10), stream_deltas)
    processed = processor.process_outputs([EngineCoreOutput("r", tokens, finish_reason=core_finish)])
    *_, output = processed.outputs
    assert "".join(o.text for o in processed.outputs) == "a "
    assert output.finish_reason == "stop" and output.stop_reason == "= "
    assert [t for o in processed.outputs for t in o.token_ids] == tokens[:3]
