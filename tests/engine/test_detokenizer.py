"""IncrementalDetokenizer on the bundled byte-level BPE tokenizer: streaming equals a full
decode (multibyte characters included), and stop strings truncate exactly and never leak."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from asyncspec.engine import detokenizer as detokenizer_module
from asyncspec.engine.detokenizer import IncrementalDetokenizer, detokenize
from asyncspec.sampling_params import SamplingParams

TOKENIZER_PATH = Path(__file__).resolve().parents[2] / "models" / "stdlib-coder-target" / "tokenizer.json"
PROMPT = "# a prompt\ndef main():\n"
TEXTS = [
    "def foo(x):\n    return x + 1  # done\n",
    "héllo wörld, café crème brûlée — naïve façade",
    "emoji 🎉🚀 mixed 👩‍💻 family 👨‍👩‍👧 flags 🇫🇷 end",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "math ∑ ∫ ≤ ≥ ≠ ∞ and arrows ← → ↑ ↓ and ß ø å",
    "tabs\tand\nnewlines\r\n  spaces   and 'quotes' \"double\" {braces} [x]",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_PATH))


class _RefusingStream:
    """A DecodeStream that refuses every token: the detokenizer goes on in Python from the first one."""

    def __init__(self, skip_special_tokens: bool) -> None:
        pass

    def step(self, tokenizer: Tokenizer, token_id: int) -> str | None:
        raise ValueError("refused")


@pytest.fixture(autouse=True, params=["rust", "python"])
def decode_path(request, monkeypatch):
    """Every test runs on the library's DecodeStream and on the Python window method it falls back to."""
    if request.param == "python":
        monkeypatch.setattr(detokenizer_module, "DecodeStream", _RefusingStream)
    return request.param


def stream(tok: Tokenizer, ids: list[int], params: SamplingParams, chunks: list[int] | None = None):
    """Feeds ids (one at a time, or in the given chunk sizes); returns (detok, deltas, stop)."""
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, params)
    deltas, stop, i = [], None, 0
    sizes = iter(chunks or [])
    while i < len(ids) and stop is None:
        n = next(sizes, 1)
        stop = detok.update(ids[i : i + n])
        i += n
        deltas.append(detok.get_text_delta(finished=stop is not None))
    if stop is None:
        deltas.append(detok.get_text_delta(finished=True))
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_without_partial_chars(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    assert detokenize(tok, ids) == text
    detok, deltas, stop = stream(tok, ids, SamplingParams())
    assert stop is None
    assert "".join(deltas) == text == detok.output_text
    assert not any("\ufffd" in d for d in deltas)  # never a half character mid-stream


def test_random_texts_random_chunking(tok: Tokenizer) -> None:
    rng = random.Random(0)
    alphabet = "abc xyz_():\n\t0123456789éüñçß€£¥日本語中文한국어🎉🚀👍🏽😀—…’“”"
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
        ids = tok.encode(text).ids
        chunks = [rng.randrange(1, 5) for _ in ids]
        _, deltas, _ = stream(tok, ids, SamplingParams(), chunks)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_equal_full_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    """Arbitrary ids (invalid UTF-8 byte runs and special tokens included) still stream to
    exactly what a full decode gives, U+FFFD where bytes are invalid."""
    rng = random.Random(1)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.choice([0, 1]) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        detok, deltas, _ = stream(tok, ids, params, [rng.randrange(1, 4) for _ in ids])
        full = detokenize(tok, ids, skip_special_tokens)
        assert "".join(deltas) == full == detok.output_text


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("hello").ids + [0]
    assert "".join(stream(tok, ids, SamplingParams())[1]) == "hello"
    assert "".join(stream(tok, ids, SamplingParams(skip_special_tokens=False))[1]) == "hello<|endoftext|>"


def test_trailing_incomplete_char_flushed_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉").ids
    cut = ids[:-1]  # the emoji spans several byte tokens; stop mid-character
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(cut)
    assert "\ufffd" not in detok.get_text_delta(finished=False)
    detok.finish()  # what a non-streaming caller does before reading output_text
    assert detok.output_text == detokenize(tok, cut) and detok.output_text.endswith("\ufffd")
    assert detok.get_text_delta(finished=True).endswith("\ufffd")
    detok.finish()
    assert detok.output_text == detokenize(tok, cut)


# -- stop strings -------------------------------------------------------------------------------
def _stop_case(tok: Tokenizer, text: str, stop: list[str], include: bool = False, chunks=None):
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=None)
    return stream(tok, tok.encode(text).ids, params, chunks)


def test_exact_truncation_and_no_leak(tok: Tokenizer) -> None:
    text = "def foo():\n    return 1\n\ndef bar():\n    pass\n"
    detok, deltas, stop = _stop_case(tok, text, ["\ndef"])
    assert stop == "\ndef"
    assert detok.output_text == "def foo():\n    return 1\n"
    assert "".join(deltas) == detok.output_text
    assert detok.stop_reason == "\ndef"
    # Tokens after the one completing the stop string are not consumed.
    assert detok.num_output_tokens < len(tok.encode(text).ids)
    assert detok.update(tok.encode("more").ids) is None and detok.output_text == "def foo():\n    return 1\n"


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    detok, deltas, stop = _stop_case(tok, "alpha STOP beta", ["STOP"], include=True)
    assert stop == "STOP" and detok.output_text == "alpha STOP" == "".join(deltas)


def test_stop_string_spanning_tokens_and_multibyte(tok: Tokenizer) -> None:
    text = "x = 1 # 日本語 and more text after"
    ids = tok.encode(text).ids
    assert len(tok.encode("日本語").ids) > 1
    detok, deltas, stop = _stop_case(tok, text, ["日本"])
    assert stop == "日本" and detok.output_text == "x = 1 # " == "".join(deltas)
    detok, _, stop = _stop_case(tok, text, ["= 1 #"])  # spans several tokens
    assert stop == "= 1 #" and detok.output_text == "x "
    assert len(ids) > detok.num_output_tokens


def test_multiple_stop_strings_earliest_wins(tok: Tokenizer) -> None:
    text = "one two three four five"
    detok, _, stop = _stop_case(tok, text, ["four", "two", "three"])
    assert stop == "two" and detok.output_text == "one "
    # Both complete in the same update: the earlier start still wins.
    detok, _, stop = _stop_case(tok, text, ["ee four", "three"], chunks=[100])
    assert stop == "three" and detok.output_text == "one two "
    detok, _, stop = _stop_case(tok, text, ["two thr", "two"], chunks=[100])
    assert stop == "two"  # completes first, although the other starts at the same place
    # Both completed by the same token (" two"): the earlier start wins, whatever the list order.
    assert tok.encode("one two").tokens == ["one", "Ġtwo"]
    detok, _, stop = _stop_case(tok, "one two", ["two", "e two"])
    assert stop == "e two" and detok.output_text == "on"


def test_min_tokens_defers_stop_strings(tok: Tokenizer) -> None:
    text = "ab ab ab ab ab ab ab"
    params = SamplingParams(stop=["ab"], min_tokens=3, max_tokens=None)
    detok, _, stop = stream(tok, tok.encode(text).ids, params)
    assert stop == "ab"
    assert detok.num_output_tokens > 3 and len(detok.output_text) > 0


def _text_length_after_each_token(tok: Tokenizer, ids: list[int]) -> list[int]:
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, SamplingParams())
    lengths = []
    for t in ids:
        detok.update([t])
        lengths.append(len(detok.output_text))
    return lengths


def _first_token_showing(lengths: list[int], end: int) -> int:
    return next(i for i, n in enumerate(lengths) if n >= end)


def test_random_stop_strings_never_leak(tok: Tokenizer) -> None:
    """For random texts and stop strings cut from them, the streamed deltas (one token at a
    time or in chunks) concatenate to exactly the text before the first stop match."""
    rng = random.Random(2)
    alphabet = "ab cd\n():_=日本🎉é"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(5, 50)))
        stops = []
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randrange(1, 6)])
        include = rng.random() < 0.3
        chunks = [rng.randrange(1, 4) for _ in range(len(text))] if rng.random() < 0.5 else None
        detok, deltas, stop = _stop_case(tok, text, stops, include, chunks)
        # Reference: the match that becomes visible at the earliest token wins; among matches
        # completed by the same token, the earliest start (then the shortest) wins.
        lengths = _text_length_after_each_token(tok, tok.encode(text).ids)
        first = min(
            (_first_token_showing(lengths, text.find(s) + len(s)), text.find(s), len(s)) for s in stops if s in text
        )[1:]
        want = text[: first[0] + first[1]] if include else text[: first[0]]
        assert stop is not None
        assert "".join(deltas) == detok.output_text == want, (text, stops, stop)
        # With streaming, the stop string never appears in the stream unless asked for.
        if not include:
            assert not any(s in "".join(deltas) for s in stops)


def test_get_text_delta_withholds_possible_stop_prefix(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END!"], max_tokens=None))
    detok.update(tok.encode("hello EN").ids)
    assert detok.output_text == "hello EN"
    assert detok.get_text_delta(False) == "hello"  # last 3 chars may start "END!"
    assert detok.get_text_delta(False) == ""
    assert detok.update(tok.encode("D!").ids) == "END!"
    assert detok.get_text_delta(False) == " "  # stopped: everything left, nothing of the stop
    no_stop = IncrementalDetokenizer(tok, [], SamplingParams())
    no_stop.update(tok.encode("abc").ids)
    assert no_stop.get_text_delta(False) == "abc"


def test_a_chunk_ending_inside_a_character_emits_the_text_before_it(tok: Tokenizer) -> None:
    """Several tokens at once (a speculative step) whose last one leaves a character incomplete: the
    text before that character is emitted now, as one token at a time would, and the character
    arrives whole with the token that completes it."""
    ids = tok.encode("ab cd 🎉").ids
    assert len(ids) >= 4 and detokenize(tok, ids[:-1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, SamplingParams())
    assert detok.update(ids[:-1]) is None
    early = detok.get_text_delta(finished=False)
    assert early == detokenize(tok, ids[:-1]).rstrip("\ufffd") and "\ufffd" not in early
    detok.update(ids[-1:])
    assert early + detok.get_text_delta(finished=True) == "ab cd 🎉"


def test_a_stream_refused_mid_way_goes_on_in_python(tok: Tokenizer, decode_path: str, monkeypatch) -> None:
    """The library's stream failing after some tokens (a prefix that decodes differently, say): the rest is
    decoded in Python from the same offsets, and the text equals a full decode."""
    if decode_path == "python":
        pytest.skip("the library's stream is refused from the start here")
    text = TEXTS[2]
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    half = len(ids) // 2
    for token_id in ids[:half]:
        detok.update([token_id])
    assert detok._stream is not None  # one token a step: the library's stream

    class Failing:
        def step(self, tokenizer: Tokenizer, token_id: int) -> str | None:
            raise ValueError("refused")

    detok._stream = Failing()  # type: ignore[assignment]
    for token_id in ids[half:]:
        detok.update([token_id])
    assert detok._stream is None
    detok.finish()
    assert detok.output_text == detokenize(tok, ids)


def test_a_step_of_several_tokens_goes_on_in_python(tok: Tokenizer, decode_path: str) -> None:
    ids = tok.encode(TEXTS[1]).ids
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, SamplingParams())
    detok.update(ids[:1])
    assert (detok._stream is not None) == (decode_path == "rust")
    detok.update(ids[1:4])  # a speculative step
    assert detok._stream is None
    for token_id in ids[4:]:
        detok.update([token_id])
    detok.finish()
    assert detok.output_text == detokenize(tok, ids)


@pytest.mark.parametrize("grouping", ["one a step", "one step"])
@pytest.mark.parametrize("text", ["x = '日本' + 1", "y = €\nz"])
def test_a_prompt_ending_inside_a_character_gives_the_same_text_however_tokens_group(
    tok: Tokenizer, decode_path: str, grouping: str, text: str
) -> None:
    """Token-id prompts may be cut mid-character: the first output token completing that character emits all of
    it (as the library's stream and vLLM do), in either decode path and whatever the steps' sizes. The prompt's
    own complete characters in that token (" €" is one token of a space and the euro's first byte) stay out."""
    ids = tok.encode(text).ids
    cuts = [c for c in range(1, len(ids)) if detokenize(tok, ids[:c]).endswith("\ufffd")]
    assert cuts  # the tokenizer splits these characters' bytes
    for cut in cuts:
        prompt, out = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
        for chunk in [[t] for t in out] if grouping == "one a step" else [out]:
            detok.update(chunk)
        detok.finish()
        whole = detokenize(tok, ids)
        assert detok.output_text == whole[len(detokenize(tok, prompt).rstrip("\ufffd")) :], cut


@pytest.mark.parametrize("grouping", ["one a step", "one step"])
def test_a_stop_string_in_the_prompt_part_of_a_split_character_does_not_stop(
    tok: Tokenizer, decode_path: str, grouping: str
) -> None:
    ids = tok.encode("y = €\nz").ids
    cut = next(c for c in range(1, len(ids)) if detokenize(tok, ids[:c]) == "y = \ufffd")  # the space is the prompt's
    detok = IncrementalDetokenizer(tok, ids[:cut], SamplingParams(stop=[" "]))
    stops = [detok.update(chunk) for chunk in ([[t] for t in ids[cut:]] if grouping == "one a step" else [ids[cut:]])]
    detok.finish()
    assert stops == [None] * len(stops) and detok.output_text == "€\nz"


@pytest.mark.parametrize("grouping", ["one a step", "one step"])
def test_a_stop_string_ends_at_the_token_whose_bytes_complete_it(
    tok: Tokenizer, decode_path: str, grouping: str
) -> None:
    """A token holding a space and a character's first byte completes "= ": the output ends at it, not at the
    tokens after it that complete the character (they come after the stop string)."""
    ids = tok.encode("a = €b").ids
    num_to_stop = next(n for n in range(1, len(ids)) if "= " in detokenize(tok, ids[:n]).rstrip("\ufffd"))
    assert detokenize(tok, ids[:num_to_stop]).endswith("\ufffd")  # the case: it ends inside a character
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, SamplingParams(stop=["= "]))
    stop = None
    for chunk in [[t] for t in ids] if grouping == "one a step" else [ids]:
        stop = stop or detok.update(chunk)
    assert stop == "= " and detok.num_output_tokens == num_to_stop
    assert detok.get_text_delta(finished=True) == "a "


def test_a_stop_string_before_a_split_character_waits_for_min_tokens(tok: Tokenizer, decode_path: str) -> None:
    ids = tok.encode("a = €b").ids
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, SamplingParams(stop=["= "], min_tokens=len(ids)))
    assert [detok.update([t]) for t in ids] == [None] * len(ids)
    detok.finish()
    assert detok.output_text == "a = €b"


def _byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: sentencepiece pieces, and <0xNN> tokens for bytes, decoded with ByteFallback."""
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "a", "b", "▁x", "▁=", "▁1"):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


@pytest.mark.parametrize("deferred", [False, True], ids=["streamed", "one-window"])
def test_byte_tokens_that_are_not_utf8_give_the_same_text_however_tokens_group(decode_path, deferred) -> None:
    """ByteFallback turns a run of byte tokens that is not UTF-8 into one U+FFFD a byte, its valid first byte
    ('"') included, where token by token that byte was already text. A window holding U+FFFD anywhere goes on
    token by token, so a step of several tokens (a speculative step; a whole output decoded at its end) gives
    the text one token a step gives."""
    tok = _byte_fallback_tokenizer()
    ids = [tok.token_to_id(t) for t in ("a", "<0x22>", "<0xC5>", "<0x07>", "b")]
    prompt = [tok.token_to_id(t) for t in ("▁x", "▁=", "▁1")]
    one_at_a_time = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for token_id in ids:
        one_at_a_time.update([token_id])
    one_at_a_time.finish()
    grouped = IncrementalDetokenizer(tok, prompt, SamplingParams())
    if deferred:
        grouped.update(ids)
    else:
        grouped.update(ids[:1])
        grouped.update(ids[1:])
    grouped.finish()
    assert '"' in one_at_a_time.output_text and "\ufffd" in one_at_a_time.output_text
    assert grouped.output_text == one_at_a_time.output_text


@pytest.mark.parametrize("min_tokens", [0, 1])
def test_a_stop_string_counts_at_the_token_that_completes_it_also_for_min_tokens(
    tok: Tokenizer, decode_path: str, min_tokens: int
) -> None:
    """ " €" is three tokens: a space with the euro's first byte, then two continuation bytes. The space completes the
    stop string " " at the first token: it stops there, or, when that token is within min_tokens, never (the later
    tokens complete only the euro), as a stop string completed by a whole token within min_tokens never counts."""
    ids = tok.encode(" €").ids
    assert len(ids) == 3 and detokenize(tok, ids[:1]) == " \ufffd"
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, SamplingParams(stop=[" "], min_tokens=min_tokens))
    stops = [detok.update([t]) for t in ids]
    detok.finish()
    if min_tokens == 0:
        assert stops[0] == " " and detok.num_output_tokens == 1 and detok.output_text == ""
    else:
        assert stops == [None, None, None] and detok.output_text == " €"
