"""The 0/1 environment switches the layers read."""

from __future__ import annotations

import pytest

from asyncspec.layers.switches import on_off_switch

NAME = "ASYNCSPEC_TEST_SWITCH"


class SwitchError(ValueError):
    pass


@pytest.mark.parametrize("default", [False, True])
def test_unset_gives_the_default_and_0_1_override_it(monkeypatch, default: bool) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert on_off_switch(NAME, default=default, error=SwitchError) is default
    for value, expected in (("0", False), (" 1 ", True), ("1", True), ("0\n", False)):
        monkeypatch.setenv(NAME, value)
        assert on_off_switch(NAME, default=default, error=SwitchError) is expected


@pytest.mark.parametrize(
    ("default", "hint"), [(False, "0 (off, the default) or 1 (on)"), (True, "1 (on, the default)")]
)
@pytest.mark.parametrize("value", ["yes", "true", "2", ""])
def test_other_values_raise_the_callers_error_naming_the_variable(monkeypatch, default, hint, value) -> None:
    monkeypatch.setenv(NAME, value)
    with pytest.raises(
        SwitchError, match=rf"{NAME}='{value}': set it to {hint}".replace("(", r"\(").replace(")", r"\)")
    ):
        on_off_switch(NAME, default=default, error=SwitchError)
