"""Environment switches that the layers read when a model is set up."""

from __future__ import annotations

import os


def on_off_switch(name: str, *, default: bool, error: type[ValueError]) -> bool:
    """The 0/1 environment switch `name`: unset gives `default`, 1 is on, 0 is off; any other value raises `error`
    with a message naming the variable and the values it takes."""
    value = os.environ.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        values = "1 (on, the default) or 0 (off)" if default else "0 (off, the default) or 1 (on)"
        raise error(f"{name}={value!r}: set it to {values}")
    return value == "1"
