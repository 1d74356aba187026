"""Environment knobs read by the Python side of fp8attn (the table of every knob,
C++ ones included, is in docs/architecture.md, "Environment variables").

A knob that is unset or empty takes its default; any other value must be one of
the accepted values, else ValueError naming the variable and what it accepts
(a misspelt value must never silently select the default). Values are read at
the call that uses them, not at import, so a bad value fails there and a test
can set the variable with monkeypatch.setenv.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence


def choice(name: str, accepted: Sequence[str], default: Optional[str] = None) -> Optional[str]:
    """os.environ[name] if it is one of `accepted`; `default` if unset or empty.
    Raises ValueError naming `name` and the accepted values otherwise."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in accepted:
        raise ValueError(f"fp8attn: environment variable {name}={value!r} is not one of "
                         f"{', '.join(accepted)} (or unset / empty for the default"
                         f"{'' if default is None else ', ' + default})")
    return value


def flag(name: str, default: bool) -> bool:
    """A 0/1 knob: True for "1", False for "0", `default` if unset or empty;
    ValueError for anything else (e.g. "true", "yes", "off")."""
    return choice(name, ("0", "1"), "1" if default else "0") == "1"
