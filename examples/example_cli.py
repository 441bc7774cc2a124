"""Command-line helpers shared by the examples (imported from their own folder)."""

from __future__ import annotations

import sys
from collections.abc import Mapping


def old_method_form(argv: list[str], method_keys: Mapping[str, str], program: str) -> list[str]:
    """The comma form with display names (`--methods FedAwS,Baseline-2`), accepted for one
    more release so that existing command lines keep working: values after --methods are split
    on commas and display names (the values of `method_keys`) become their keys, before
    argparse checks the choices."""
    display = {name.lower(): key for key, name in method_keys.items()}
    result, in_methods, rewritten = [], False, False
    for token in argv:
        if token.startswith("--methods="):
            result.append("--methods")
            token, in_methods = token.split("=", 1)[1], True
        elif token.startswith("-"):
            result.append(token)
            in_methods = token == "--methods"
            continue
        if not in_methods:
            result.append(token)
            continue
        for value in (v.strip() for v in token.split(",")):
            if value:
                key = display.get(value.lower(), value)
                rewritten |= key != value or "," in token
                result.append(key)
    if rewritten:
        print(
            f"{program}: --methods with commas or display names is the old form; "
            f"use space-separated keys: --methods {' '.join(method_keys)}",
            file=sys.stderr,
        )
    return result
