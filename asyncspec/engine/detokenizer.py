"""Incremental detokenization and stop-string detection for one request.

Uses vLLM's prefix/read-offset method: each new token is decoded together with a short window
of the tokens before it, and text is emitted only once it no longer ends in U+FFFD (a UTF-8
character still split across tokens). Decoding the window, not the token alone, keeps
tokenizers whose decoders look at neighbours (sentencepiece spaces) correct.

While a request gets one token a step, the method runs in Rust (the tokenizers library's
`DecodeStream`, as in vLLM's fast detokenizer): one call per token instead of two window decodes
(128 streams of one token a step: output processing 0.53 -> 0.46 ms per step on this project's CPU,
benchmarks/output_processing.py). From its first step of several tokens (speculation) a request
goes on in Python, whose one window decode per step is cheaper there. The same offsets are kept
either way, so a stream the library refuses (a decoded prefix that changed) also goes on in
Python, and `finish` flushes a trailing incomplete character the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # a tokenizers without it: the Python window method alone
    DecodeStream = None  # type: ignore[assignment,misc]

from asyncspec.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output token, so its text gets the right context.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
_MAX_CHARACTER_TOKENS = 4  # a UTF-8 character has at most 4 bytes: at most 4 byte-level tokens


def detokenize(tokenizer: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Full decode of a token sequence (prompts, final outputs, the Detokenize RPC)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive, and applies its stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Withheld from streamed deltas: the longest text that could still grow into a stop
        # string. With include_stop_str_in_output the stop string is output anyway.
        self.stop_buffer_length = (
            max(params.max_stop_str_len - 1, 0) if self.stop and not self.include_stop_str_in_output else 0
        )
        self.output_text = ""
        """Text of the output tokens so far (truncated at a matched stop string)."""
        self.num_output_tokens = 0
        """Output tokens consumed; tokens after the one that completed a stop string are dropped."""
        self.stop_reason: str | None = None
        """The stop string that ended the request, once one matched."""
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._token_ids = context
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = self._first_incomplete_token(context)  # tokens before this have had their text emitted
        # The complete characters of prompt tokens after the read offset (a token holding a space and a character's
        # first byte): the first output text repeats them, and they are the prompt's, not the output's.
        self._prompt_chars_to_skip = 0
        if self._read_offset < len(context):
            complete = self._decode_ids(context).rstrip(_REPLACEMENT_CHAR)
            before = self._decode_ids(context[: self._read_offset])
            self._prompt_chars_to_skip = max(len(complete) - len(before), 0)
        self._sent_offset = 0  # characters of output_text already returned by get_text_delta
        # Complete characters of the tokens whose text waits for a split character, as far as stop strings were
        # looked for in them (`_stops_before_partial`): a later token looks only at what it adds.
        self._num_partial_chars_seen = 0
        self._flushed = False
        self._stream: DecodeStream | None = None
        if DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            try:
                for token_id in context:  # the window before the first output token
                    self._stream.step(tokenizer, token_id)
            except Exception:  # noqa: BLE001 - the library's stream is an optimisation: Python takes over
                self._stream = None

    def _first_incomplete_token(self, context: list[int]) -> int:
        """Where the prompt's incomplete last character starts (token ids may be cut inside one), else its end:
        the output token that completes the character then emits all of it, as the library's stream (and
        vLLM's) does, whichever path decodes and however the tokens group into steps."""
        if not context or not self._decode_ids(context).endswith(_REPLACEMENT_CHAR):
            return len(context)
        for start in range(len(context) - 1, max(len(context) - _MAX_CHARACTER_TOKENS, 0) - 1, -1):
            if not self._decode_ids(context[:start]).endswith(_REPLACEMENT_CHAR):
                return start
        return len(context)

    def _decode_ids(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    # -- decoding ------------------------------------------------------------------------
    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _pending_text(self, allow_partial: bool) -> str:
        """Text of the tokens after the read offset; empty while a character is incomplete."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or (not allow_partial and new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _without_prompt_text(self, delta: str) -> str:
        """The delta less the prompt's characters it still starts with (see `_prompt_chars_to_skip`)."""
        if not self._prompt_chars_to_skip:
            return delta
        num_skipped = min(self._prompt_chars_to_skip, len(delta))
        self._prompt_chars_to_skip -= num_skipped
        return delta[num_skipped:]

    def _step(self, token_id: int) -> str:
        """Appends one token; returns the text it completes ("" while a character is incomplete)."""
        self._token_ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self.tokenizer, token_id)
            except Exception:  # noqa: BLE001 - e.g. a prefix that decodes differently now: Python takes over
                self._stream = None
            else:
                if not piece:
                    return ""
                self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
                return piece
        return self._pending_text(allow_partial=False)

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Appends the tokens' text; returns the stop string if one now matches, else None.

        The result does not depend on how the tokens were grouped into steps (speculative decoding
        delivers several per step): one window decode takes them all where that gives what one at a
        time would, else they are taken one at a time. After a match the rest of the tokens are ignored
        and `num_output_tokens` counts only those up to the match.
        """
        if self.stop_reason is not None:
            return None
        if len(new_token_ids) > 1:
            # Several tokens a step (speculation): two window decodes for all of them beat a library call per
            # token, and the per-token stop checks that come with it (measured), so Python goes on from here.
            self._stream = None
            if self._update_all(new_token_ids):
                return None
        for token_id in new_token_ids:
            self.num_output_tokens += 1
            delta = self._step(token_id)
            if not delta:
                # A token ending inside a character may still complete a stop string with the characters before:
                # it is the last token delivered, not those that complete the character after it.
                if self.stop and self._stops_before_partial():
                    return self.stop_reason
                continue
            num_seen, self._num_partial_chars_seen = self._num_partial_chars_seen, 0
            delta = self._without_prompt_text(delta)
            if not delta:
                continue
            self.output_text += delta
            # As vLLM: stop strings count only once min_tokens have been generated. Only matches ending in what this
            # token completed are new: the characters before a split one were looked at by the token that made them.
            num_new = len(delta) - num_seen
            if self.stop and self.num_output_tokens > self.min_tokens and num_new > 0 and self._check_stop(num_new):
                return self.stop_reason
        return None

    def _update_all(self, new_token_ids: Sequence[int]) -> bool:
        """The text of all the new tokens from one window: two decodes per step instead of two per
        token (speculative steps bring several tokens). Declines, changing nothing, when token by
        token could differ: the window holds an incomplete or invalid character (the text before it is
        emitted now, as one token per step would), adds no text, starts below min_tokens while stop strings are
        set, or completes a stop string (which token completed it decides where the output ends)."""
        if self.stop and self.num_output_tokens < self.min_tokens:
            return False
        start = len(self._token_ids)
        self._token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(prefix_text) :]
        output_delta = delta[self._prompt_chars_to_skip :]
        # U+FFFD anywhere, not only at the end: a byte-fallback tokenizer decodes a run of byte tokens that is not
        # UTF-8 as one, where token by token a valid first byte ('"') was text of its own.
        if len(new_text) <= len(prefix_text) or _REPLACEMENT_CHAR in delta or self._would_stop(output_delta):
            del self._token_ids[start:]
            return False
        self.num_output_tokens += len(new_token_ids)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self.output_text += self._without_prompt_text(delta)
        self._num_partial_chars_seen = 0
        return True

    def _stops_before_partial(self) -> bool:
        """Whether the complete characters this token adds to the text that waits for a character split across
        tokens complete a stop string (past min_tokens, as any stop string); if so, that text is emitted and the
        output cut at the stop string."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        complete = self._decode(self._prefix_offset).rstrip(_REPLACEMENT_CHAR)
        delta = complete[len(prefix_text) :][self._prompt_chars_to_skip :]
        num_new = len(delta) - self._num_partial_chars_seen
        if num_new <= 0:
            return False  # a continuation byte: no character completed
        self._num_partial_chars_seen = len(delta)
        if self.num_output_tokens <= self.min_tokens or not self._would_stop(delta, num_new):
            return False
        self._prompt_chars_to_skip = 0
        self.output_text += delta
        return self._check_stop(num_new)

    def _would_stop(self, delta: str, num_new_chars: int | None = None) -> bool:
        """Whether appending `delta` would complete one of the stop strings (ending in its last `num_new_chars`
        characters; all of it by default)."""
        if not self.stop:
            return False
        text = self.output_text + delta
        num_new = len(delta) if num_new_chars is None else num_new_chars
        return any(text.find(stop, max(len(text) - num_new - len(stop) + 1, 0)) != -1 for stop in self.stop)

    def _check_stop(self, new_char_count: int) -> bool:
        """Looks for stop strings completed by the newest token's text and truncates at the
        earliest-starting one (ties: the shortest). Matches completed by an earlier token were
        handled then, so the first stop string to appear in the stream wins."""
        text = self.output_text
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            # Only matches ending inside the new text are new; earlier ones were already checked.
            index = text.find(stop, max(len(text) - new_char_count - len(stop) + 1, 0))
            if index != -1 and (best is None or (index, len(stop)) < best[:2]):
                best = (index, len(stop), stop)
        if best is None:
            return False
        index, length, stop = best
        self.output_text = text[: index + length] if self.include_stop_str_in_output else text[:index]
        self.stop_reason = stop
        return True

    def finish(self) -> None:
        """Call once the request ended (get_text_delta(finished=True) does it): appends what a
        trailing incomplete character left behind, as U+FFFD, so `output_text` equals a full
        decode of the tokens. Idempotent."""
        if self._flushed or self.stop_reason is not None:
            return
        self._flushed = True
        if self._read_offset < len(self._token_ids):
            self.output_text += self._without_prompt_text(self._pending_text(allow_partial=True))

    def get_text_delta(self, finished: bool) -> str:
        """Text not yet returned; while unfinished, the last max_stop_str_len - 1 characters are
        withheld because they might still turn out to be the start of a stop string."""
        finished = finished or self.stop_reason is not None
        if finished:
            self.finish()
        end = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if end <= self._sent_offset:
            return ""
        delta = self.output_text[self._sent_offset : end]
        self._sent_offset = end
        return delta
