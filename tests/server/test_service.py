"""The servicer's helpers that need no server: a refusal's status message cut to what gRPC can send."""

from __future__ import annotations

from urllib.parse import quote

from asyncspec.server.service import short_status_message


def _percent_encoded_size(message: str) -> int:
    """The size gRPC sends a status message at: printable ASCII but '%' as is, every other byte as %XX."""
    return len(quote(message, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")))


def test_a_status_message_fits_its_byte_budget_once_percent_encoded():
    short = "request_id 'abc' is already in use"
    assert short_status_message(short, 64) == short
    for message in ("x" * 10_000, "€" * 3000, "100% " * 2000, "ü" + "a" * 5000):
        cut = short_status_message(message, 4096)
        assert cut.endswith(f"... ({len(message)} characters)")
        assert _percent_encoded_size(cut) <= 4096 + 64
        assert message.startswith(cut[: cut.rindex("... (")])
