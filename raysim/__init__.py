"""raysim: a Ray-native simulator for federated learning research at scale.

import raysim
result = raysim.run("configs/fedavg_digits.yaml", out="runs/example", overrides=["clients.lr=0.1"])
print(result.summary["final"])
record = raysim.load_run("runs/example")   # config, metrics, summary, state, .model()

Your own algorithm, aggregator, codec, model, dataset or partitioner: name it in a config as
`package.module:attr`, declared with `@raysim.plugin("algorithm")` (docs/EXTENDING.md).
"""

from raysim._version import __version__ as __version__
from raysim.api import RunRecord, load_run, run
from raysim.assembly import RunResult, resume
from raysim.config import Config
from raysim.config import load as load_config
from raysim.errors import ConfigError, DataError, RaysimError
from raysim.plugins import plugin

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "RaysimError",
    "RunRecord",
    "RunResult",
    "load_config",
    "load_run",
    "plugin",
    "resume",
    "run",
]
