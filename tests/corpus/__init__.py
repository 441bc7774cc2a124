"""The hostile-input corpus: small files and messages a clumsy or hostile user could give raysim.

Each module here (loaders.py, numbers.py, runs.py, ...) defines `CASES`, a list of `Case`. A
case writes its input under an empty folder and feeds it to raysim the way a user would (a
loader, `config.load`, `load_checkpoint`, a client message to the server). It must end in one of
two ways:
  - raysim raises a RaysimError (ConfigError, DataError, ...): one clear line, or
  - raysim refuses the input cleanly and carries on; `run` returns that refusal's line (e.g.
    the rejection line the server logged for a bad client update).
Anything else (another exception, a hang, a multi-line message, memory beyond the bound) is a
defect; tests/test_hostile_corpus.py runs every case in a forked child with a time limit and
measures the child's peak RSS. A module may define `warm()`, which the runner calls once
before forking, to make what its cases share (a dataset, a template run folder); it must not
run torch computations in the runner's process (a child forked after OpenMP started its threads
hangs), so anything trained is made in a subprocess or in the case itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    name: str  # unique across the corpus, e.g. "cifar/pickle-codecs-bomb"
    # Given an empty folder: write the input there and feed it to raysim. Raise the RaysimError
    # raysim raises, or return the line with which raysim refused the input and carried on.
    run: Callable[[Path], str]
    timeout_s: float = 30.0
