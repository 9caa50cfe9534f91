"""A running `gpuhook service` for tests and benchmarks, and the suite's service mode.

`start(sock, config, log)` starts one and waits for its socket; `Running.stop()` ends it with SIGTERM (by its
own Popen, so by PID).

The suite's service mode (GPUHOOK_TEST_SERVICE, which .ci/run sets for its extra passes over the hook's
end-to-end tests): a session fixture in conftest installs the native entry, and every OCI hook the tests
configure (hostile.hook_binary, hostile.hook_env) is that entry, pointed at
- `running` (or 1): one `gpuhook service` for the whole session, which answers every start;
- `stopped`: a socket path nothing listens on, so the entry execs its Python fallback beside it.
Unset, the tests run pip's `gpuhook-hook` console script, as before there was a service.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .daemon import wait_ready

GPUHOOK = str(Path(sys.executable).with_name("gpuhook"))
MODE_ENV = "GPUHOOK_TEST_SERVICE"
SOCKET_ENV = "GPUHOOK_TEST_SERVICE_SOCKET"  # set by the session fixture: the socket the hooks are pointed at


# In service mode every start must be the service's (the fallback is replaced by one that fails): a burst of the
# load tests (50 starts at once on 2 CPUs) can keep the service's answer past the entry's 250 ms, after which the
# entry runs the start in-process by design, so the mode gives it longer. test_service_safety covers the bound.
MODE_ACK_MS = "30000"


def service_env() -> dict[str, str]:
    """What a hook's environment needs in service mode: the session's socket (GPUHOOK_SERVICE_SOCKET, which the
    native entry reads) and a wait for the service that no burst reaches (MODE_ACK_MS); empty otherwise."""
    sock = os.environ.get(SOCKET_ENV)
    return {"GPUHOOK_SERVICE_SOCKET": sock, "GPUHOOK_SERVICE_ACK_MS": MODE_ACK_MS} if sock else {}


def service_mode() -> str:
    """"running", "stopped" or "" (off); anything else is an error, never silently off."""
    value = os.environ.get(MODE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return ""
    if value in ("1", "running"):
        return "running"
    if value == "stopped":
        return value
    raise AssertionError(f"{MODE_ENV}={value!r}: expected running, stopped or unset")


class Running:
    def __init__(self, proc: subprocess.Popen[bytes], sock: Path, log: Path) -> None:
        self.proc, self.sock, self.log = proc, sock, log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


def start(sock: Path, config: Path | None, log: Path, command: list[str] | None = None) -> Running:
    """`GPUHOOK_SERVICE_SOCKET=SOCK gpuhook service [--config CONFIG]`, its stderr in `log`; AssertionError if it
    does not come up within 30 s (its stderr quoted). The socket's path appears only once it listens
    (server.bind_socket), so its existence is readiness."""
    argv = [*(command or [GPUHOOK]), "service", *(["--config", str(config)] if config else [])]
    env = {**os.environ, "GPUHOOK_SERVICE_SOCKET": str(sock)}
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env)
    try:
        wait_ready(proc, sock.exists, "gpuhook service", log, 30, interval=0.02)
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    return Running(proc, sock, log)


def spec_with_hook_env(spec: str, env: dict[str, str]) -> str:
    """A CDI spec's YAML with `env` (NAME -> value) added to its hooks' environment: the socket a native entry
    is pointed at (GPUHOOK_SERVICE_SOCKET; a service on the default socket needs none)."""
    import yaml

    data = yaml.safe_load(spec)
    for hook in data["containerEdits"].get("hooks", []):
        hook["env"] = [*hook.get("env", []), *(f"{k}={v}" for k, v in env.items())]
    return yaml.safe_dump(data, sort_keys=False)


def no_fallback(entry: Path, marker: Path) -> None:
    """Replace the native entry's Python fallback (`entry`.py) with one that only leaves a mark and fails the
    start: where a service must answer, any fallback shows. Its #! line is the installed one's (this interpreter),
    which the entry names as the client's interpreter in a command's request."""
    script = entry.with_name(entry.name + ".py")
    script.write_text(f"#!{sys.executable} -IS\nimport os, sys\nopen({str(marker)!r}, 'a').write("
                      "'ran ' + os.environ.get('GPUHOOK_SERVED_BY', '') + '\\n')\n"
                      "sys.stderr.write('gpuhook-hook: fallback ran\\n')\nsys.exit(3)\n")


def install_native_entry(dest: Path) -> tuple[str, str]:
    """`gpuhook hook install --path DEST`, in-process: (the native entry, its Python fallback DEST.py);
    AssertionError when the package build compiled no native entry (there is nothing to test or measure)."""
    from gpuhook.cli.entry import install, native_entry

    assert native_entry() is not None, "the native entry was not built (no C compiler at `pip install` time?)"
    native, script = install(str(dest))
    return native, script


def session_service(tmp: Path, mode: str) -> Running | None:
    """Service mode's setup: the native entry installed under `tmp`, and with `running` one service (the default
    config: every hook names its own with --config) on `tmp`/run/service.sock; the variables hostile.hook_binary
    and hook_env read are pointed at them. The entry must be the native one, or this mode would test nothing."""
    entry = install_native_entry(tmp / "bin" / "gpuhook-hook")[0]
    os.environ["GPUHOOK_TEST_HOOK"] = entry
    if mode == "stopped":
        os.environ[SOCKET_ENV] = str(tmp / "none" / "service.sock")
        return None
    running = start(tmp / "run" / "service.sock", None, tmp / "service.err")
    no_fallback(Path(entry), tmp / "fallback-ran")  # every start of the session must be the service's
    os.environ[SOCKET_ENV] = str(running.sock)
    return running
