"""The Ray cluster a run uses: connecting (a local Ray raysim starts, or a cluster it joins),
the dashboard URL, the one-line errors for an unreachable cluster, and what the cluster can
run (resources a client task or the server actor asks for, the GPUs they get)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import ray

from raysim.config import RuntimeConfig
from raysim.errors import RaysimError
from raysim.models.devices import task_num_gpus
from raysim.plugins import modules_to_ship

# Task results up to this size travel inline to their owner (the server actor) instead of
# through the shared-memory object store: a round of small client updates (e.g. 10 x 38 KB)
# then costs ~1 ms less. Only applied when raysim starts Ray itself.
INLINE_RESULT_BYTES = 1 << 20
# An idle worker of a Ray that raysim starts is kept for a minute. Ray's default ends the
# workers above one per CPU after 1 s idle, i.e. between rounds whenever clients ask for less
# than a CPU each (clients.num_cpus 0.5: 4 workers on 2 CPUs), and every replacement pays
# Python's and torch's imports again the next round (measured: 15 workers started instead of
# 6 for two 4-round runs, the second run 16.4 s instead of 4.1 s on a loaded 2-core machine).
IDLE_WORKER_KEEP_MS = 60_000
LOCAL_RAY_SYSTEM_CONFIG = {
    "max_direct_call_object_size": INLINE_RESULT_BYTES,
    "idle_worker_killing_time_threshold_ms": IDLE_WORKER_KEEP_MS,
}


def disconnect() -> None:
    ray.shutdown()
    _CONNECTED_HERE.clear()
    end_loopback_only()


# Set while a Ray that connect() started or joined is up: a later run of this process (compare
# and tune run many on one Ray) finds Ray initialised, and must not say someone else started it.
_CONNECTED_HERE: list[bool] = []


def end_loopback_only() -> None:
    """Undo `loopback_only`: a later Ray of this process (a cluster it joins) is not local."""
    if _RESTORE_LOCAL_ONLY:
        from ray._private import ray_constants

        previous = _RESTORE_LOCAL_ONLY.pop()
        os.environ.pop(LOCAL_ONLY_ENV, None)
        ray_constants.ENABLE_RAY_CLUSTER = previous


def connect(runtime: RuntimeConfig, address: str | None = None) -> bool:
    """Join `address` (or runtime.address), or start a local Ray. True if we started it.

    The user's plug-in modules (named by import path in the config or registered from their
    code; raysim.plugins) go to every worker of the job as `runtime_env` py_modules, on a
    local Ray and on a cluster alike. Resolve the config's plug-ins before connecting."""
    if ray.is_initialized():
        return False
    # RAY_ADDRESS is how `ray job submit` and users point drivers at a cluster: join it (a
    # cluster raysim did not start never gets raysim's _system_config).
    address = address or runtime.address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = plugin_runtime_env()
    if address:
        check_reachable(address)
        use_token_if_available()
        check_authenticated(address)
        try:
            context = ray.init(
                address=address, logging_level=logging.WARNING, runtime_env=runtime_env
            )
        except (ConnectionError, TimeoutError, RuntimeError) as error:
            if _is_auth_failure(error):
                raise RaysimError(_auth_failure(address)) from None
            if isinstance(error, RuntimeError):
                raise
            raise RaysimError(_unreachable(address, error)) from None
    else:
        loopback_only(runtime)
        try:
            context = ray.init(
                num_cpus=runtime.num_cpus,
                include_dashboard=include_dashboard(runtime),
                dashboard_host=runtime.dashboard_host,
                logging_level=logging.WARNING,
                runtime_env=runtime_env,
                _system_config=LOCAL_RAY_SYSTEM_CONFIG,
            )
        except Exception as error:
            # A Ray whose dashboard check is not the one include_dashboard reuses: one line, no
            # retry (the failed start leaves its GCS running in this process until it exits).
            if DASHBOARD_MISSING_TEXT in str(error):
                ray.shutdown()
                raise RaysimError(_dashboard_refused(error)) from None
            # Ray raises a bare Exception when its raylet does not register within its fixed
            # 30 s (a machine whose cores are all busy); anything else keeps its traceback.
            if STARTUP_TIMEOUT_TEXT not in str(error):
                raise
            ray.shutdown()  # the GCS and raylet it did start
            raise RaysimError(_startup_timeout()) from None
    _CONNECTED_HERE.append(True)
    # ray.init returns a BaseContext (a RayContext, or a ClientContext for ray://): both
    # declare dashboard_url, None or empty when no dashboard runs.
    url = context.dashboard_url
    if url:
        print(f"Ray dashboard: http://{url}", flush=True)
    check_token_file()
    return True


# What Ray's node start says when its raylet did not register with the GCS in time.
STARTUP_TIMEOUT_TEXT = "timed out during startup"
# What Ray's node start raises (after a 5-line log) when asked for a dashboard whose packages
# are missing: `pip install ray` without `[default]` (services.start_api_server).
DASHBOARD_MISSING_TEXT = "Cannot include dashboard with missing packages"
DASHBOARD_FIX = 'pip install "ray[default]"'


def dashboard_dependency_error() -> ImportError | None:
    """Why Ray cannot start its dashboard in this environment, or None where it can: Ray's
    own check (ray._private.utils.get_dashboard_dependency_error, the import of
    ray.dashboard.optional_deps: aiohttp, aiohttp_cors, grpc, opencensus, opentelemetry,
    prometheus_client, pydantic), the condition under which ray.init(include_dashboard=True)
    raises. The modules it imports are the ones Ray's start imports next anyway."""
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError:  # another Ray: the same import, made here
        try:
            import ray.dashboard.optional_deps  # noqa: F401
        except ImportError as error:
            return error
        return None
    return get_dashboard_dependency_error()


def include_dashboard(runtime: RuntimeConfig) -> bool:
    """runtime.dashboard, unless Ray's dashboard packages are missing: then Ray starts without
    it and one line says so (Ray itself would stop the run with a 20-line traceback)."""
    if not runtime.dashboard:
        return False
    error = dashboard_dependency_error()
    if error is None:
        return True
    print(
        f"raysim: notice: Ray's dashboard packages are missing ({_reason(error)}), so Ray "
        f"starts without its dashboard; {DASHBOARD_FIX} adds them "
        f"(runtime.dashboard: false skips this notice)",
        file=sys.stderr,
        flush=True,
    )
    return False


def _reason(error: BaseException) -> str:
    return " ".join(str(error).split())[:160]


def _dashboard_refused(error: BaseException) -> str:
    return (
        f"Ray could not start its dashboard ({_reason(error)}): its packages are missing or "
        f"broken; {DASHBOARD_FIX} installs them, or set runtime.dashboard: false "
        f"(--set runtime.dashboard=false) to run without it"
    )


def _startup_timeout() -> str:
    load = os.getloadavg()[0]
    return (
        "the local Ray did not start: its raylet did not register with its GCS within Ray's "
        f"fixed 30 s (load average {load:.1f} on {os.cpu_count()} cores); retry when the "
        "machine is less busy, or join a running Ray with --address"
    )


# Ray's switch for a local-only Ray (its default on macOS and Windows): the node's address is
# the loopback one, and every server Ray starts (GCS, raylet, object manager, workers, the
# dashboard agent, the runtime-env agent, the Prometheus metrics endpoints) binds to it. On
# Linux Ray binds them to the machine's routable address; `_node_ip_address="127.0.0.1"` is
# mapped back to that address (services.resolve_ip_for_localhost), and the metrics endpoints
# answered anyone with the run's name, losses and the host's process list. Ray offers no
# other setting for this.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only(runtime: RuntimeConfig) -> bool:
    """Make the Ray that raysim is about to start on this machine listen on 127.0.0.1 only,
    unless the user asked otherwise (the variable set, or a dashboard_host that is not a
    loopback address). True if it will."""
    if os.environ.get(LOCAL_ONLY_ENV) is not None:
        return os.environ[LOCAL_ONLY_ENV] == "0"
    if runtime.dashboard_host not in ("127.0.0.1", "localhost", "::1"):
        return False
    os.environ[LOCAL_ONLY_ENV] = "0"  # for Ray's processes (they read it when they start)
    from ray._private import ray_constants

    _RESTORE_LOCAL_ONLY.append(ray_constants.ENABLE_RAY_CLUSTER)
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process read it when ray was imported
    return True


_RESTORE_LOCAL_ONLY: list[bool] = []  # what disconnect() puts back


def check_token_file() -> None:
    """One line if Ray's token file (~/.ray/auth_token) can be read by others: whoever reads
    it may use the cluster (Ray writes it 0644)."""
    import stat

    path = Path.home() / ".ray" / "auth_token"
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(
            f"raysim: warning: Ray's token file {path} is readable by other users (mode "
            f"{stat.S_IMODE(mode):o}); whoever reads it may use this Ray: chmod 600 {path}",
            file=sys.stderr,
            flush=True,
        )


def _unreachable(address: str, reason: object) -> str:
    reason = " ".join(str(reason).split())[:200]
    return (
        f"cannot reach a Ray cluster at {address!r} ({reason}); start one with `ray start "
        f"--head` and pass its address (or --address auto on its head node), or leave "
        f"--address and RAY_ADDRESS unset to start a local Ray"
    )


AUTH_MODE_ENV = "RAY_AUTH_MODE"


def token_source() -> str | None:
    """Where Ray would read this machine's token from (its own order: RAY_AUTH_TOKEN, then
    the file RAY_AUTH_TOKEN_PATH names, then ~/.ray/auth_token), or None: no token here."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if named:
        return f"RAY_AUTH_TOKEN_PATH={named}" if Path(named).expanduser().is_file() else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def use_token_if_available() -> None:
    """Send this machine's token when joining a cluster, as Ray does for `ray start --head`
    and for a local cluster it finds by itself: with RAY_AUTH_MODE unset and a token present,
    token mode for this process. Ray does not do it for an explicit address (an argument or
    RAY_ADDRESS, which is how raysim joins), so a driver beside `~/.ray/auth_token` was refused.
    Harmless on a cluster without authentication (measured on Ray 2.60: it accepts a token
    it does not ask for)."""
    if os.environ.get(AUTH_MODE_ENV) is not None or token_source() is None:
        return
    os.environ[AUTH_MODE_ENV] = "token"
    try:  # Ray caches its config (the mode with it) per process: read the variable again
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # another Ray: ray.init reads the variable itself
        pass


def _gcs_address(address: str) -> str | None:
    """HOST:PORT of the cluster's GCS that `address` names, or None where it is not one
    (ray://, local, or 'auto' with no cluster to find)."""
    if address.startswith(("ray://", "local")):
        return None
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            return canonicalize_bootstrap_address("auto")
        except Exception:  # no cluster to find, or another Ray: ray.init reports it
            return None
    return address.removeprefix("gcs://")


def check_authenticated(address: str) -> None:
    """Fail at once, in one line, where the cluster refuses this machine's credentials: one
    GCS call (20 ms) instead of ray.init's 20 s of retries and its 40-line traceback. Ray's
    C++ client logs a warning line on a refusal; stderr is silenced for that call only."""
    gcs = _gcs_address(address)
    if gcs is None:
        return
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # another Ray: ray.init's own error is mapped below
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                GcsClient(address=gcs)
            except AuthenticationError:
                refused = True
            except Exception:  # anything else (e.g. a slow head): ray.init says what
                refused = False
            else:
                refused = False
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    if refused:
        raise RaysimError(_auth_failure(address))


def _is_auth_failure(error: BaseException) -> bool:
    """Whether ray.init failed because the cluster refused this machine's credentials (Ray
    wraps the AuthenticationError, or only its text, in a ConnectionError/RuntimeError)."""
    seen = 0
    while error is not None and seen < 10:
        if type(error).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(error):
            return True
        seen += 1
        error = error.__cause__ or error.__context__
    return False


def _auth_failure(address: str) -> str:
    """The one line for a refused connection, naming what is missing on this machine."""
    mode = os.environ.get(AUTH_MODE_ENV)
    source = token_source()
    fix = (
        "copy the head's ~/.ray/auth_token to this machine (chmod 600), or set RAY_AUTH_TOKEN "
        "or RAY_AUTH_TOKEN_PATH; or run every node and driver with RAY_AUTH_MODE=disabled on "
        "a trusted network (README, Running on a cluster)"
    )
    if mode is None or mode.lower() != "token":
        state = "is unset" if mode is None else f"is {mode!r}"
        if source is not None:
            return (
                f"the Ray cluster at {address!r} requires token authentication and "
                f"RAY_AUTH_MODE {state} here: set RAY_AUTH_MODE=token (the token in {source} "
                f"is then sent)"
            )
        return (
            f"the Ray cluster at {address!r} requires token authentication: RAY_AUTH_MODE "
            f"{state} and this machine has no token; set RAY_AUTH_MODE=token and {fix}"
        )
    if source is None:
        return (
            f"the Ray cluster at {address!r} requires token authentication: RAY_AUTH_MODE=token "
            f"but this machine has no token; {fix}"
        )
    return (
        f"the Ray cluster at {address!r} refused the token in {source} (not the cluster's "
        f"token); {fix}"
    )


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a cluster address nothing listens on (ray.init would retry for minutes):
    one TCP connection to HOST:PORT or ray://HOST:PORT; 'auto' is checked by ray.init."""
    import socket

    if address == "auto" or address.startswith("local"):
        return
    target = address.removeprefix("ray://").split("/")[0]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise RaysimError(f"Ray address {address!r} is not 'auto', HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as error:
        raise RaysimError(_unreachable(address, error)) from None


def alive_nodes() -> list[dict]:
    """The total resources of each live node of the cluster (ray.nodes()'s `Resources`)."""
    return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]


def client_slots(task_cpus: float) -> int:
    """How many client tasks can run at once: the cluster's CPUs (in a Tune trial, only its
    own placement group's) over a task's CPUs; at least 1."""
    cpus = ray.cluster_resources().get("CPU", 1.0)
    group = ray.util.get_current_placement_group()
    if group is not None:  # e.g. a Tune trial: only its own placement group's CPUs
        cpus = sum(bundle.get("CPU", 0.0) for bundle in group.bundle_specs)
    return max(1, int(cpus // task_cpus))


def granted_gpus(config, cluster_gpus: float) -> tuple[float | None, float | None]:
    """The GPUs the run's tasks and server actor really get, as (clients, server), None where
    the config's request stands: a request the cluster cannot meet (no GPU in it) becomes 0,
    said once here, in the driver, so that the workers use the CPU without repeating the
    notice and nothing waits forever for a GPU (raysim.core.backend.RuntimeAttachments)."""
    clients_gpus = task_num_gpus(config.clients.num_gpus, cluster_gpus)
    server_gpus = task_num_gpus(
        config.server.num_gpus,
        cluster_gpus,
        key="server.num_gpus",
        fallback="the server runs on the CPU",
    )
    return (
        None if clients_gpus == config.clients.num_gpus else clients_gpus,
        None if server_gpus == config.server.num_gpus else server_gpus,
    )


def check_resources_fit(config) -> None:
    """A client task (or the server actor) asking for more CPUs or GPUs than any node has
    would wait forever: refuse it in one line. (No GPU at all: they fall back to the CPU,
    with a notice.)"""
    clients = config.clients
    nodes = alive_nodes()
    if not nodes:
        return
    most_cpus = max(n.get("CPU", 0.0) for n in nodes)
    if clients.num_cpus > most_cpus:
        raise RaysimError(
            f"clients.num_cpus={clients.num_cpus:g} but the largest node of the Ray cluster has "
            f"{most_cpus:g} CPUs: a client task could never start; lower clients.num_cpus"
        )
    most_gpus = max(n.get("GPU", 0.0) for n in nodes)
    if most_gpus and clients.num_gpus > most_gpus:
        raise RaysimError(
            f"clients.num_gpus={clients.num_gpus:g} but the largest node of the Ray cluster has "
            f"{most_gpus:g} GPUs: a client task could never start; lower clients.num_gpus"
        )
    if most_gpus and config.server.num_gpus > most_gpus:
        raise RaysimError(
            f"server.num_gpus={config.server.num_gpus:g} but the largest node of the Ray cluster "
            f"has {most_gpus:g} GPUs: the server could never start; lower server.num_gpus"
        )


def plugin_runtime_env() -> dict | None:
    """The job runtime_env that brings the user's plug-in modules to every worker of a Ray that
    raysim starts or joins (None: no user modules)."""
    user_modules = modules_to_ship()
    if not user_modules:
        return None
    print(f"raysim: sending plug-in code to the workers: {', '.join(user_modules)}", flush=True)
    return {"py_modules": user_modules}


def ship_plugins_by_value() -> None:
    """Ray was started by someone else (a notebook's ray.init, a test session), so the job's
    runtime_env is not raysim's to set: the user's plug-in modules are pickled by value
    instead, inside the objects the workers receive (the run context carries every plug-in
    the driver resolved, raysim.registry.snapshot)."""
    from ray import cloudpickle

    names = [
        Path(path).stem if path.endswith(".py") else Path(path).name for path in modules_to_ship()
    ]
    for name in names:
        cloudpickle.register_pickle_by_value(sys.modules[name])
    if names:
        why = (
            "one Ray serves this process's runs"
            if _CONNECTED_HERE
            else "Ray was started outside raysim"
        )
        print(f"raysim: {why}; sending plug-in modules by value: {', '.join(names)}", flush=True)
