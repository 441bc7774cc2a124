"""Flower (`flwr`, ~1.42) running the workload in its Simulation Runtime, in-process.

Driven as Flower's quickstart drives a simulation: `flwr.simulation.run_simulation(server_app,
client_app, num_supernodes=N)`, one SuperNode per client. The ServerApp's main runs the
message-API strategy `flwr.serverapp.strategy.FedAvg` (`strategy.start(grid, initial_arrays,
num_rounds)`, replies averaged weighted by "num-examples", no federated evaluation:
fraction_evaluate 0); the ClientApp's `@train` handler loads the arrays into the model, runs the
local SGD (common.local_sgd: Flower has no training loop of its own, the user writes it) and
replies with the new arrays and the sample count.

What Flower does not ship and this worker adds:
- An in-process backend. The Simulation Runtime (LinkState, message store, the node queues and
  worker threads of flwr.server.superlink.fleet.vce, the ServerApp thread and its InMemoryGrid)
  runs every ClientApp call on a `Backend`; Flower's only one is the Ray backend (its
  SimpleBackend proposal, flwrlabs/flower#3989, was never merged), and the runtime builds it
  without a choice. This worker puts a one-worker `Backend` subclass in place of RayBackend,
  calling the ClientApp in the calling thread as Ray's actor would (`app(message, context)`),
  so no Ray cluster starts (checked: the record says whether Ray was initialised). Everything
  else is Flower's as shipped, including its polling: the grid pulls replies every
  `pull_interval` = 0.1 s and the runtime scans the node queues every 0.1 s, which puts a floor
  of about 0.1 s under every round (measured: 0.103 s for 10 clients that train in 2.5 ms).
- The raysim schedule: FedAvg samples nodes at random; a FedAvg subclass picks the round's
  scheduled clients instead. Nodes get random ids, so before the rounds the ServerApp asks every
  node for its partition-id once (a `query` message; not timed) to map clients to nodes.

Round times: the subclass's configure_train marks the start of every round, and the end of
`strategy.start` marks the end of the last. Telemetry is off (FLWR_TELEMETRY_ENABLED=0).
Prints one JSON line.

    benchmarks/peers/.venvs/flower/bin/python benchmarks/peers/peer_flower.py --workload FILE.npz
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RoundClock,
    accuracy,
    build_model,
    emit,
    get_vector,
    load_workload,
    local_sgd,
    quiet_stdout,
    worker_args,
)

RAY_BACKEND_MODULE = "flwr.server.superlink.fleet.vce.backend.raybackend"


def install_inprocess_backend() -> None:
    """Make the Simulation Runtime build the in-process backend where it builds RayBackend."""
    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
    from flwr.server.superlink.fleet.vce.backend import Backend

    class InProcessBackend(Backend):
        """One worker; runs the ClientApp on the message in the runtime's worker thread."""

        def __init__(self, backend_config) -> None:
            self.app_fn = None

        def build(self, app_fn) -> None:
            self.app_fn = app_fn

        @property
        def num_workers(self) -> int:
            return 1

        def is_worker_idle(self) -> bool:
            return True

        def terminate(self) -> None:
            pass

        def process_message(self, message, context):
            try:
                app = self.app_fn()
                out_message = app(message=message, context=context)
            except LoadClientAppError:
                raise
            except Exception as error:  # as Flower's Ray actor reports a ClientApp failure
                raise ClientAppException(str(error)) from error
            return out_message, context

    module = sys.modules.get(RAY_BACKEND_MODULE)
    if module is None:
        module = types.ModuleType(RAY_BACKEND_MODULE)
        sys.modules[RAY_BACKEND_MODULE] = module
    module.RayBackend = InProcessBackend


def main(argv=None) -> int:
    args = worker_args(argv, threads=(int, 1))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    import flwr
    from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    install_inprocess_backend()
    work = load_workload(args.workload)
    net = build_model(work)  # the ClientApp's model object, reused across calls
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
    clock = RoundClock()
    final: dict[str, object] = {}

    client_app = ClientApp()

    @client_app.query()
    def query(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        return Message(
            RecordDict({"node": MetricRecord({"partition-id": partition})}), reply_to=msg
        )

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        client_id = int(context.node_config["partition-id"])
        round_index = int(msg.content["config"]["server-round"]) - 1
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = work.client_data(client_id)
        orders = work.orders(round_index, work.slot(round_index, client_id))
        loss = local_sgd(net, x, y, orders, work.lr, work.batch_size)
        metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
        content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    class ScheduledFedAvg(FedAvg):
        """FedAvg whose round t trains raysim's scheduled clients of round t."""

        def __init__(self, node_of: dict[int, int]) -> None:
            super().__init__(fraction_evaluate=0.0)
            self.node_of = node_of

        def configure_train(self, server_round, arrays, config, grid):
            clock.mark()
            ids = work.schedule[server_round - 1]
            config["server-round"] = server_round
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
            nodes = [self.node_of[int(c)] for c in ids]
            return self._construct_messages(record, nodes, MessageType.TRAIN)

    server_app = ServerApp()

    @server_app.main()
    def server_main(grid: Grid, context: Context) -> None:
        # The runtime registers the nodes after this thread starts; wait for all of them, as
        # FedAvg's own sampling does (strategy_utils.sample_nodes).
        while len(node_ids := list(grid.get_node_ids())) < work.meta["num_clients"]:
            time.sleep(0.1)
        replies = grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
        )
        node_of = {
            int(reply.content["node"]["partition-id"]): reply.metadata.src_node_id
            for reply in replies
        }
        if len(node_of) != work.meta["num_clients"]:
            raise RuntimeError(f"{len(node_of)} of {work.meta['num_clients']} nodes answered")
        strategy = ScheduledFedAvg(node_of)
        result = strategy.start(grid, ArrayRecord(initial), num_rounds=work.rounds)
        clock.mark()
        final["state"] = result.arrays.to_torch_state_dict()

    with quiet_stdout():
        run_simulation(
            server_app,
            client_app,
            num_supernodes=work.meta["num_clients"],
            backend_name="inprocess",
        )
    if "state" not in final:
        raise SystemExit("Flower's ServerApp did not finish (see the log above)")
    net.load_state_dict(final["state"])
    ray = sys.modules.get("ray")
    emit(
        "flower",
        clock.round_times(),
        accuracy(net, work.test_x, work.test_y),
        get_vector(net),
        work.rounds,
        {"flwr": flwr.__version__},
        ray_initialised=bool(ray is not None and ray.is_initialized()),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
