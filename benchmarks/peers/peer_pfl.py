"""pfl-research (Apple's `pfl`, ~0.6) running the workload with its simulation API.

Driven as pfl's own examples drive it: `FederatedAveraging().run(...)` over a
`SimulatedBackend` (one process, no Horovod workers) whose training data is a
`FederatedDataset`; the model is a `PyTorchModel` (local optimizer torch SGD at the workload's
lr, central optimizer SGD lr 1.0 on the averaged model difference, which is FedAvg), local
training is pfl's own (`NNTrainHyperParams`: epochs, batch size, lr), updates are weighted by
data points (`WeightByDatapoints`, the postprocessor pfl offers for sample-weighted FedAvg).

Same clients in the same order as raysim: the user sampler hands pfl the exported schedule one
user at a time (pfl asks for `train_cohort_size` users a round, in order). Same batches: each
user's dataset is its rows in the exported first-epoch order, and pfl's `Dataset` cuts
consecutive batches from it (pfl does not reshuffle between epochs, so with local_epochs > 1
its later epochs repeat the first epoch's order; every workload here has one epoch).
`val_cohort_size` is 0 and `evaluation_frequency` = rounds; pfl still evaluates every user
before and after its training in iteration 0 (it evaluates when iteration % frequency == 0),
which the dropped warm-up rounds absorb. pfl's default platform prints every iteration's
metrics (kept, sent to stderr). Round times: a callback marks on_train_begin and every
after_central_iteration. Prints one JSON line.

    benchmarks/peers/.venvs/pfl/bin/python benchmarks/peers/peer_pfl.py --workload FILE.npz
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RoundClock,
    accuracy,
    build_model,
    emit,
    get_vector,
    load_workload,
    quiet_stdout,
    worker_args,
)


class PflModule(nn.Module):
    """The workload's network with the two methods pfl's PyTorchModel calls."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002
        self.train()
        return nn.functional.cross_entropy(self.net(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False):  # noqa: A002
        from pfl.metrics import Weighted

        self.eval()
        logits = self.net(x)
        loss = float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct = float((logits.argmax(dim=1) == y).sum())
        self.train()
        return {"loss": Weighted(loss, len(y)), "accuracy": Weighted(correct, len(y))}


def main(argv=None) -> int:
    args = worker_args(argv, threads=(int, 1))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    work = load_workload(args.workload)
    module = PflModule(build_model(work))
    clock = RoundClock()

    # User "k" is the k-th entry of the flattened schedule: client schedule.flat[k] in round
    # k // per_round, so its dataset can carry that round's batch order.
    next_user = itertools.count()

    def make_user(k: int):
        round_index, slot = divmod(int(k), work.per_round)
        client_id = int(work.schedule[round_index, slot])
        x, y = work.client_data(client_id)
        order = work.orders(round_index, slot)[0]
        return Dataset((x[order], y[order]), user_id=str(client_id))

    training_data = FederatedDataset(make_user, lambda: next(next_user))

    class Clock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            clock.mark()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            clock.mark()
            return False, Metrics()

    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    algorithm = FederatedAveraging()
    with quiet_stdout():
        algorithm.run(
            algorithm_params=NNAlgorithmParams(
                central_num_iterations=work.rounds,
                evaluation_frequency=work.rounds,
                train_cohort_size=work.per_round,
                val_cohort_size=0,
            ),
            backend=SimulatedBackend(
                training_data=training_data,
                val_data=None,
                postprocessors=[WeightByDatapoints()],
            ),
            model=model,
            model_train_params=NNTrainHyperParams(
                local_learning_rate=work.lr,
                local_num_epochs=work.epochs,
                local_batch_size=work.batch_size,
            ),
            model_eval_params=NNEvalHyperParams(local_batch_size=None),
            callbacks=[Clock()],
        )
    users = next(next_user)
    if users != work.rounds * work.per_round:
        raise SystemExit(
            f"pfl sampled {users} users, the schedule has {work.rounds * work.per_round}"
        )
    emit(
        "pfl",
        clock.round_times(),
        accuracy(module.net, work.test_x, work.test_y),
        get_vector(module.net),
        work.rounds,
        {"pfl": pfl.__version__},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
