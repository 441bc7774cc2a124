"""A backend plug-in must have every member the round loop and the assembly use: one missing
is refused at start in one line, before any data is loaded or any round trains (it used to
train every round and die at the summary with a bare AttributeError)."""

from __future__ import annotations

from pathlib import Path

import pytest

import raysim
from raysim import registry
from raysim.core.backend import REQUIRED, REQUIRED_ATTRIBUTES, check_backend
from raysim.errors import ConfigError
from raysim.runtime.local import LocalBackend

DIGITS_OVERRIDES = [
    "partition.num_clients=10",
    "clients.per_round=2",
    "run.rounds=2",
    "model.hidden=[8]",
]


def _without(member: str) -> type:
    """A copy of the local backend's class without `member`; records whether it started."""
    members = {k: v for k, v in vars(LocalBackend).items() if k not in (member, "__dict__")}
    original_start = vars(LocalBackend)["start"].__func__

    def start(cls, config, address, prepare):
        cls.started = True
        return original_start(cls, config, address, prepare)

    members.update(start=classmethod(start), started=False)
    return type(f"LocalWithout_{member}", (), members)


def _refusal(name: str, backend_class: type, config_path, tmp_path, error: type) -> str:
    """The one-line `error` a digits run on `backend_class` (registered as `name`) stops with."""
    registry.backends.register(name, backend_class)
    try:
        with pytest.raises(error) as caught:
            raysim.run(
                config_path,
                out=tmp_path / "out",
                overrides=[*DIGITS_OVERRIDES, f"runtime.backend={name}"],
                progress=False,
                tensorboard=False,
            )
    finally:
        registry.backends.unregister(name)
    return str(caught.value)


@pytest.mark.parametrize("member", [m for m in REQUIRED if m != "start"])
def test_a_backend_lacking_a_member_the_loop_uses_is_refused_before_it_starts(
    member, digits_config_path, tmp_path
):
    backend_class = _without(member)
    message = _refusal("lacking_test", backend_class, digits_config_path, tmp_path, ConfigError)
    assert "\n" not in message
    assert "backend 'lacking_test'" in message and f"lacks {member}" in message
    assert not backend_class.started  # refused before it loaded data or started a server
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_loops_members_are_all_required():
    """Every Backend method the loop and assembly call is in REQUIRED (task_nodes and
    server_peak_rss_bytes used to be missing, so a plug-in without them passed the check;
    placement was looked up as an optional member)."""
    assert {"run_round", "restart", "get_state", "set_state", "server_peak_rss_bytes",
            "describe", "task_nodes", "placement", "shutdown"} <= set(REQUIRED)  # fmt: skip
    check_backend(LocalBackend, "local")  # the built-ins pass
    check_backend(registry.backends.get("ray"), "ray")
    assert LocalBackend.placement(None) is None  # one place to train: nothing to report


def test_the_extending_guide_names_every_member_a_backend_must_have():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "EXTENDING.md").read_text()
    section = doc.split("\n## Backend\n", 1)[1].split("\n## ", 1)[0]
    for member in (*REQUIRED, *REQUIRED_ATTRIBUTES):
        assert f"`{member}" in section, member


def test_a_started_backend_without_its_split_is_refused_in_one_line(digits_config_path, tmp_path):
    shut_down = []

    class NoSplit(LocalBackend):
        def __init__(self, *args):
            super().__init__(*args)
            del self.split

        def shutdown(self):
            shut_down.append(True)

    message = _refusal("no_split_test", NoSplit, digits_config_path, tmp_path, ConfigError)
    assert "\n" not in message and "started without split" in message
    assert shut_down == [True]  # what it started is released
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_backend_that_plans_twice_is_refused_in_one_line(digits_config_path, tmp_path):
    """The assembly keeps the one plan it handed the backend: a backend that calls `prepare`
    a second time (two plans, two splits) is refused before any round trains."""
    original_start = vars(LocalBackend)["start"].__func__

    class PlansTwice(LocalBackend):
        @classmethod
        def start(cls, config, address, prepare):
            def twice(dataset, *attachments):
                prepare(dataset, *attachments)
                return prepare(dataset, *attachments)

            return original_start(cls, config, address, twice)

    message = _refusal(
        "plans_twice_test", PlansTwice, digits_config_path, tmp_path, raysim.RaysimError
    )
    assert "\n" not in message and "called prepare 2 times" in message
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
