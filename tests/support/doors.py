"""The three front doors a starting container goes through, for the hostile suites: one call starts a container

- `hook`: runc with gpuhook-hook as its prestart hook;
- `cdi`: podman with the spec `gpuhook generate-cdi` wrote (runc makes nodes and mounts, the spec's
  createContainer hook `gpuhook cdi-hook update-container` makes links and the ld cache);
- `shim`: gpuhook-runtime rewriting config.json (the same CDI edits and hook), then exec'ing runc.

Each start is one `Run`: exit status (None on a hang), output, the rootfs and the log lines gpuhook wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import hostile
from .glibc import glibc_rootfs
from .runc import make_bundle, runc_delete, runc_run, unique_id

DOORS = ("hook", "cdi", "shim")
SHIM = str(Path(sys.executable).with_name("gpuhook-runtime"))
TIMEOUT = 60
GPU_ENV = ("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all")
GPUHOOK_PREFIXES = {"hook": ("gpuhook-hook: ",), "cdi": ("gpuhook: ",), "shim": ("gpuhook-runtime: ", "gpuhook: ")}


@dataclass
class Run:
    door: str
    rc: int | None  # None: it hung past the timeout
    stdout: str
    stderr: str
    rootfs: Path
    log: list[str] = field(default_factory=list)

    def gpuhook_lines(self) -> list[str]:
        """The lines of stderr that gpuhook wrote (runc and podman quote a hook's stderr inside theirs)."""
        prefixes = GPUHOOK_PREFIXES[self.door]
        return [line for line in self.stderr.splitlines() if any(p in line for p in prefixes)]

    def refused(self, *words: str) -> str:
        """Assert a one-line refusal by gpuhook (no traceback) whose line holds `words`; return the line."""
        assert self.rc not in (0, None), f"{self.door}: expected a refusal: rc={self.rc} {self.stdout} {self.stderr}"
        assert "Traceback" not in self.stderr, self.stderr
        lines = self.gpuhook_lines()
        assert len(lines) == 1, f"{self.door}: expected one gpuhook line: {self.stderr}"
        assert all(w in lines[0] for w in words), lines[0]
        return lines[0]


Setup = Callable[[Path], None]


class Doors:
    """Starts containers through any door for one fake (or real) driver; `world` gives the podman world."""

    def __init__(self, driver_root: Path, world: Callable[[], Any], probe_cache: Path) -> None:
        self.driver_root = driver_root
        self.world = world
        self.probe_cache = probe_cache

    def start(self, door: str, work: Path, *, setup: Setup | None = None, env: Sequence[str] = (),
              gpu: bool = True, config: Mapping[str, Any] | None = None, args: Sequence[str] = ("true",),
              volumes: Sequence[tuple[str, str, str]] = (), annotations: Mapping[str, str] | None = None,
              cdi_devices: Sequence[str] = ("nvidia.com/gpu=0",), timeout: float = TIMEOUT,
              bundle_extra: Mapping[str, Any] | None = None, rootfs: Path | None = None) -> Run:
        """One start through `door` of a fresh glibc image under `work` (or of the shared image `rootfs`),
        corrupted by `setup(rootfs)`; `volumes` are (host path, container path, options) binds; `config` extends
        the hook's config file."""
        work.mkdir(parents=True, exist_ok=True)
        shared = rootfs is not None  # then concurrent starts share it: leftovers are the caller's to look for
        if rootfs is None:
            rootfs = glibc_rootfs(work / "bundle" if door != "cdi" else work, probe_cache=self.probe_cache)
        if setup is not None:
            setup(rootfs)
        full_env = [*env, *(GPU_ENV if gpu else ())]
        conf = hostile.write_config(work, self.driver_root, **dict(config or {}))
        if door == "cdi":
            return self._podman(work, rootfs, full_env, list(cdi_devices) if gpu else [], args, volumes, timeout,
                                shared)
        mounts = [{"destination": dst, "type": "bind", "source": src, "options": ["rbind", *opts.split(",")]}
                  for src, dst, opts in volumes]
        bundle = make_bundle(work / "bundle", rootfs, list(args), env=full_env, mounts=mounts,
                             hooks=hostile.prestart_hooks(conf) if door == "hook" else None,
                             annotations=annotations, extra=bundle_extra)
        cid = unique_id(f"door-{door}")
        try:
            if door == "hook":
                result = runc_run(bundle, cid, timeout=timeout)
            else:
                shim_env = dict(os.environ, GPUHOOK_CONFIG=str(conf), GPUHOOK_RUNTIME="runc")
                try:
                    result = subprocess.run([SHIM, "run", "--bundle", str(bundle), cid], env=shim_env,
                                            capture_output=True, text=True, timeout=timeout,
                                            stdin=subprocess.DEVNULL, check=False)
                finally:
                    runc_delete(cid)
            rc, out, err = result.returncode, result.stdout, result.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = None, str(exc.stdout or ""), str(exc.stderr or "")
        hostile.kill_leftovers(str(conf))
        return Run(door, rc, out, err, rootfs, hostile.log_lines(work))

    def _podman(self, work: Path, rootfs: Path, env: list[str], devices: list[str], args: Sequence[str],
                volumes: Sequence[tuple[str, str, str]], timeout: float, shared: bool = False) -> Run:
        world = self.world()
        cmd = world.run_command(rootfs, devices, list(args), env=env)
        at = cmd.index("--rootfs")
        for src, dst, opts in volumes:
            cmd[at:at] = ["--volume", f"{src}:{dst}:{opts}"]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
            rc, out, err = result.returncode, result.stdout, result.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = None, str(exc.stdout or ""), str(exc.stderr or "")
        if not shared:
            hostile.kill_leftovers(str(rootfs))
        return Run("cdi", rc, out, err, rootfs, [])
