"""`pytest --cpu-durations=N`: the N tests, and the N test files, that used the most CPU seconds, counting the
test's process and every subprocess it waited for. Keeps the suite within its time budget: on a loaded machine
(or beside another stack's run) wall times say little, CPU seconds stay put. Works across pytest-xdist workers:
each worker measures its own tests and reports through the test report's `user_properties`."""

from __future__ import annotations

import collections
import resource

import pytest

_KEY = "cpu_seconds"
_started = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests and test files that used the most CPU seconds (with their subprocesses)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _started in item.stash:
        outcome.get_result().user_properties.append((_KEY, _cpu_seconds() - item.stash[_started]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_started] = _cpu_seconds()  # before the fixtures: a test pays for the fixtures it sets up
    yield


class _Totals:
    def __init__(self) -> None:
        self.tests: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        for name, value in report.user_properties:
            if name == _KEY and report.when == "teardown":
                self.tests[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter, config):
        count = config.getoption("--cpu-durations")
        files: dict[str, float] = collections.defaultdict(float)
        for nodeid, seconds in self.tests.items():
            files[nodeid.split("::")[0]] += seconds
        write = terminalreporter.write_line
        terminalreporter.section(f"CPU seconds: {sum(self.tests.values()):.0f} in {len(self.tests)} tests")
        for title, table in (("files", files), ("tests", self.tests)):
            write(f"-- the {count} {title} that used the most --")
            for name, seconds in sorted(table.items(), key=lambda kv: -kv[1])[:count]:
                write(f"{seconds:8.1f}  {name}")


def pytest_configure(config):
    if config.getoption("--cpu-durations") is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Totals(), "cpu-durations-totals")
