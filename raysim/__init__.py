"""raysim: a Ray-native simulator for federated learning research at scale.

import raysim
config = raysim.load_config("configs/fedavg_digits.yaml", ["clients.lr=0.1"])
result = raysim.run(config, "runs/example")
print(result.summary["final"])
"""

from raysim.config import Config
from raysim.config import load as load_config
from raysim.core.loop import RunResult, resume, run
from raysim.errors import ConfigError, DataError, RaysimError

__version__ = "0.1.0"
__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "RaysimError",
    "RunResult",
    "load_config",
    "resume",
    "run",
]
