"""Exception types raysim raises for bad input.

Every error a user can cause (config, data file, client update) is one of these, with a message
that names the key, file or line and says what was expected. The CLI prints the message as one
line and exits with status 2 instead of showing a traceback from deep inside a library.
"""

from __future__ import annotations

import difflib


class RaysimError(Exception):
    """Base class for errors caused by the user's input rather than by a bug in raysim.

    The message is always one line: line breaks inside it (e.g. from a key or file content
    the user wrote) are shown escaped, so a message never spans several lines of a log.
    """

    def __init__(self, message: object = "", *args: object) -> None:
        text = str(message).strip("\n")
        super().__init__(text.replace("\r", "\\r").replace("\n", "\\n"), *args)


class ConfigError(RaysimError):
    """A config key, value or plug-in name is invalid."""


class DataError(RaysimError):
    """A dataset is missing or a data file is malformed."""


def closest(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """' (did you mean X?)' when one valid choice is close to `name`, else ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
