"""Name -> lazy factory, one registry per kind of plug-in.

Factories are registered as "module:attribute" strings so that heavy optional libraries
(torchvision, faiss, kmodes) are imported only when a config actually chooses them. A factory's
keyword-only parameters are its options: config sections such as `model:` or `algorithm:` pass
every key except `name` to the factory, and unknown keys are rejected before anything runs.

A config may also name a plug-in by import path, `package.module:attr`, without registering it:
the module is imported from the directory raysim runs in or from PYTHONPATH, and the object must
declare itself a plug-in of that kind with `@raysim.plugin(kind)` (raysim.plugins: a config
never reaches an arbitrary callable). What `register` is given is trusted: the process's own
code registered it.
Plug-ins registered from a user's own code (`raysim.registry.algorithms.register(...)`) travel
with the run (`snapshot` / `install`), so Ray workers know them too.
"""

from __future__ import annotations

import importlib
import inspect
import keyword
import math
from collections.abc import Callable, Mapping
from typing import Any

from raysim.errors import ConfigError, closest
from raysim.plugins import is_import_path, remember_callable, resolve_import_path


class Registry:
    """Maps plug-in names of one kind (e.g. 'model') to lazily imported factories."""

    def __init__(self, kind: str, adapt: str | None = None) -> None:
        self.kind = kind
        # "module:function" applied to everything `build` makes: a plug-in that need not
        # subclass raysim's base class is wrapped once, where it is built (codecs: as_codec).
        self._adapt = adapt
        self._targets: dict[str, str | Callable[..., Any]] = {}
        self._builtin: set[str] = set()  # names registered by raysim itself
        self._imported: dict[str, Callable[..., Any]] = {}  # import-path names resolved so far

    def register(self, name: str, target: str | Callable[..., Any]) -> None:
        """Add a plug-in under `name`: a factory, or its "module:attr" path (imported lazily).

        Names registered from a user's code are sent to every Ray worker of a run."""
        if name in self._targets:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        if is_import_path(name):
            raise ValueError(
                f"{self.kind} name '{name}' contains ':'; names with ':' are import paths"
            )
        self._targets[name] = target
        if _registering_builtins:
            self._builtin.add(name)
        elif callable(target):
            remember_callable(target)  # its module goes to the Ray workers of a run

    def unregister(self, name: str) -> None:
        """Remove a plug-in registered from user code (tests, notebooks re-running a cell)."""
        if name in self._builtin:
            raise ValueError(f"{self.kind} '{name}' is built in and cannot be unregistered")
        self._targets.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._targets)

    def __contains__(self, name: str) -> bool:
        return name in self._targets or is_import_path(name)

    def get(self, name: str) -> Callable[..., Any]:
        """The factory called `name`: a registered name or a `package.module:attr` path."""
        if name not in self._targets:
            if is_import_path(name):
                if name not in self._imported:
                    self._imported[name] = resolve_import_path(name, self.kind)
                return self._imported[name]
            raise ConfigError(
                f"unknown {self.kind} '{name}'{closest(name, self.names())}; "
                f"choices: {', '.join(self.names())} (or 'package.module:attr' of your own)"
            )
        target = self._targets[name]
        if isinstance(target, str):
            if name in self._builtin:
                module_name, attribute = target.split(":")
                target = getattr(importlib.import_module(module_name), attribute)
            else:  # registered by the user's own code as a path: trusted, as a callable is
                target = resolve_import_path(target, self.kind, trusted=True)
            self._targets[name] = target
        return target

    def user_entries(self) -> dict[str, str | Callable[..., Any]]:
        """The entries registered from user code (not raysim's own) and the import paths
        resolved so far, name -> target."""
        entries = {n: t for n, t in self._targets.items() if n not in self._builtin}
        return {**entries, **self._imported}

    def option_names(self, name: str) -> list[str]:
        """The keyword-only parameters of the factory: the options a config may set."""
        signature = inspect.signature(self.get(name))
        return [
            p.name
            for p in signature.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]

    def check_options(self, name: str, options: Mapping[str, Any], where: str) -> dict[str, Any]:
        """Reject unknown options and values of the wrong type; returns the coerced options.

        Types come from the factory's annotations (`float`, `int | None`, `Sequence[int]`, ...);
        ints are accepted for floats, booleans only where a bool is expected.
        """
        parameters = {
            p.name: p
            for p in inspect.signature(self.get(name)).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        checked = {}
        for key, value in options.items():
            if key not in parameters and _python_name(key) in parameters:
                checked[key] = _check_value(parameters[_python_name(key)], value, f"{where}.{key}")
                continue
            if key not in parameters:
                valid = list(parameters)
                raise ConfigError(
                    f"unknown option '{where}.{key}' for {self.kind} '{name}'"
                    f"{closest(key, valid)}; valid options: {', '.join(valid) or '(none)'}"
                )
            checked[key] = _check_value(parameters[key], value, f"{where}.{key}")
        return checked

    def check_option_values(
        self, name: str, options: Mapping[str, Any], where: str
    ) -> dict[str, Any]:
        """`check_options`, then the factory's own `check_options(**options)` attribute if it
        carries one: checks of values that are wrong whatever the data (a partitioner's
        `alpha > 0`), run when the config is read. Returns the coerced options."""
        checked = self.check_options(name, options, where)
        check = getattr(self.get(name), "check_options", None)
        if callable(check):
            check(**checked)
        return checked

    def build(self, name: str, *args: Any, **options: Any) -> Any:
        built = self.get(name)(*args, **{_python_name(k): v for k, v in options.items()})
        if self._adapt is None:
            return built
        module_name, _, attribute = self._adapt.partition(":")
        return getattr(importlib.import_module(module_name), attribute)(built)


def _python_name(key: str) -> str:
    """Option keys that are Python keywords (FedAwS's `lambda`) map to `key_` parameters."""
    return f"{key}_" if keyword.iskeyword(key) else key


def _check_value(parameter: inspect.Parameter, value: Any, key: str) -> Any:
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return value
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    allowed = {part.strip().split("[")[0] for part in str(text).split("|")}
    if value is None and "None" in allowed:
        return None
    if isinstance(value, bool):
        if "bool" in allowed:
            return value
    elif "int" in allowed and isinstance(value, int):
        return value
    elif "float" in allowed and isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigError(f"'{key}' expects a finite number, got {value!r}")
        return float(value)
    elif "str" in allowed and isinstance(value, str):
        return value
    elif allowed & {"Sequence", "tuple", "list"} and isinstance(value, list | tuple):
        _check_items(str(text), value, key)
        return list(value)
    if not allowed & {"bool", "int", "float", "str", "None", "Sequence", "tuple", "list"}:
        return value  # an annotation we do not check; the factory validates it
    raise ConfigError(f"'{key}' expects {text}, got {value!r}")


def _check_items(annotation: str, items: list | tuple, key: str) -> None:
    """Items of a `Sequence[int]` / `list[float]` / `Sequence[str]` option have that type."""
    inner = annotation.partition("[")[2].rpartition("]")[0].split(",")[0].strip()
    for item in items:
        if inner == "int":
            valid = isinstance(item, int) and not isinstance(item, bool)
        elif inner == "float":
            valid = isinstance(item, int | float) and not isinstance(item, bool)
            valid = valid and math.isfinite(item)
        elif inner == "str":
            valid = isinstance(item, str)
        else:
            return  # an item type we do not check; the factory validates it
        if not valid:
            raise ConfigError(f"'{key}' expects {annotation}, got {list(items)!r}")


def snapshot() -> dict[str, dict[str, Any]]:
    """Every plug-in registered from user code, by kind: what a Ray worker needs to resolve the
    run's names as the driver does. Factories pickle by reference (their module is shipped with
    the run, raysim.plugins.modules_to_ship) or, defined in a script's __main__, by value."""
    return {reg.kind: entries for reg in _ALL if (entries := reg.user_entries())}


def install(entries: Mapping[str, Mapping[str, Any]] | None) -> None:
    """Register a `snapshot()` taken in another process (names already known are kept)."""
    for reg in _ALL:
        for name, target in (entries or {}).get(reg.kind, {}).items():
            if is_import_path(name):
                reg._imported.setdefault(name, target)  # resolved in the driver already
            elif name not in reg._targets:
                reg._targets[name] = target


_registering_builtins = True
datasets = Registry("dataset")
partitioners = Registry("partitioner")
models = Registry("model")
algorithms = Registry("algorithm")
aggregators = Registry("aggregator")
server_optimizers = Registry("server optimizer")
attacks = Registry("attack")
indexes = Registry("index")
codecs = Registry("codec", adapt="raysim.core.codecs:as_codec")
backends = Registry("backend")
_ALL = (
    datasets,
    partitioners,
    models,
    algorithms,
    aggregators,
    server_optimizers,
    attacks,
    indexes,
    codecs,
    backends,
)

# --- built-in plug-ins -------------------------------------------------------------------------
for _name in ("digits", "synthetic_classification"):
    datasets.register(_name, f"raysim.data.embedded:load_{_name}")
datasets.register("mnist", "raysim.data.idx:load_mnist")
for _name in ("cifar10", "cifar100"):
    datasets.register(_name, f"raysim.data.cifar:load_{_name}")
datasets.register("femnist", "raysim.data.femnist:load_femnist")
datasets.register("extreme_classification", "raysim.data.xc_datasets:load_extreme_classification")
datasets.register("synthetic_xml", "raysim.data.synthetic_xml:load_synthetic_xml")
# Real data from package managers (Debian, PyPI wheels): raysim.data.offline
for _name in ("fashion_mnist", "mnist_5k", "yeast"):
    datasets.register(_name, f"raysim.data.offline:load_{_name}")
for _name in ("iid", "dirichlet", "shards", "one_class", "natural", "kmodes", "random"):
    partitioners.register(_name, f"raysim.data.partition:{_name}")
for _name in ("mlp", "lenet", "conv2", "conv4", "conv6", "conv8"):
    models.register(_name, f"raysim.models.classic:{_name}")
for _name in ("xml_embedding_bag", "resnet8", "resnet32", "resnet56", "mlp_embedding"):
    models.register(_name, f"raysim.models.embedding:{_name}")
algorithms.register("fedavg", "raysim.algorithms.fedavg:FedAvg")
algorithms.register("fedprox", "raysim.algorithms.fedavg:FedProx")
algorithms.register("signsgd", "raysim.algorithms.signsgd:SignSGD")
algorithms.register("topk", "raysim.algorithms.topk:TopK")
algorithms.register("frl", "raysim.algorithms.frl:FRL")
algorithms.register("fedaws", "raysim.algorithms.fedaws:FedAwS")
algorithms.register("fedaws_softmax", "raysim.algorithms.fedaws_softmax:FedAwSSoftmax")
aggregators.register("mean", "raysim.core.aggregators:Mean")
aggregators.register("weighted_mean", "raysim.core.aggregators:WeightedMean")
aggregators.register("sum", "raysim.core.aggregators:Sum")
aggregators.register("trimmed_mean", "raysim.core.robust:TrimmedMean")
aggregators.register("median", "raysim.core.robust:Median")
aggregators.register("multi_krum", "raysim.core.robust:MultiKrum")
attacks.register("none", "raysim.attacks:no_attack")
attacks.register("frl_reversal", "raysim.attacks.frl_reversal:FRLReversal")
attacks.register("agr_tailored", "raysim.attacks.agr_tailored:AGRTailored")
attacks.register("sign_flip", "raysim.attacks.sign_flip:SignFlip")
attacks.register("naive_scaling", "raysim.attacks.naive_scaling:NaiveScaling")
for _name in ("sgd", "adagrad", "adam"):
    server_optimizers.register(_name, f"raysim.core.server_optimizers:{_name}")

# --- multi-label (FLAG + CMDA) --------------------------------------------------------------------
datasets.register("synthetic_multilabel", "raysim.data.multilabel:load_synthetic_multilabel")
datasets.register("arff", "raysim.data.arff:load_arff")
datasets.register("coco", "raysim.data.coco:load_coco")
datasets.register("xc_multilabel", "raysim.data.xc_datasets:load_xc_multilabel")
models.register("mlp_bn", "raysim.models.multilabel:mlp_bn")
algorithms.register("flag", "raysim.algorithms.flag:FLAG")
algorithms.register("multilabel_fedavg", "raysim.algorithms.flag:MultiLabelAveraging")
algorithms.register("multilabel_fedprox", "raysim.algorithms.flag:MultiLabelFedProx")
algorithms.register("local_only", "raysim.algorithms.personalized:LocalOnly")
algorithms.register("personal_bn", "raysim.algorithms.personalized:PersonalBN")
algorithms.register("personal_classifier", "raysim.algorithms.personalized:PersonalClassifier")
algorithms.register("per_fedavg", "raysim.algorithms.personalized:PerFedAvg")
aggregators.register("label_weighted", "raysim.algorithms.flag:LabelWeightedMean")
indexes.register("exact", "raysim.index.exact:ExactIndex")
indexes.register("faiss_ivf", "raysim.index.faiss_ivf:FaissIVFIndex")
indexes.register("hnsw", "raysim.index.hnsw:HNSWIndex")
for _name in ("dense", "signs", "topk", "ranks"):
    codecs.register(_name, f"raysim.core.codecs:{_name}")
backends.register("local", "raysim.runtime.local:LocalBackend")
backends.register("ray", "raysim.runtime.ray_backend:RayBackend")
_registering_builtins = False
