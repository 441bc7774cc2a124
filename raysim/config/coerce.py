"""One value of a config key checked against its field's annotation (`int | None`,
`float`, `int | str`, `tuple[int, ...]`, `Mapping[...]`): the value, coerced, or a ConfigError
naming the key. Annotations are the strings `from __future__ import annotations` leaves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raysim.errors import ConfigError

_SCALAR_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "None": type(None)}


def _coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Check `value` against a field annotation such as 'int | None' or 'int | str'."""
    if str(annotation).startswith("Mapping"):  # free-form options (e.g. index.options)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{source}: '{key}' expects a mapping of names to values")
        return dict(value)
    if str(annotation) == "tuple[int, ...]":  # a list of whole numbers (run.eval_at)
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{source}: '{key}' expects a list of whole numbers, got {value!r}")
        return tuple(sorted(set(value)))
    allowed = [_SCALAR_TYPES[t.strip()] for t in str(annotation).split("|")]
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(f"{source}: '{key}' expects {annotation}, got {value!r}")
    if int in allowed and isinstance(value, int):
        return value
    if float in allowed and isinstance(value, int | float):
        return float(value)
    if str in allowed and isinstance(value, str):
        return value
    if bool in allowed and isinstance(value, bool):
        return value
    raise ConfigError(f"{source}: '{key}' expects {annotation}, got {value!r}")
