"""Shared fixtures: the simulated driver (tests/support/fakefix.py), NVIDIA's real driver roots
(tests/support/realfix.py) and the end-to-end gate."""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fakefix import *  # noqa: F401,F403
from support.hostpaths import host_changes, host_snapshot
from support.kubeletfix import *  # noqa: F401,F403
from support.realfix import *  # noqa: F401,F403
from support.service import service_mode, session_service
from support.servicefix import *  # noqa: F401,F403


@pytest.fixture(scope="session", autouse=True)
def _service_mode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """GPUHOOK_TEST_SERVICE=running|stopped: every OCI hook of the session is the native entry, with one
    `gpuhook service` answering or none (support/service.py); a running one must still be up at the end and
    must have written no traceback."""
    mode = service_mode()
    running = session_service(tmp_path_factory.mktemp("service"), mode) if mode else None
    if running is None:
        yield
        return
    try:
        yield
    finally:
        alive = running.proc.poll() is None
        running.stop()
        errors = running.log.read_text(errors="replace")
        assert alive, f"gpuhook service died during the session: {errors[-800:]}"
        assert "Traceback" not in errors, errors[-2000:]


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_HOST_KEY] = host_snapshot()
    _cluster_tools()


def _cluster_tools() -> None:
    """The folders of the Kubernetes programs .ci/build-k8s built on this machine (it lists them in its cache's
    `env`), unless the environment already names them: the README's test command finds them without .ci/run."""
    path = os.path.join(os.environ.get("GPUHOOK_K8S_CACHE", "/var/cache/gpuhook-k8s"), "env")
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition("=")
            if name.startswith("GPUHOOK_") and value:
                os.environ.setdefault(name, value)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_HOST_KEY, None)
    if before is None:
        return
    changed = host_changes(before, host_snapshot())
    if changed:
        session.config.stash[_CHANGED_KEY] = changed
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    changed = terminalreporter.config.stash.get(_CHANGED_KEY, [])
    if changed:
        terminalreporter.section("host paths changed during the session", red=True)
        for word in changed:
            terminalreporter.line(f"FAILED: {word} (a test wrote outside its temp dirs)", red=True)


_HOST_KEY = pytest.StashKey[dict[str, object]]()
_CHANGED_KEY = pytest.StashKey[list[str]]()
