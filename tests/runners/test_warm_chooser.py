"""The worker keeps one warm Docker backend per process, and caches nothing else."""

from __future__ import annotations

import pytest

from runners import warm_chooser
from runners.sandbox import SandboxUnavailable, WarmDockerBackend
from runners.sandbox.docker import DockerBackend


class FakeDocker(DockerBackend):
    def __init__(self) -> None:  # no engine needed: nothing is run
        self.image_id = "sha256:" + "0" * 64
        self.client = None


def test_the_docker_backend_is_chosen_once_and_kept_warm(monkeypatch):
    chosen = []
    monkeypatch.setattr(warm_chooser, "select_backend", lambda p: chosen.append(p) or FakeDocker())
    monkeypatch.setattr(warm_chooser.WarmBackendChooser, "_sweep", lambda self: None)
    chooser = warm_chooser.WarmBackendChooser(idle_seconds=60, max_containers=4, enabled=True)
    first, second = chooser("docker"), chooser("docker")
    assert first is second and isinstance(first, WarmDockerBackend)
    assert first.max_containers == 4 and chosen == ["docker"]


def test_turned_off_every_call_runs_fresh(monkeypatch):
    monkeypatch.setattr(warm_chooser, "select_backend", lambda p: FakeDocker())
    monkeypatch.setattr(warm_chooser.WarmBackendChooser, "_sweep", lambda self: None)
    chooser = warm_chooser.WarmBackendChooser.from_environment({"KESTREL_WARM_SANDBOXES": "0"})
    assert chooser("docker").max_containers == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KESTREL_WARM_IDLE_SECONDS", "nan"),
        ("KESTREL_WARM_IDLE_SECONDS", "-5"),
        ("KESTREL_WARM_IDLE_SECONDS", "0"),
        ("KESTREL_WARM_IDLE_SECONDS", "soon"),
        ("KESTREL_WARM_MAX_CONTAINERS", "0"),
        ("KESTREL_WARM_MAX_CONTAINERS", "-1"),
        ("KESTREL_WARM_MAX_CONTAINERS", "many"),
    ],
)
def test_bad_warm_settings_are_refused_with_the_variable_named(name, value):
    with pytest.raises(ValueError, match=name):
        warm_chooser.WarmBackendChooser.from_environment({name: value})


def test_other_choices_and_failures_are_not_cached(monkeypatch):
    other = object()
    outcomes = [SandboxUnavailable("no engine"), other, other]

    def select(preference):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(warm_chooser, "select_backend", select)
    chooser = warm_chooser.WarmBackendChooser(idle_seconds=60, max_containers=4, enabled=True)
    with pytest.raises(SandboxUnavailable):
        chooser("auto")
    assert chooser("auto") is other
    assert chooser("auto") is other
    assert outcomes == []
