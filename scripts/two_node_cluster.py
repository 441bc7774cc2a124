"""A two-node Ray cluster on this one machine, a raysim run on it, and a clean teardown.

    python scripts/two_node_cluster.py [--config configs/fedavg_digits.yaml] [--rounds 5]

What it does, as a user would on two machines (README, Running on a cluster):
  1. with token authentication on (RAY_AUTH_MODE=token for every process, the cluster's own
     token file named by RAY_AUTH_TOKEN_PATH), `ray start --head --num-cpus 1 ...` (node A),
     then `ray start --address HEAD --num-cpus 1` (node B), each with its own temp dir and its
     own ports (two raylets can share one host only if none of their ports collide);
  2. `raysim run CONFIG --address auto` with RAY_ADDRESS pointing at the head (so `auto` finds
     this cluster and never another Ray on the machine), two client tasks a round;
  3. prints how many client tasks ran on each node (summary.json's `task_nodes`);
  4. stops exactly the processes of these two nodes: each `ray start --block` runs in its own
     session, so SIGTERM to its process group, then SIGKILL to anything left whose command
     line names this cluster's temp dir. Never `ray stop`, which stops every Ray on the host.

Exit status 0 when client tasks ran on both nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


# Every port this process has handed to a node: two nodes share one host, so no port (nor a
# node's worker port range) may be handed out twice.
_HANDED_OUT: set[int] = set()


def free_ports(count: int) -> list[int]:
    """Ports free right now (bound to 0 and released; a small race is acceptable here) and
    not handed out before."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            port = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    _HANDED_OUT.update(ports)
    return ports


def _bindable(port: int) -> bool:
    with contextlib.closing(socket.socket()) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(width: int) -> int:
    """The first of `width` + 1 consecutive ports, each free right now and none handed out
    before (a node's worker ports: a range that held, say, the node manager's port made
    `ray start` refuse the node)."""
    for _ in range(200):
        low = free_ports(1)[0]
        span = range(low, low + width + 1)
        if span[-1] <= 65535 and not _HANDED_OUT.intersection(span[1:]):
            if all(_bindable(port) for port in span[1:]):
                _HANDED_OUT.update(span)
                return low
    raise RuntimeError(f"no run of {width + 1} free ports found")


@dataclass
class LocalCluster:
    root: Path  # every file of both nodes lives under here
    address: str = ""  # head's GCS address host:port
    processes: list[subprocess.Popen] = field(default_factory=list)
    metrics_ports: list[int] = field(default_factory=list)
    client_port: int = 0  # the head's Ray Client server: ray://127.0.0.1:client_port
    dashboard_port: int = 0  # the head's dashboard (job submission), when started with one

    def auth_env(self) -> dict[str, str]:
        """Token authentication on, as the README's cluster section sets it on every machine
        (RAY_AUTH_MODE=token and the cluster's token). The token is this cluster's own file,
        named by RAY_AUTH_TOKEN_PATH: on one host, ~/.ray/auth_token is every other Ray's too."""
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        env.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the file
        return env

    @property
    def token_path(self) -> Path:
        return self.root / "auth_token"

    def env(self) -> dict[str, str]:
        """Environment of a driver that must join this cluster with `--address auto`."""
        return dict(self.auth_env(), RAY_ADDRESS=self.address)


def write_token(path: Path) -> None:
    """A new random token, readable by its owner only (what `ray get-auth-token --generate`
    writes to ~/.ray/auth_token)."""
    import secrets

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(32))


def _node_command(
    head: bool,
    temp_dir: Path,
    address: str,
    gcs_port: int,
    num_cpus: int,
    dashboard_port: int = 0,
) -> tuple[list[str], int, int]:
    node_manager, object_manager, agent_listen, agent_grpc, metrics, runtime_env, client = (
        free_ports(7)
    )
    worker_low = free_port_range(40)
    command = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--disable-usage-stats",
        f"--num-cpus={num_cpus}",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--dashboard-agent-listen-port={agent_listen}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        # a port range of this node's own for its workers (the default range is shared)
        f"--min-worker-port={worker_low}",
        f"--max-worker-port={worker_low + 40}",
        "--object-store-memory=200000000",
    ]
    if head:
        command += [
            "--head",
            f"--port={gcs_port}",
            f"--ray-client-server-port={client}",
            # the dashboard only when asked for: `ray job submit` talks to it
            *(
                [
                    "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dashboard_port}",
                ]
                if dashboard_port
                else ["--include-dashboard=false"]
            ),  # fmt: skip
            # export custom metrics every second (default 10 s) so a short run shows them
            '--system-config={"metrics_report_interval_ms": 1000}',
        ]
    else:
        command += [f"--address={address}"]
    return command, metrics, client


def _start_node(cluster: LocalCluster, name: str, head: bool, gcs_port: int) -> None:
    temp_dir = cluster.root / name
    temp_dir.mkdir(parents=True)
    command, metrics, client = _node_command(
        head, temp_dir, cluster.address, gcs_port, num_cpus=1, dashboard_port=cluster.dashboard_port
    )
    if head:
        cluster.client_port = client
    log = open(cluster.root / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    env = dict(cluster.auth_env(), RAY_ADDRESS="")
    # Own session: the node's processes form one process group that teardown can signal.
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    cluster.processes.append(process)
    cluster.metrics_ports.append(metrics)


def _wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited ({process.returncode}):\n{log.read_text()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.3)
    raise TimeoutError(f"the head's GCS port {port} did not open in {timeout:.0f} s")


def alive_nodes(address: str, env: dict[str, str]) -> list[dict]:
    """The cluster's live nodes (a short-lived driver in a subprocess)."""
    script = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR');"
        "print(json.dumps([{'id': n['NodeID'], 'port': n['NodeManagerPort']}"
        " for n in ray.nodes() if n['Alive']]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, RAY_ADDRESS=""),
    )
    if result.returncode != 0:
        raise RuntimeError(f"cannot list nodes: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def two_node_cluster(timeout: float = 120, dashboard: bool = False) -> Iterator[LocalCluster]:
    """Start head + one worker node (1 CPU each) on this host; always tear both down.
    `dashboard`: the head also runs Ray's dashboard, for `ray job submit`."""
    # A short root: Ray's unix socket paths must stay under ~107 characters.
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="rs2n-", dir="/tmp")))
    if dashboard:
        cluster.dashboard_port = free_ports(1)[0]
    try:
        write_token(cluster.token_path)
        gcs_port = free_ports(1)[0]
        cluster.address = f"127.0.0.1:{gcs_port}"
        _start_node(cluster, "head", head=True, gcs_port=gcs_port)
        _wait_for_port(gcs_port, cluster.processes[0], cluster.root / "head.log", timeout)
        _start_node(cluster, "worker", head=False, gcs_port=gcs_port)
        # `ray start` says so once its raylet has registered with the head's GCS.
        log = cluster.root / "worker.log"
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in log.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError("the worker node did not join in time")
            if cluster.processes[1].poll() is not None:
                raise RuntimeError(f"worker node failed:\n{log.read_text()}")
            time.sleep(0.3)
        yield cluster
    finally:
        stop(cluster)


def stop(cluster: LocalCluster, grace: float = 3) -> None:
    """Stop this cluster's processes only, then delete its files.

    SIGTERM first; `ray start --block` of the head does not always exit on it (measured: still
    running 30 s later), so after `grace` seconds the rest of each node's group gets SIGKILL.
    """
    for process in reversed(cluster.processes):  # worker node first
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in cluster.processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
    for process in cluster.processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    _kill_leftovers(str(cluster.root))
    shutil.rmtree(cluster.root, ignore_errors=True)


def _kill_leftovers(marker: str, rounds: int = 5) -> None:
    """SIGKILL processes whose command line names this cluster's temp dir (e.g. a worker that
    left the process group, or one a runtime_env started late) and wait until they are gone;
    only ever ours: the dir is unique to this cluster. A few rounds, since a dying node may
    still have started one more process."""
    import psutil

    me = os.getpid()
    for _ in range(rounds):
        killed = []
        for process in psutil.process_iter(["pid", "cmdline"]):
            try:
                if process.info["pid"] != me and marker in " ".join(process.info["cmdline"] or []):
                    process.kill()
                    killed.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if not killed:
            return
        psutil.wait_procs(killed, timeout=5)


def leftover_processes(marker: str) -> list[int]:
    """Pids of processes still naming `marker` on their command line (for tests)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if marker in " ".join(process.info["cmdline"] or []):
                found.append(process.info["pid"])
    return found


def scrape_metrics(port: int) -> str:
    """A node's Prometheus metrics page ('' if unreachable)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            return page.read().decode()
    except OSError:
        return ""


def submit_job(
    cluster: LocalCluster, working_dir: Path, entrypoint: list[str], timeout: float = 600
) -> str:
    """`ray job submit --working-dir DIR -- ENTRYPOINT` against the head's dashboard; returns
    the job's output (the command waits for the job to end; a failed job raises)."""
    if not cluster.dashboard_port:
        raise RuntimeError("start the cluster with dashboard=True to submit jobs")
    command = [
        sys.executable, "-m", "ray.scripts.scripts", "job", "submit",
        f"--address=http://127.0.0.1:{cluster.dashboard_port}",
        f"--working-dir={working_dir}", "--", *entrypoint,
    ]  # fmt: skip
    result = subprocess.run(
        command, env=cluster.env(), capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:  # `ray job submit` exits non-zero when the job fails
        raise RuntimeError(f"ray job submit failed:\n{output[-3000:]}")
    return output


def run_on_cluster(
    cluster: LocalCluster,
    config: str,
    out: Path,
    rounds: int,
    extra: list[str] = (),
    address: str | None = "auto",
    cwd: Path = REPO_ROOT,
) -> tuple[dict, str]:
    """`raysim run CONFIG --address auto` (or another address) on the cluster, run in `cwd`
    (e.g. a folder of the user's own plug-ins); returns summary.json and the run's output
    (stdout + stderr)."""
    command = [
        sys.executable,
        "-m",
        "raysim.cli",
        "run",
        config,
        "--out",
        str(out),
        *(["--address", address] if address is not None else []),  # None: RAY_ADDRESS only
        "--no-progress",
        "--set",
        f"run.rounds={rounds}",
        "--set",
        "clients.per_task=5",  # 10 clients a round -> 2 tasks of 1 CPU: one per node
        *extra,
    ]
    result = subprocess.run(
        command, cwd=cwd, env=cluster.env(), capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise RuntimeError(f"raysim run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(result.stdout.strip())
    return json.loads((out / "summary.json").read_text()), result.stdout + result.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "fedavg_digits.yaml"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--ray-client", action="store_true", help="join with ray://HEAD:PORT instead of auto"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with two_node_cluster() as cluster:
        nodes = alive_nodes(cluster.address, cluster.auth_env())
        print(f"cluster at {cluster.address}: {len(nodes)} nodes, files in {cluster.root}")
        address = f"ray://127.0.0.1:{cluster.client_port}" if args.ray_client else "auto"
        print(f"raysim run --address {address}")
        summary, _ = run_on_cluster(
            cluster, args.config, cluster.root / "run", args.rounds, address=address
        )
        roles = {node["id"]: f"node manager port {node['port']}" for node in nodes}
        tasks = summary["task_nodes"] or {}
        for node_id, count in sorted(tasks.items()):
            print(f"  {node_id[:12]}  ({roles.get(node_id, '?')}): {count} client tasks")
        metrics = "".join(scrape_metrics(port) for port in cluster.metrics_ports)
        exported = [
            line
            for line in metrics.splitlines()
            if line.startswith("ray_raysim_") and not line.startswith("#")
        ]
        print("Ray custom metrics:", *exported or ["(not exported yet)"], sep="\n  ")
        both = len(tasks) == 2 and set(tasks) == set(roles)
    print(
        f"client tasks on both nodes: {both}; accuracy {summary['final'].get('accuracy')}; "
        f"{time.perf_counter() - started:.1f} s including cluster start and stop"
    )
    return 0 if both else 1


if __name__ == "__main__":
    sys.exit(main())
