"""The service never runs a client's code: nothing imported, loaded or executed after it joined a namespace that
is not its own, over every door (a prestart start injected by a worker, a CDI hook in its container's namespace,
the shim's planning), proven by an audit hook in the service (support/auditguard.py); a client that plants
modules in its own mount namespace never gets them run by the service; a worker that loaded something comes back
unclean and ends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.auditguard import Listener
from support.e2e import need_tool
from support.runc import need_busybox
from support.service import Running, start
from test_hook_e2e import write_config
from test_service import cdi_hook_start, runc_start

import gpuhook

TESTS = str(Path(__file__).parent)
SITE = Path(gpuhook.__file__).parent  # the gpuhook package the service imports


def _guarded_service(tmp: Path, config: Path, listener: Listener) -> Running:
    """`gpuhook service --config CONFIG` with the audit guard installed before gpuhook is imported."""
    code = (f"import sys; sys.path.insert(0, {TESTS!r}); from support.auditguard import serve; "
            f"serve({listener.address!r})")
    return start(tmp / "run" / "service.sock", config, tmp / "service.err", command=[sys.executable, "-c", code])


def _host_ldconfig() -> os.stat_result:
    from gpuhook.inject.ldcache import host_ldconfig

    return os.stat(host_ldconfig("/sbin/ldconfig"))


def _settled(listener: Listener) -> list[str]:
    time.sleep(0.3)  # datagrams sent before a start's answer are queued by then; this waits for nothing else
    return listener.lines()


@pytest.mark.e2e
def test_nothing_is_loaded_or_run_after_a_switch_over_every_door(native: Path, root_tmp: Path,
                                                                 fake_driver: Any) -> None:
    need_tool("runc")
    need_busybox()
    config = write_config(root_tmp, Path(fake_driver.root))
    listener = Listener()
    running = _guarded_service(root_tmp, config, listener)
    try:
        for n, env in enumerate((["NVIDIA_VISIBLE_DEVICES=1"], ["NVIDIA_VISIBLE_DEVICES=all",
                                                                "NVIDIA_DRIVER_CAPABILITIES=all"])):
            result = runc_start(root_tmp, native, config, running.sock, env, f"prestart{n}")
            assert result.returncode == 0, result.stderr
        for n, args in enumerate((["update-container", "--link", "lib/libmarker.so.1::/opt/libmarker.so",
                                   "--folder", "/opt/lib"],
                                  ["update-ldcache", "--folder", "/opt/lib", "--host-driver-version", "535.1.1"],
                                  ["create-symlinks", "--link", "a::/opt/b"])):
            result = cdi_hook_start(root_tmp, native, running.sock, args, f"cdi{n}")
            # (the container's probe fails where no cache was made: only the hook's stderr counts)
            assert not result.stderr, "\n".join(listener.lines())
        lines = _settled(listener)
    finally:
        running.stop()
        listener.close()
    log = (root_tmp / "gpuhook.log").read_text()
    assert log.count("by=service") == 2, log  # the prestart starts were the service's, not the fallback's
    assert sum(line.startswith("away ") for line in lines) >= 5, lines  # the guard saw every switch
    assert not [line for line in lines if line.startswith("VIOLATION")], lines
    spawns = [line.split() for line in lines if line.startswith("spawn ")]
    host = _host_ldconfig()
    assert len(spawns) >= 4 and all((int(s[2]), int(s[3])) == (host.st_dev, host.st_ino) for s in spawns), spawns


def _planted(tmp: Path, package: str, module: str, marker: Path) -> Path:
    """A copy of gpuhook's `package` whose `module` first records which process imported it (its pid and its
    ancestors'), then runs as the real one: what a client with its own mount namespace can put there."""
    copy = tmp / f"planted-{package}"
    shutil.copytree(SITE / package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / f"{module}.py"
    spy = ("import os as _os\n"
           "def _chain():\n"
           "    pid, out = _os.getpid(), []\n"
           "    while pid > 1:\n"
           "        out.append(pid)\n"
           "        pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
           "    return out\n"
           f"open({str(marker)!r}, 'a').write(' '.join(map(str, _chain())) + '\\n')\n")
    text = source.read_text()
    head, _, rest = text.partition("from __future__ import annotations\n")
    source.write_text(head + "from __future__ import annotations\n" + spy + rest)
    return copy


def _run_in_own_namespace(entry: Path, sock: Path, over: Path, copy: Path, args: list[str], state: bytes,
                          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """The native entry run in a private mount namespace where `copy` is bind-mounted over `over`."""
    script = f'mount --bind "{copy}" "{over}" && exec "{entry}" "$@"'
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *args],
                          input=state, capture_output=True, timeout=60,
                          env={**os.environ, "GPUHOOK_SERVICE_SOCKET": str(sock), "GPUHOOK_SERVICE_ACK_MS": "30000",
                               **(env or {})})


def _in_service(marker: Path, service: int) -> list[str]:
    """The lines of `marker` written by the service or a process it forked."""
    if not marker.exists():
        return []
    return [line for line in marker.read_text().splitlines() if str(service) in line.split()]


def _small_bundle(tmp: Path) -> tuple[Path, Path]:
    bundle = tmp / "bundle"
    (bundle / "rootfs" / "opt").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                                    "process": {"args": ["true"], "cwd": "/", "env": []}}))
    return bundle, bundle / "rootfs"


@pytest.mark.e2e
def test_a_clients_planted_modules_never_run_in_the_service(native: Path, root_tmp: Path, fake_driver: Any) -> None:
    """A client with its own mount namespace puts its own gpuhook modules where the service's are. Its CDI hook
    is served without importing anything there (the link is made, the planted module never runs); its prestart
    call is declined and runs in-process, as the client, with the client's modules."""
    need_tool("unshare")
    config = write_config(root_tmp, Path(fake_driver.root))
    running = start(root_tmp / "run" / "service.sock", config, root_tmp / "service.err")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        bundle, rootfs = _small_bundle(root_tmp)
        state = json.dumps({"ociVersion": "1.0.2", "id": "planted", "status": "creating", "pid": sleeper.pid,
                            "bundle": str(bundle)}).encode()
        marker = root_tmp / "planted-ran"
        inject = _planted(root_tmp, "inject", "containerhooks", marker)
        hook = _run_in_own_namespace(native, running.sock, SITE / "inject", inject,
                                     ["cdi-hook", "create-symlinks", "--link", "target::/opt/made"], state)
        assert hook.returncode == 0, hook.stderr
        assert os.readlink(rootfs / "opt" / "made") == "target"
        assert not marker.exists()  # neither the service nor a fallback imported the planted module
        hookpkg = _planted(root_tmp, "hook", "unreadconfig", marker)
        gpu = json.dumps({"ociVersion": "1.0.2", "id": "planted2", "status": "creating", "pid": sleeper.pid,
                          "bundle": str(bundle)}).encode()
        start_ = _run_in_own_namespace(native, running.sock, SITE / "hook", hookpkg,
                                       ["--config", str(config), "prestart"], gpu)
        assert start_.returncode == 0, start_.stderr
        assert marker.exists()  # the client ran it itself, as itself
        assert not _in_service(marker, running.proc.pid), marker.read_text()
    finally:
        sleeper.kill()
        sleeper.wait()
        running.stop()
    log = (root_tmp / "gpuhook.log").read_text()
    assert "planted2 skip request=unset" in log and "by=in-process (service" in log and "declined" in log, log
    assert "by=service" not in log


def test_a_worker_that_loaded_something_comes_back_unclean(tmp_path: Path) -> None:
    """Home.back: a module imported or a library mapped since the worker's start leaves it unclean (it ends)."""
    from gpuhook.service.worker import Home

    def child(work: str) -> int:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                home = Home()
                if work == "import":
                    sys.modules["gpuhook_planted_module"] = type(sys)("gpuhook_planted_module")
                elif work == "map":
                    import mmap

                    with open(tmp_path / "lib.so", "wb") as f:
                        f.write(b"\0" * 4096)
                    with open(tmp_path / "lib.so", "rb") as f:
                        kept = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)  # noqa: F841 - stays mapped
                code = 0 if home.back() else 2
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert child("nothing") == 0
    assert child("import") == 2
    assert child("map") == 2
