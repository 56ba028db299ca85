"""The confluent-kafka range pyproject.toml admits, and the release its top is tested on."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from integration_tests.client_versions import NEWEST

ROOT = Path(__file__).resolve().parents[1]


def _pin() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    found = [Requirement(d) for d in project["dependencies"] if d.startswith("confluent-kafka")]
    assert len(found) == 1, found
    return found[0]


def test_the_newest_release_the_pin_admits_is_the_one_the_workers_are_tested_on() -> None:
    """A raised pin with no test on its new top would ship a release no test ran a worker
    on (2.16 hung every worker at its first assignment until the worker stopped calling the
    consumer from a helper thread inside its rebalance callback)."""
    pin = _pin()
    newest = Version(NEWEST)
    assert newest in pin.specifier
    next_minor = Version(f"{newest.major}.{newest.minor + 1}.0")
    assert next_minor not in pin.specifier, (
        f"pyproject.toml admits {next_minor}; the tests run workers on {NEWEST} "
        "(integration_tests/client_versions.py NEWEST): raise that with the pin"
    )
