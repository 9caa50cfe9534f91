"""The real-GPU check: the whole pipeline on a machine with an NVIDIA GPU, in one go.

    bench/device-check.sh OUTDIR [--simulate] [--wheels DIR] [--runc PATH] [--busybox PATH] [--probe PATH]
                                 [--nvidia-dir DIR] [--timeout S] [--keep]
    bench/device-check.sh --self-test            # the parsers and the CDI applier on embedded samples (exit 0/1)
    bench/device-check.sh --make-kit [DIR]       # wheels for Python 3.12, runc (+ libseccomp), busybox, gpuprobe

Steps, each recorded whether or not the one before worked (OUTDIR/summary.json: name, ok, seconds, detail and,
for the comparison, the differences):

  setup     gpuhook (from --wheels, installed with pip --no-index --target into a temp dir, or this Python's),
            runc, a static busybox, the CUDA probe (tests/support/csrc/gpuprobe.c built with gcc when there is
            one, else --probe), the driver root, the lean hook entry and its config, a runc smoke container
  facts     kernel, Python, gpuhook, the driver root found, nvidia-smi, runc, glibc, cgroups
  info      `gpuhook info --json` against `nvidia-smi -q -x`: GPU count, UUIDs, PCI bus ids, names, minors,
            driver and CUDA version, MIG mode, memory; every difference is recorded (a difference is a finding,
            not a failure)
  cdi       `gpuhook generate-cdi` into OUTDIR + `gpuhook cdi validate`
  hook      runc container, gpuhook-hook as its prestart hook, NVIDIA_VISIBLE_DEVICES=0: nvidia-smi -L + probe
  cdi-run   runc container with the spec's edits for nvidia.com/gpu=0 and the spec-wide edits applied to its
            config.json as a CDI runtime does (runc reads no CDI): nvidia-smi -L + probe

The driver: NVIDIA's files under --nvidia-dir (default /usr/local/nvidia: lib64 or lib, bin; read-only) are
copied into a private driver root laid out as gpuhook discovers one (usr/lib/x86_64-linux-gnu, usr/bin, its own
etc/ld.so.cache): gpuhook follows links only inside a driver root, so links out of it cannot work. Device nodes
and /proc are the machine's own (--dev-root /, --proc-root /proc). Without that folder, a driver installed in
the usual places is used with --driver-root /. `--simulate` uses `gpuhook fake-driver create` instead (its
nvidia-smi has no -q -x: the comparison then uses its `-L` and version output, and --self-test covers the XML).

Test tooling, not product code: the containers are the tests' (tests/support: runc bundles, glibc_rootfs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import posixpath
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # importing tests/support must leave the checkout as it was

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
TESTS_DIR = REPO / "tests"
DEFAULT_KIT = BENCH_DIR / "results" / "device-kit"
DEFAULT_TIMEOUT = 300
DEFAULT_NVIDIA_DIR = "/usr/local/nvidia"
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
LIB32_DIR = "/usr/lib/i386-linux-gnu"
HOST_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")
OUT_NAMES = ("summary.json", "run.log", "gpuhook-info.json", "nvidia-smi.xml", "nvidia-smi.txt", "nvidia.yaml",
             "hook-run.txt", "cdi-run.txt")  # at most 7 of them are written: nvidia-smi.xml or .txt
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
DETAIL_MAX = 300
CONTAINER_SCRIPT = 'nvidia-smi -L 2>&1; echo "nvidia-smi-rc=$?"; gpuprobe 2>&1; echo "gpuprobe-rc=$?"'
CONTAINER_ENV = ("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")
HOOK_ENV = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
CDI_DEVICE = "0"
# runc links libseccomp.so.2; where a machine has none, the kit's copy is named by an absolute DT_NEEDED of the
# same length (runc re-executes itself from a memfd with an empty environment, so LD_LIBRARY_PATH cannot help)
SECCOMP_NEEDED = re.compile(rb"libseccomp\.so\.[0-9]\0")
SECCOMP_PRIVATE = b"/tmp/ghsc.so.2\0\0"
SMI_LIST = re.compile(r"^GPU (\d+): (.*?) \(UUID: ([^)]+)\)\s*$")
SMI_VERSIONS = re.compile(r"Driver Version\s*:?\s*([0-9][0-9.]*).*?CUDA Version\s*:?\s*([0-9][0-9.]*)", re.S)
PROBE_LINE = re.compile(r"cuInit=(-?\d+) count=(-?\d+) version=(-?\d+)")


class StepFailed(Exception):
    """A step did not work: its detail line."""


class WholeRunTimeout(BaseException):
    """The whole run's deadline passed (a BaseException, so no step's own `except Exception` swallows it)."""


def clip(text: str, limit: int = DETAIL_MAX) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def last_line(text: str, default: str = "") -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else default


# --- comparing `gpuhook info --json` with nvidia-smi ------------------------------------------------------------


def normalize_bus_id(bus_id: str | None) -> str:
    """00000000:19:00.0 (nvidia-smi) and 0000:19:00.0 (gpuhook) alike: a 4-digit lower-case domain."""
    text = (bus_id or "").strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        return text
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return text


def _mib(text: str | None) -> int | None:
    m = re.match(r"\s*(\d+)\s*MiB", text or "")
    return int(m.group(1)) if m else None


def _int(text: str | None) -> int | None:
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def parse_smi_xml(text: str) -> dict[str, Any]:
    """What `nvidia-smi -q -x` says about the fields compared; ValueError when it is not that document."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"not XML: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"root element is <{root.tag}>, not <nvidia_smi_log>")
    gpus = []
    for gpu in root.findall("gpu"):
        mig = (gpu.findtext("mig_mode/current_mig") or "").strip()
        gpus.append({
            "uuid": (gpu.findtext("uuid") or "").strip(),
            "pci_bus_id": normalize_bus_id(gpu.findtext("pci/pci_bus_id") or gpu.get("id")),
            "name": (gpu.findtext("product_name") or "").strip(),
            "minor": _int(gpu.findtext("minor_number")),
            "mig_enabled": {"enabled": True, "disabled": False}.get(mig.lower()),  # N/A: not MIG-capable
            "memory_mib": _mib(gpu.findtext("fb_memory_usage/total")),
        })
    return {
        "driver_version": (root.findtext("driver_version") or "").strip(),
        "cuda_version": (root.findtext("cuda_version") or "").strip(),
        "attached_gpus": _int(root.findtext("attached_gpus")),
        "gpus": gpus,
        "fields": ["count", "uuid", "pci_bus_id", "name", "minor", "driver_version", "cuda_version", "mig_enabled",
                   "memory_mib"],
    }


def parse_smi_text(listing: str, versions: str) -> dict[str, Any]:
    """The same from `nvidia-smi -L` and plain `nvidia-smi` (what the simulated nvidia-smi offers)."""
    gpus = []
    for line in listing.splitlines():
        m = SMI_LIST.match(line.strip())
        if m:
            gpus.append({"index": int(m.group(1)), "name": m.group(2).strip(), "uuid": m.group(3).strip()})
    if not gpus:
        raise ValueError(f"no 'GPU n: NAME (UUID: ...)' line in {clip(listing, 120)!r}")
    m = SMI_VERSIONS.search(versions)
    return {
        "driver_version": m.group(1) if m else "",
        "cuda_version": m.group(2) if m else "",
        "attached_gpus": len(gpus),
        "gpus": gpus,
        "fields": ["count", "uuid", "name", "order", "driver_version", "cuda_version"],
    }


def info_view(info: Mapping[str, Any]) -> dict[str, Any]:
    """`gpuhook info --json` reduced to the fields nvidia-smi can be compared on."""
    gpus = [{
        "index": g.get("index"),
        "uuid": g.get("uuid") or "",
        "pci_bus_id": normalize_bus_id(g.get("pci_bus_id")),
        "name": g.get("name") or "",
        "minor": g.get("minor"),
        "mig_enabled": bool(g.get("mig_enabled")),
        "memory_mib": g.get("memory_mib"),
    } for g in info.get("gpus") or []]
    return {"driver_version": info.get("driver_version") or "", "cuda_version": info.get("cuda_version") or "",
            "gpus": gpus}


def compare(info: Mapping[str, Any], smi: Mapping[str, Any]) -> list[str]:
    """Every difference between gpuhook's view (info_view) and nvidia-smi's (parse_smi_*), one line each."""
    fields = set(smi["fields"])
    diffs: list[str] = []
    for key in ("driver_version", "cuda_version"):
        if key in fields and info[key] != smi[key]:
            diffs.append(f"{key}: gpuhook {info[key]!r}, nvidia-smi {smi[key]!r}")
    ours, theirs = info["gpus"], smi["gpus"]
    if len(ours) != len(theirs):
        diffs.append(f"GPU count: gpuhook {len(ours)}, nvidia-smi {len(theirs)}")
    if smi.get("attached_gpus") is not None and smi["attached_gpus"] != len(theirs):
        diffs.append(f"nvidia-smi attached_gpus {smi['attached_gpus']} but {len(theirs)} <gpu> entries")
    by_uuid = {g["uuid"]: g for g in theirs}
    for g in ours:
        if g["uuid"] not in by_uuid:
            diffs.append(f"{g['uuid'] or '(no UUID)'} (gpuhook index {g['index']}): not listed by nvidia-smi")
    ours_uuids = {g["uuid"] for g in ours}
    diffs += [f"{g['uuid']}: listed by nvidia-smi only" for g in theirs if g["uuid"] not in ours_uuids]
    for g in ours:
        other = by_uuid.get(g["uuid"])
        if other is None:
            continue
        for key in ("pci_bus_id", "name", "minor", "memory_mib", "mig_enabled"):
            if key not in fields:
                continue
            mine, theirs_value = g[key], other[key]
            if key == "mig_enabled" and theirs_value is None:
                theirs_value = False  # N/A: a GPU without MIG, as gpuhook's false
            if mine != theirs_value:
                diffs.append(f"{g['uuid']} {key}: gpuhook {mine!r}, nvidia-smi {theirs_value!r}")
    if "order" in fields:
        mine_order = [g["uuid"] for g in ours]
        their_order = [g["uuid"] for g in sorted(theirs, key=lambda g: g.get("index", 0))]
        if set(mine_order) == set(their_order) and mine_order != their_order:
            diffs.append(f"GPU order: gpuhook {mine_order}, nvidia-smi {their_order}")
    return diffs


# --- applying a CDI spec to an OCI config, as a CDI runtime does -----------------------------------------------


def _node_from_host(node: Mapping[str, Any]) -> tuple[str, int, int, int]:
    """(type, major, minor, mode) of a device node: the spec's values, filled in from the host node."""
    host = node.get("hostPath") or node["path"]
    kind, major, minor, mode = node.get("type"), node.get("major"), node.get("minor"), node.get("fileMode")
    if kind is None or major is None or minor is None or mode is None:
        st = os.stat(host)
        kind = kind or ("b" if stat.S_ISBLK(st.st_mode) else "c")
        major = os.major(st.st_rdev) if major is None else major
        minor = os.minor(st.st_rdev) if minor is None else minor
        mode = stat.S_IMODE(st.st_mode) if mode is None else mode
    return str(kind), int(major), int(minor), int(mode)


def _depth(path: str) -> int:
    return len([p for p in posixpath.normpath(path).split("/") if p])


def apply_cdi(config: dict[str, Any], spec: Mapping[str, Any], device: str) -> dict[str, Any]:
    """Apply `device`'s containerEdits, then the spec-wide ones, to an OCI `config` in place (env replaced by
    key, deviceNodes as linux.devices plus an allow rule, mounts ordered by depth, hooks by hookName); returns
    what was applied. KeyError when the spec has no such device."""
    found = [d for d in spec.get("devices") or [] if d.get("name") == device]
    if not found:
        raise KeyError(f"{spec.get('kind')}={device} is not in the spec")
    edits = [found[0].get("containerEdits") or {}, spec.get("containerEdits") or {}]
    process = config.setdefault("process", {})
    linux = config.setdefault("linux", {})
    applied: dict[str, Any] = {"env": [], "devices": [], "mounts": 0, "hooks": {}, "ignored": []}
    for edit in edits:
        for entry in edit.get("env") or []:
            key = entry.split("=", 1)[0]
            env = [e for e in process.get("env", []) if e.split("=", 1)[0] != key]
            process["env"] = [*env, entry]
            applied["env"].append(entry)
        for node in edit.get("deviceNodes") or []:
            kind, major, minor, mode = _node_from_host(node)
            dev: dict[str, Any] = {"path": node["path"], "type": kind, "major": major, "minor": minor,
                                   "fileMode": mode}
            for key in ("uid", "gid"):
                if node.get(key) is not None:
                    dev[key] = node[key]
            linux["devices"] = [d for d in linux.get("devices", []) if d.get("path") != node["path"]] + [dev]
            rules = linux.setdefault("resources", {}).setdefault("devices", [])
            rules.append({"allow": True, "type": kind, "major": major, "minor": minor,
                          "access": node.get("permissions") or "rwm"})
            applied["devices"].append(f"{node['path']} {kind} {major}:{minor}")
        for mount in edit.get("mounts") or []:
            entry = {"destination": mount["containerPath"], "source": mount["hostPath"],
                     "options": list(mount.get("options") or [])}
            if mount.get("type"):
                entry["type"] = mount["type"]
            config.setdefault("mounts", []).append(entry)
            applied["mounts"] += 1
        for hook in edit.get("hooks") or []:
            stage = hook["hookName"]
            entry = {key: hook[key] for key in ("path", "args", "env", "timeout") if hook.get(key) is not None}
            config.setdefault("hooks", {}).setdefault(stage, []).append(entry)
            applied["hooks"][stage] = applied["hooks"].get(stage, 0) + 1
        if edit.get("additionalGids"):
            user = process.setdefault("user", {"uid": 0, "gid": 0})
            user["additionalGids"] = [*user.get("additionalGids", []), *edit["additionalGids"]]
        applied["ignored"] += [key for key in edit if key not in
                               ("env", "deviceNodes", "mounts", "hooks", "additionalGids")]
    config["mounts"] = sorted(config.get("mounts", []), key=lambda m: _depth(m["destination"]))  # stable
    return applied


# --- the container's output ---------------------------------------------------------------------------------------


def container_findings(stdout: str, expect_uuid: str | None) -> tuple[list[str], str]:
    """(problems, summary) of a container's `nvidia-smi -L` + gpuprobe output."""
    problems: list[str] = []
    listed = [m.group(3) for m in (SMI_LIST.match(line.strip()) for line in stdout.splitlines()) if m]
    smi_rc = re.search(r"^nvidia-smi-rc=(\d+)$", stdout, re.M)
    probe_rc = re.search(r"^gpuprobe-rc=(\d+)$", stdout, re.M)
    probe = PROBE_LINE.search(stdout)
    if not smi_rc or smi_rc.group(1) != "0":
        problems.append(f"nvidia-smi -L exit status {smi_rc.group(1) if smi_rc else '?'}")
    if len(listed) != 1:
        problems.append(f"nvidia-smi lists {len(listed)} GPUs (asked for 1)")
    elif expect_uuid and listed[0] != expect_uuid:
        problems.append(f"nvidia-smi lists {listed[0]}, GPU 0 is {expect_uuid}")
    if probe is None:
        problems.append(f"gpuprobe printed no cuInit line (exit status {probe_rc.group(1) if probe_rc else '?'})")
    else:
        if probe.group(1) != "0":
            problems.append(f"cuInit(0) = {probe.group(1)}")
        if int(probe.group(2)) < 1:
            problems.append(f"cuDeviceGetCount = {probe.group(2)}")
    summary = f"nvidia-smi: {', '.join(listed) or 'no GPU'}; probe: {probe.group(0) if probe else 'no answer'}"
    return problems, summary


# --- small ELF helpers ------------------------------------------------------------------------------------------


def elf_interpreter(path: str) -> str | None:
    """PT_INTERP of a 64-bit little-endian ELF (its loader), None for a static one or a non-ELF file."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or len(head) < 64 or head[4] != 2:
            return None
        phoff = int.from_bytes(head[32:40], "little")
        phentsize, phnum = int.from_bytes(head[54:56], "little"), int.from_bytes(head[56:58], "little")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            entry = table[i * phentsize : (i + 1) * phentsize]
            if int.from_bytes(entry[0:4], "little") == 3:
                offset, size = int.from_bytes(entry[8:16], "little"), int.from_bytes(entry[32:40], "little")
                f.seek(offset)
                return f.read(size).split(b"\0", 1)[0].decode()
    return None


def elf_bits(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            head = f.read(5)
    except OSError:
        return None
    return {1: 32, 2: 64}.get(head[4]) if head[:4] == b"\x7fELF" and len(head) == 5 else None


def patch_needed(data: bytes, new: bytes = SECCOMP_PRIVATE) -> bytes:
    """`data` with its one libseccomp DT_NEEDED string replaced by the path `new`, of the same length."""
    hits = list(SECCOMP_NEEDED.finditer(data))
    if len(hits) != 1:
        raise ValueError(f"libseccomp's name occurs {len(hits)} times, not once")
    start, end = hits[0].span()
    if end - start != len(new):
        raise ValueError(f"{hits[0].group()!r} and {new!r} differ in length")
    return data[:start] + new + data[end:]


# --- the run ------------------------------------------------------------------------------------------------------


class Check:
    """One run's state: the work dir, what setup found, the steps recorded so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.outdir).resolve()
        self.started = time.monotonic()
        self.deadline = self.started + args.timeout
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.steps: list[dict[str, Any]] = []
        self.timed_out = False
        self.work = Path(tempfile.mkdtemp(prefix="gpuhook-device-check-"))
        self.env = dict(os.environ)
        self.site: Path | None = None  # where --wheels were installed
        self.gpuhook: list[str] | None = None  # the CLI command line
        self.support: dict[str, Any] = {}  # tests/support helpers
        self.driver: dict[str, Any] = {}  # roots, nvidia-smi, library folder, what was copied
        self.hook: str | None = None  # the lean entry script
        self.hook_config: Path | None = None
        self.runc: str | None = None
        self.runc_prefix: list[str] = []
        self.busybox: str | None = None
        self.probe: Path | None = None  # folder holding gpuprobe (glibc_rootfs's probe cache)
        self.facts: dict[str, Any] = {}
        self.info: dict[str, Any] | None = None
        self.spec: Path | None = None
        self.private_seccomp = False

    # -- output --

    def log(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        with open(self.out / "run.log", "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def write(self, name: str, text: str) -> Path:
        if name not in OUT_NAMES or not PLAIN_NAME.match(name):
            raise ValueError(f"{name!r} is not one of this check's output files")
        path = self.out / name
        path.write_text(text, encoding="utf-8")
        return path

    def summary(self) -> dict[str, Any]:
        return {
            "check": "gpuhook real-GPU check",
            "mode": "simulate" if self.args.simulate else "device",
            "ok": bool(self.steps) and all(s["ok"] for s in self.steps),
            "started": self.started_at,
            "seconds": round(time.monotonic() - self.started, 2),
            "timeout_s": self.args.timeout,
            "timed_out": self.timed_out,
            "steps": self.steps,
        }

    def write_summary(self) -> None:
        self.write("summary.json", json.dumps(self.summary(), indent=2) + "\n")

    # -- commands --

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, cmd: Sequence[str], timeout: float = 60, env: Mapping[str, str] | None = None,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command (never longer than the run has left); a timeout is exit status 124."""
        limit = max(1.0, min(timeout, self.remaining()))
        t0 = time.monotonic()
        try:
            result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=limit, check=False,
                                    env=dict(env if env is not None else self.env), input=input,
                                    stdin=None if input is not None else subprocess.DEVNULL, errors="replace")
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            result = subprocess.CompletedProcess(list(cmd), 124, out, f"timed out after {limit:.0f} s")
        except OSError as exc:
            result = subprocess.CompletedProcess(list(cmd), 127, "", f"cannot run {cmd[0]}: {exc.strerror}")
        shown = " ".join(cmd) if len(" ".join(cmd)) < 300 else " ".join(cmd)[:297] + "..."
        self.log(f"$ {shown} -> {result.returncode} ({time.monotonic() - t0:.1f}s)")
        if result.returncode != 0:
            for line in (result.stderr or result.stdout or "").strip().splitlines()[-6:]:
                self.log(f"    {line[:300]}")
        return result

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        if self.gpuhook is None:
            raise StepFailed("gpuhook is not available (setup)")
        return self.run([*self.gpuhook, *args], timeout=timeout)

    def roots(self) -> list[str]:
        d = self.driver
        return ["--driver-root", d["driver_root"], "--dev-root", d["dev_root"], "--proc-root", d["proc_root"]]

    def need(self, **things: Any) -> None:
        missing = [name for name, value in things.items() if not value]
        if missing:
            raise StepFailed(f"not possible without {', '.join(missing)} (see the setup step)")

    # -- steps --

    def step(self, name: str, body: Callable[[], tuple[str, dict[str, Any]]]) -> None:
        t0 = time.monotonic()
        entry: dict[str, Any] = {"name": name, "ok": False, "seconds": 0.0, "detail": ""}
        if self.timed_out or self.remaining() <= 0:
            self.timed_out = True
            entry["detail"] = f"not run: the whole-run timeout ({self.args.timeout} s) had passed"
        else:
            self.log(f"== {name}")
            try:
                detail, extra = body()
                entry.update(ok=True, detail=clip(detail))
                entry.update(extra)
            except StepFailed as exc:
                entry["detail"] = clip(str(exc))
                entry.update(getattr(exc, "extra", {}))
            except WholeRunTimeout:
                self.timed_out = True
                entry["detail"] = f"stopped: the whole-run timeout ({self.args.timeout} s) passed during it"
            except Exception as exc:
                entry["detail"] = clip(f"{type(exc).__name__}: {exc}")
                for line in traceback.format_exc().strip().splitlines()[-8:]:
                    self.log(f"    {line}")
        entry["seconds"] = round(time.monotonic() - t0, 2)
        self.log(f"-> {name}: {'ok' if entry['ok'] else 'FAILED'}: {entry['detail']}")
        self.steps.append(entry)
        self.write_summary()


def failed(detail: str, **extra: Any) -> StepFailed:
    exc = StepFailed(detail)
    exc.extra = extra  # type: ignore[attr-defined]
    return exc


# --- setup ----------------------------------------------------------------------------------------------------


def setup_gpuhook(c: Check) -> str:
    wheels = c.args.wheels
    if wheels:
        folder = Path(wheels).resolve()
        files = sorted(str(p) for p in folder.glob("*.whl") if not p.name.startswith("pip-"))
        if not files:
            raise RuntimeError(f"no wheels in {folder}")
        c.site = c.work / "site"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # the kit only: no index, no find-links or constraints of this host
        pip = [sys.executable, "-m", "pip"]
        if c.run([*pip, "--version"], env=env, timeout=30).returncode != 0:
            bundled = sorted(folder.glob("pip-*.whl"))
            if not bundled:
                raise RuntimeError(f"{sys.executable} has no pip and {folder} no pip wheel")
            pip = [sys.executable, f"{bundled[-1]}/pip"]
        result = c.run([*pip, "install", "--no-index", "--find-links", str(folder), "--target", str(c.site),
                        "--no-warn-script-location", "--disable-pip-version-check", "--no-cache-dir", "--quiet",
                        *files], env=env, timeout=180)
        if result.returncode != 0:
            raise RuntimeError(f"pip install --no-index --target failed: {last_line(result.stderr)}")
        sys.path.insert(0, str(c.site))
        c.env["PYTHONPATH"] = os.pathsep.join([str(c.site), *filter(None, [os.environ.get("PYTHONPATH")])])
    import gpuhook

    where = os.path.dirname(os.path.abspath(gpuhook.__file__ or ""))
    if c.site is not None and not where.startswith(str(c.site)):
        raise RuntimeError(f"gpuhook imports from {where}, not from the wheels installed in {c.site}")
    c.gpuhook = [sys.executable, "-m", "gpuhook.cli"]
    version = c.run([*c.gpuhook, "--version"], timeout=30)
    if version.returncode != 0:
        c.gpuhook = None
        raise RuntimeError(f"gpuhook --version failed: {last_line(version.stderr)}")
    c.facts["gpuhook"] = {"version": version.stdout.strip(), "package": where,
                          "installed_from": str(Path(wheels).resolve()) if wheels else "this Python"}
    return f"gpuhook {version.stdout.split()[-1]} ({'the wheels' if wheels else 'this Python'})"


def import_helpers(c: Check) -> None:
    """tests/support (make_bundle, runc_run, glibc_rootfs); its end-to-end gate imports pytest, which the kit
    brings, else a stand-in that the helpers used here never call."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        import types

        stub = types.ModuleType("pytest")

        def _gate(why: str) -> None:
            raise RuntimeError(why)

        stub.skip = stub.fail = _gate  # type: ignore[attr-defined]
        sys.modules["pytest"] = stub
    _tests_on_path()
    from support import glibc, realdriver
    from support import runc as support_runc

    c.support = {"runc": support_runc, "glibc": glibc, "elf_dynamic": realdriver.elf_dynamic}


def _ldconfig() -> str:
    """The host's ldconfig, Ubuntu's wrapper script skipped for the real binary behind it (the hook's own rule,
    inject/ldcache.host_ldconfig)."""
    from gpuhook.inject.ldcache import host_ldconfig

    for candidate in ("/sbin/ldconfig", "/usr/sbin/ldconfig"):
        if os.path.exists(candidate):
            return host_ldconfig(candidate)
    return shutil.which("ldconfig") or "/sbin/ldconfig"


def _copy_tree(src: Path, dest: Path, depth: int = 0) -> tuple[int, int]:
    """Copy a driver folder: files (a hard link when possible), links kept (an absolute one into `src` made
    relative, one elsewhere replaced by a copy of its file), sub-folders to depth 3. Returns (files, bytes)."""
    dest.mkdir(parents=True, exist_ok=True)
    files = size = 0
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        target = dest / entry.name
        if entry.is_symlink():
            link = os.readlink(entry.path)
            real = os.path.realpath(entry.path)
            if not link.startswith("/"):
                target.symlink_to(link)
            elif real.startswith(str(src.resolve()) + "/"):
                target.symlink_to(os.path.relpath(real, os.path.realpath(src)))
            elif os.path.isfile(real):
                shutil.copy2(real, target)
                files, size = files + 1, size + os.path.getsize(real)
        elif entry.is_dir():
            if depth < 3:
                f, s = _copy_tree(Path(entry.path), target, depth + 1)
                files, size = files + f, size + s
        elif entry.is_file():
            try:
                os.link(entry.path, target)
            except OSError:
                shutil.copy2(entry.path, target)
            files, size = files + 1, size + entry.stat().st_size
    return files, size


def _library_folders(nvidia: Path) -> dict[int, Path]:
    """bits -> the folder of NVIDIA's libcuda / libnvidia-ml under `nvidia` (lib64, lib)."""
    found: dict[int, Path] = {}
    for sub in ("lib64", "lib", "lib32"):
        folder = nvidia / sub
        if not folder.is_dir():
            continue
        for name in sorted(os.listdir(folder)):
            if re.match(r"^lib(cuda|nvidia-ml)\.so\.", name):
                bits = elf_bits(str(folder / name))
                if bits and bits not in found:
                    found[bits] = folder
    return found


def _driver_version(proc_root: str, lib_folder: Path | None) -> str:
    try:
        with open(os.path.join(proc_root, "driver/nvidia/version")) as f:
            m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", f.readline())
            if m:
                return m.group(1)
    except OSError:
        pass
    if lib_folder is not None:
        for name in sorted(os.listdir(lib_folder)):
            m = re.match(r"^libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)$", name)
            if m:
                return m.group(1)
    return ""


def setup_simulated_driver(c: Check) -> str:
    root = c.work / "driver"
    result = c.cli("fake-driver", "create", str(root), "--gpus", "2", timeout=180)
    if result.returncode != 0:
        raise RuntimeError(f"fake-driver create failed: {last_line(result.stderr)}")
    c.driver = {"kind": "simulated (gpuhook fake-driver create --gpus 2)", "driver_root": str(root),
                "dev_root": str(root), "proc_root": str(root / "proc"), "lib_dir": str(root) + LIB_DIR,
                "nvidia_smi": str(root / "usr/bin/nvidia-smi"), "view": str(root)}
    return "simulated driver (2 GPUs)"


def setup_real_driver(c: Check) -> str:
    nvidia = Path(c.args.nvidia_dir)
    folders = _library_folders(nvidia) if nvidia.is_dir() else {}
    if 64 not in folders:
        if os.path.isfile(LIB_DIR + "/libnvidia-ml.so.1") or os.path.isfile("/usr/lib64/libnvidia-ml.so.1"):
            smi = shutil.which("nvidia-smi") or ""
            c.driver = {"kind": "installed in the usual places", "driver_root": "/", "dev_root": c.args.dev_root,
                        "proc_root": c.args.proc_root, "lib_dir": "", "nvidia_smi": smi, "view": "/"}
            return "driver root / (no 64-bit libraries under " + str(nvidia) + ")"
        raise RuntimeError(f"no 64-bit libcuda/libnvidia-ml under {nvidia} (lib64, lib) nor in {LIB_DIR}")
    t0 = time.monotonic()
    view = c.work / "driver"
    copied = {}
    for bits, dest in ((64, LIB_DIR), (32, LIB32_DIR)):
        if bits in folders:
            copied[str(folders[bits])] = _copy_tree(folders[bits], view / dest.lstrip("/"))
    bin_dir = nvidia / "bin"
    if bin_dir.is_dir():
        copied[str(bin_dir)] = _copy_tree(bin_dir, view / "usr/bin")
    (view / "etc").mkdir(parents=True, exist_ok=True)
    (view / "etc/ld.so.conf").write_text(f"{LIB_DIR}\n{LIB32_DIR}\n")
    (view / "var/cache/ldconfig").mkdir(parents=True, exist_ok=True)
    ldconfig = _ldconfig()
    cache = c.run([ldconfig, "-r", str(view)], timeout=60)
    smi = bin_dir / "nvidia-smi"
    c.driver = {
        "kind": f"NVIDIA's files under {nvidia}, copied into a private driver root",
        "nvidia_dir": str(nvidia),
        "lib_dir": str(folders[64]),
        "lib32_dir": str(folders.get(32, "")),
        "bin_dir": str(bin_dir) if bin_dir.is_dir() else "",
        "nvidia_smi": str(smi) if smi.exists() else shutil.which("nvidia-smi") or "",
        "driver_root": str(view),
        "dev_root": c.args.dev_root,
        "proc_root": c.args.proc_root,
        "view": str(view),
        "copied": {src: {"files": n, "mib": round(b / 2**20, 1)} for src, (n, b) in copied.items()},
        "copy_seconds": round(time.monotonic() - t0, 2),
        "ld_so_cache": "made" if cache.returncode == 0 else f"none ({ldconfig} -r failed: {last_line(cache.stderr)})",
    }
    total = sum(b for _, b in copied.values()) / 2**20
    return f"{nvidia} copied into a private driver root ({total:.0f} MiB, {time.monotonic() - t0:.1f} s)"


def setup_hook(c: Check) -> str:
    c.need(gpuhook=c.gpuhook, driver=c.driver)
    path = c.work / "bin" / "gpuhook-hook"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = c.cli("hook", "install", "--path", str(path), timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"gpuhook hook install failed: {last_line(result.stderr)}")
    c.hook = str(path)
    d = c.driver
    values = {"driver-root": d["driver_root"], "dev-root": d["dev_root"], "proc-root": d["proc_root"],
              "log-file": str(c.work / "gpuhook.log"), "inventory-cache": str(c.work / "inventory.json")}
    ldconfig = _ldconfig()
    if ldconfig.endswith(".real"):
        values["ldconfig"] = "@" + ldconfig
    c.hook_config = c.work / "config.toml"
    c.hook_config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    c.env["GPUHOOK_CONFIG"] = str(c.hook_config)  # commands that read a hook config read this one
    return "hook entry + config"


def setup_runc(c: Check) -> str:
    source = c.args.runc or shutil.which("runc")
    if not source or not os.path.isfile(source):
        raise RuntimeError(f"no runc ({c.args.runc or 'none on PATH'}; give --runc PATH)")
    binary = c.work / "bin" / "runc"
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, binary)
    binary.chmod(0o755)
    version = c.run([str(binary), "--version"], timeout=20)
    if version.returncode != 0 and "libseccomp" in version.stderr:
        beside = sorted(Path(source).resolve().parent.glob("libseccomp.so.2*"))
        if not beside:
            raise RuntimeError(f"runc needs libseccomp.so.2, which neither the host nor {Path(source).parent} has")
        shutil.copy2(beside[0], SECCOMP_PRIVATE.rstrip(b"\0").decode())
        binary.write_bytes(patch_needed(Path(source).read_bytes()))
        binary.chmod(0o755)
        c.private_seccomp = True
        version = c.run([str(binary), "--version"], timeout=20)
    if version.returncode != 0:
        raise RuntimeError(f"runc --version failed: {last_line(version.stderr)}")
    c.runc = str(binary)
    c.env["PATH"] = f"{binary.parent}{os.pathsep}{c.env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    os.environ["PATH"] = c.env["PATH"]  # tests/support runs "runc" from PATH
    c.facts["runc"] = {"from": source, "version": version.stdout.strip().splitlines()[0],
                       "private_libseccomp": c.private_seccomp}
    return f"runc {version.stdout.split()[2] if len(version.stdout.split()) > 2 else '?'}" + (
        " (private libseccomp)" if c.private_seccomp else "")


def setup_busybox(c: Check) -> str:
    from gpuhook.fakedriver import rootfs

    path = c.args.busybox or rootfs.find_static_busybox()
    if not path or not os.path.isfile(path):
        raise RuntimeError(f"no static busybox ({c.args.busybox or rootfs.INSTALL_HINT}; give --busybox PATH)")
    if not rootfs.is_static_elf(path):
        raise RuntimeError(f"{path} is not a static 64-bit ELF")
    copy = c.work / "bin" / "busybox"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, copy)
    copy.chmod(0o755)
    rootfs.BUSYBOX_CANDIDATES = (str(copy),)  # what busybox_rootfs (and glibc_rootfs) copy in
    c.busybox = str(copy)
    c.facts["busybox"] = path
    return "busybox"


def setup_probe(c: Check) -> str:
    folder = c.work / "probe"
    folder.mkdir(parents=True, exist_ok=True)
    gcc = shutil.which("gcc")
    built = ""
    if gcc:
        try:
            c.support["glibc"].build_probe(folder)
            built = f"gpuprobe built with {gcc}"
        except subprocess.CalledProcessError as exc:  # gcc without libc headers, say
            c.log(f"gcc could not build gpuprobe: {last_line(exc.stderr.decode(errors='replace'))}")
            if not c.args.probe:
                raise RuntimeError(f"gcc could not build gpuprobe and no --probe PATH: "
                                   f"{last_line(exc.stderr.decode(errors='replace'))}") from None
    if built:
        how = built
    elif c.args.probe:
        shutil.copy2(c.args.probe, folder / "gpuprobe")
        (folder / "gpuprobe").chmod(0o755)
        how = f"gpuprobe prebuilt ({c.args.probe}; {'gcc failed' if gcc else 'no gcc here'})"
    else:
        raise RuntimeError("no gcc to build gpuprobe and no --probe PATH")
    c.probe = folder
    c.facts["probe"] = how
    return how


def _host_library(name: str) -> str | None:
    for folder in HOST_LIB_DIRS:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and elf_bits(path) == 64:
            return path
    return None


def make_rootfs(c: Check, dest: Path) -> Path:
    """A glibc rootfs (tests/support/glibc.py: busybox, the host's loader and libc, gpuprobe) plus every host
    library that nvidia-smi, libcuda, libnvidia-ml and the probe need besides the driver's own."""
    glibc = c.support["glibc"]
    try:
        rootfs = glibc.glibc_rootfs(dest, probe_cache=c.probe)
    except FileNotFoundError:  # a host without Debian's paths for the loader and libc: the same by hand
        rootfs = c.support["runc"].busybox_rootfs(dest)
        (rootfs / "usr/lib/x86_64-linux-gnu").mkdir(parents=True, exist_ok=True)
        (rootfs / "usr/lib64").mkdir(parents=True, exist_ok=True)
        for link, target in (("lib", "usr/lib"), ("lib64", "usr/lib64")):
            if not (rootfs / link).exists():
                (rootfs / link).symlink_to(target)
        shutil.copy2(c.probe / "gpuprobe", rootfs / "usr/bin/gpuprobe")
    driver_libs = c.driver["driver_root"].rstrip("/") + LIB_DIR
    driver_names = set(os.listdir(driver_libs)) if os.path.isdir(driver_libs) else set()
    elves = [str(rootfs / "usr/bin/gpuprobe")]
    for name in ("nvidia-smi",):
        found = [os.path.join(c.driver["driver_root"], d.lstrip("/"), name) for d in ("usr/bin", "usr/sbin")]
        elves += [p for p in found if os.path.isfile(p)]
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        path = os.path.join(driver_libs, name)
        if os.path.exists(path):
            elves.append(os.path.realpath(path))
    elf_dynamic = c.support["elf_dynamic"]
    wanted: list[str] = []
    seen: set[str] = set()
    for elf in elves:
        interp = elf_interpreter(elf)
        if interp and os.path.exists(interp):
            wanted.append(interp)
        info = elf_dynamic(elf)
        queue = list(info.needed if info else ())
        while queue:
            name = queue.pop(0)
            if name in seen or name in driver_names:
                continue
            seen.add(name)
            host = _host_library(name)
            if host is None:
                continue  # the loader in the container will say so
            wanted.append(host)
            more = elf_dynamic(os.path.realpath(host))
            queue += list(more.needed if more else ())
    for host in dict.fromkeys(wanted):
        target = rootfs / host.lstrip("/")
        if not os.path.lexists(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(host), target)
    return rootfs


def runc_smoke(c: Check) -> str:
    c.need(runc=c.runc, busybox=c.busybox, helpers=c.support)
    r = c.support["runc"]
    cgroup = "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1"
    c.facts["cgroup"] = cgroup
    attempts: list[tuple[str, list[str]]] = [("as is", [])]
    if cgroup == "v1" or not os.access("/sys/fs/cgroup", os.W_OK):
        attempts.append(("in a private mount namespace with cgroup2", r.cgroup2_namespace_prefix()))
    errors = []
    for label, prefix in attempts:
        folder = c.work / f"smoke{len(errors)}"
        rootfs = r.busybox_rootfs(folder)
        bundle = r.make_bundle(folder, rootfs, ["true"])
        result = r.runc_run(bundle, r.unique_id("gpuhook-dc-smoke"), timeout=max(1, min(30, c.remaining())),
                            prefix=prefix)
        c.log(f"runc smoke container ({label}): exit status {result.returncode}")
        if result.returncode == 0:
            c.runc_prefix = prefix
            c.facts["runc_mode"] = label
            return f"runc smoke container ok ({label})"
        errors.append(f"{label}: {last_line(result.stderr, f'exit status {result.returncode}')}")
    c.runc = None
    raise RuntimeError("runc cannot start a container: " + "; ".join(errors))


def step_setup(c: Check) -> tuple[str, dict[str, Any]]:
    done: list[str] = []
    problems: list[str] = []

    def part(name: str, body: Callable[[], object]) -> None:
        try:
            what = body()
            if isinstance(what, str):
                done.append(what)
        except (Exception, StepFailed) as exc:
            problems.append(f"{name}: {exc}")
            c.log(f"setup {name}: {exc}")
            if not isinstance(exc, (RuntimeError, StepFailed)):
                for line in traceback.format_exc().strip().splitlines()[-6:]:
                    c.log(f"    {line}")

    part("gpuhook", lambda: setup_gpuhook(c))
    part("test helpers", lambda: import_helpers(c) if c.gpuhook else c.need(gpuhook=None))
    part("driver", lambda: (setup_simulated_driver if c.args.simulate else setup_real_driver)(c)
         if c.gpuhook else c.need(gpuhook=None))
    part("hook", lambda: setup_hook(c))
    part("runc", lambda: setup_runc(c))
    part("busybox", lambda: setup_busybox(c) if c.gpuhook else c.need(gpuhook=None))
    part("probe", lambda: setup_probe(c) if c.support else c.need(helpers=None))
    part("runc smoke container", lambda: runc_smoke(c))
    if problems:
        raise StepFailed("; ".join(problems))
    return "; ".join(done), {}


# --- the steps -----------------------------------------------------------------------------------------------------


def step_facts(c: Check) -> tuple[str, dict[str, Any]]:
    libc = platform.libc_ver()
    d = c.driver
    facts = {
        "kernel": platform.release(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "glibc": " ".join(filter(None, libc)) or "unknown",
        "machine": platform.machine(),
        **c.facts,
        "driver_root": d.get("driver_root"),
        "driver": {k: v for k, v in d.items() if k not in ("driver_root",)},
        "driver_version": _driver_version(d.get("proc_root", "/proc"), Path(d["lib_dir"]) if d.get("lib_dir")
                                          else None) if d else "",
        "nvidia_smi": d.get("nvidia_smi") or shutil.which("nvidia-smi") or "",
        "ldconfig": _ldconfig(),
        "dev_nodes": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")),
    }
    missing = [k for k in ("driver_root", "nvidia_smi") if not facts[k]] + ([] if "gpuhook" in c.facts else
                                                                              ["gpuhook"])
    detail = (f"kernel {facts['kernel']}, Python {platform.python_version()}, "
              f"{c.facts.get('gpuhook', {}).get('version', 'no gpuhook')}, driver {facts['driver_version'] or '?'} "
              f"root {facts['driver_root']}, nvidia-smi {facts['nvidia_smi'] or 'none'}")
    if missing:
        raise failed(f"unknown: {', '.join(missing)}; {detail}", facts=facts)
    return detail, {"facts": facts}


def _smi_env(c: Check) -> dict[str, str]:
    env = dict(c.env)
    if c.driver.get("lib_dir"):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [c.driver["lib_dir"], env.get("LD_LIBRARY_PATH")]))
    return env


def step_info(c: Check) -> tuple[str, dict[str, Any]]:
    c.need(gpuhook=c.gpuhook, driver=c.driver)
    result = c.cli("info", "--json", *c.roots(), timeout=90)
    problems = []
    info = None
    if result.returncode == 0:
        try:
            info = json.loads(result.stdout)
            c.info = info
            c.write("gpuhook-info.json", json.dumps(info, indent=1) + "\n")
        except ValueError as exc:
            problems.append(f"gpuhook info --json is not JSON: {exc}")
    else:
        problems.append(f"gpuhook info --json failed: {last_line(result.stderr)}")
    smi = c.driver.get("nvidia_smi")
    parsed = None
    if not smi:
        problems.append("no nvidia-smi")
    else:
        env = _smi_env(c)
        xml = c.run([smi, "-q", "-x"], timeout=90, env=env)
        if xml.returncode == 0 and "<nvidia_smi_log" in xml.stdout:
            c.write("nvidia-smi.xml", xml.stdout)
            try:
                parsed = parse_smi_xml(xml.stdout)
            except ValueError as exc:
                problems.append(f"nvidia-smi -q -x: {exc}")
        else:
            listing = c.run([smi, "-L"], timeout=60, env=env)
            plain = c.run([smi], timeout=60, env=env)
            c.write("nvidia-smi.txt", f"$ nvidia-smi -q -x  (exit {xml.returncode}, no XML)\n{xml.stdout[:2000]}\n"
                    f"$ nvidia-smi -L  (exit {listing.returncode})\n{listing.stdout}{listing.stderr}\n"
                    f"$ nvidia-smi  (exit {plain.returncode})\n{plain.stdout}{plain.stderr}")
            try:
                parsed = parse_smi_text(listing.stdout, plain.stdout)
            except ValueError as exc:
                problems.append(f"nvidia-smi -L: {exc}")
            if not c.args.simulate:
                problems.append("nvidia-smi -q -x gave no XML (compared -L and the version line instead)")
    extra: dict[str, Any] = {}
    if info is not None and parsed is not None:
        ours = info_view(info)
        differences = compare(ours, parsed)
        how = "nvidia-smi -q -x" if "memory_mib" in parsed["fields"] else "nvidia-smi -L (no -q -x)"
        extra = {"compared": parsed["fields"], "against": how, "differences": differences}
        detail = (f"{len(ours['gpus'])} GPU(s) via {info.get('source')}, driver {ours['driver_version']}, "
                  f"CUDA {ours['cuda_version']}; against {how}: {len(differences)} difference(s)")
    else:
        extra = {"differences": []}
        detail = "no comparison"
    if problems:
        raise failed("; ".join(problems) + f"; {detail}", **extra)
    return detail, extra


def step_cdi(c: Check) -> tuple[str, dict[str, Any]]:
    c.need(gpuhook=c.gpuhook, driver=c.driver, hook_entry=c.hook)
    spec = c.out / "nvidia.yaml"
    result = c.cli("generate-cdi", *c.roots(), "--hook-path", str(c.hook), "--inventory-cache", "",
                   "--output", str(spec), timeout=120)
    if result.returncode != 0:
        raise StepFailed(f"generate-cdi failed: {last_line(result.stderr)}")
    valid = c.cli("cdi", "validate", str(spec), timeout=60)
    import yaml

    data = yaml.safe_load(spec.read_text())
    names = [d.get("name") for d in data.get("devices") or []]
    common = data.get("containerEdits") or {}
    detail = (f"cdiVersion {data.get('cdiVersion')}, kind {data.get('kind')}, {len(names)} devices "
              f"({', '.join(map(str, names[:6]))}{', ...' if len(names) > 6 else ''}), "
              f"{len(common.get('mounts') or [])} mounts, {len(common.get('deviceNodes') or [])} control nodes")
    if valid.returncode != 0:
        raise StepFailed(f"cdi validate: {clip(valid.stdout or valid.stderr, 200)}; {detail}")
    if CDI_DEVICE not in names:
        raise StepFailed(f"no device {data.get('kind')}={CDI_DEVICE}; {detail}")
    c.spec = spec
    return f"valid; {detail}", {}


def _run_container(c: Check, folder: Path, hooks: Mapping[str, Any] | None,
                   edit: Callable[[dict[str, Any]], dict[str, Any]] | None) -> tuple[Any, str, dict[str, Any]]:
    r = c.support["runc"]
    rootfs = make_rootfs(c, folder)
    env = list(CONTAINER_ENV) if hooks else []
    bundle = r.make_bundle(folder, rootfs, ["sh", "-c", CONTAINER_SCRIPT], env=env, hooks=hooks)
    applied: dict[str, Any] = {}
    if edit is not None:
        config = json.loads((bundle / "config.json").read_text())
        applied = edit(config)
        (bundle / "config.json").write_text(json.dumps(config, indent=2))
    cid = r.unique_id("gpuhook-dc")
    try:
        result = r.runc_run(bundle, cid, timeout=max(1, min(90, c.remaining())), prefix=c.runc_prefix)
    except subprocess.TimeoutExpired:
        result = subprocess.CompletedProcess([], 124, "", "runc run timed out")
    c.log(f"runc run {cid}: exit status {result.returncode}")
    config_text = (bundle / "config.json").read_text()
    return result, config_text, applied


def _expected_uuid(c: Check) -> str | None:
    gpus = (c.info or {}).get("gpus") or []
    return gpus[0].get("uuid") if gpus else None


def step_hook(c: Check) -> tuple[str, dict[str, Any]]:
    c.need(gpuhook=c.gpuhook, driver=c.driver, hook_entry=c.hook, runc=c.runc, busybox=c.busybox, probe=c.probe)
    log = c.work / "gpuhook.log"
    before = log.read_text().splitlines() if log.exists() else []
    hooks = {"prestart": [{"path": c.hook, "args": ["gpuhook-hook", "--config", str(c.hook_config), "prestart"],
                           "env": list(HOOK_ENV)}]}
    result, config_text, _ = _run_container(c, c.work / "hook", hooks, None)
    lines = log.read_text().splitlines()[len(before):] if log.exists() else []
    config = json.loads(config_text)
    c.write("hook-run.txt",
            f"runc run, exit status {result.returncode}\nprocess.env: {config['process']['env']}\n"
            f"hooks: {json.dumps(config.get('hooks'))}\n\n--- container stdout\n{result.stdout}\n"
            f"--- runc stderr\n{result.stderr[-4000:]}\n--- hook log ({log}, this start)\n" + "\n".join(lines) + "\n")
    problems, summary = container_findings(result.stdout, _expected_uuid(c))
    if result.returncode != 0:
        problems.insert(0, f"runc run exit status {result.returncode}: {last_line(result.stderr)}")
    if not any("inject" in line for line in lines):
        problems.append("the hook logged no injection")
    if problems:
        raise StepFailed("; ".join(problems) + f"; {summary}")
    return f"{summary}; hook: {clip(lines[-1] if lines else '', 120)}", {}


def step_cdi_run(c: Check) -> tuple[str, dict[str, Any]]:
    c.need(spec=c.spec, runc=c.runc, busybox=c.busybox, probe=c.probe)
    import yaml

    spec = yaml.safe_load(c.spec.read_text())
    result, config_text, applied = _run_container(c, c.work / "cdi", None, lambda cfg: apply_cdi(cfg, spec,
                                                                                                  CDI_DEVICE))
    hooks = json.loads(config_text).get("hooks") or {}
    c.write("cdi-run.txt",
            f"runc run, exit status {result.returncode}\napplied for {spec.get('kind')}={CDI_DEVICE} + spec-wide: "
            f"env {applied['env']}, devices {applied['devices']}, {applied['mounts']} mounts, hooks "
            f"{applied['hooks']}, ignored {applied['ignored']}\nhooks: {json.dumps(hooks)[:3000]}\n\n"
            f"--- container stdout\n{result.stdout}\n--- runc stderr\n{result.stderr[-4000:]}\n")
    problems, summary = container_findings(result.stdout, _expected_uuid(c))
    if result.returncode != 0:
        problems.insert(0, f"runc run exit status {result.returncode}: {last_line(result.stderr)}")
    edits = (f"{len(applied['devices'])} device nodes, {applied['mounts']} mounts, "
             f"hooks {applied['hooks']}")
    if problems:
        raise StepFailed("; ".join(problems) + f"; {summary}; applied {edits}")
    return f"{summary}; applied {edits}", {}


def run_check(args: argparse.Namespace) -> int:
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUT_NAMES:  # what an earlier run left must not pass for this run's
        with contextlib.suppress(OSError):
            (out / name).unlink()
    c = Check(args)

    def on_alarm(signum: int, frame: object) -> None:
        raise WholeRunTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(args.timeout))
    c.log(f"gpuhook device check ({'simulate' if args.simulate else 'device'}), work {c.work}, "
          f"whole-run timeout {args.timeout} s")
    try:
        c.step("setup", lambda: step_setup(c))
        c.step("facts", lambda: step_facts(c))
        c.step("info", lambda: step_info(c))
        c.step("cdi", lambda: step_cdi(c))
        c.step("hook", lambda: step_hook(c))
        c.step("cdi-run", lambda: step_cdi_run(c))
    except WholeRunTimeout:  # between steps
        c.timed_out = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    c.write_summary()
    if args.keep:
        c.log(f"kept {c.work}")
    else:
        shutil.rmtree(c.work, ignore_errors=True)
    if c.private_seccomp:
        with contextlib.suppress(OSError):
            os.unlink(SECCOMP_PRIVATE.rstrip(b"\0").decode())
    summary = c.summary()
    for s in summary["steps"]:
        print(f"  {'ok    ' if s['ok'] else 'FAILED'} {s['name']:<8} {s['seconds']:6.1f}s  {s['detail']}")
    print(f"{'ok' if summary['ok'] else 'FAILED'} in {summary['seconds']:.1f} s; results in {c.out}")
    return 0 if summary["ok"] else 1


# --- --self-test ------------------------------------------------------------------------------------------------

SAMPLE_XML = """<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
\t<timestamp>Mon Dec  1 12:00:00 2025</timestamp>
\t<driver_version>580.95.05</driver_version>
\t<cuda_version>13.0</cuda_version>
\t<attached_gpus>1</attached_gpus>
\t<gpu id="00000000:19:00.0">
\t\t<product_name>NVIDIA H200</product_name>
\t\t<product_brand>NVIDIA</product_brand>
\t\t<mig_mode>
\t\t\t<current_mig>Disabled</current_mig>
\t\t\t<pending_mig>Disabled</pending_mig>
\t\t</mig_mode>
\t\t<uuid>GPU-5f3e2a10-94c1-7b2d-8e6f-0123456789ab</uuid>
\t\t<minor_number>0</minor_number>
\t\t<pci>
\t\t\t<pci_bus>19</pci_bus>
\t\t\t<pci_device>00</pci_device>
\t\t\t<pci_domain>0000</pci_domain>
\t\t\t<pci_bus_id>00000000:19:00.0</pci_bus_id>
\t\t</pci>
\t\t<fb_memory_usage>
\t\t\t<total>143771 MiB</total>
\t\t\t<reserved>597 MiB</reserved>
\t\t\t<used>0 MiB</used>
\t\t\t<free>143174 MiB</free>
\t\t</fb_memory_usage>
\t</gpu>
</nvidia_smi_log>
"""
SAMPLE_INFO: dict[str, Any] = {
    "driver_version": "580.95.05", "cuda_version": "13.0", "source": "nvml",
    "gpus": [{"index": 0, "minor": 0, "uuid": "GPU-5f3e2a10-94c1-7b2d-8e6f-0123456789ab",
              "pci_bus_id": "0000:19:00.0", "name": "NVIDIA H200", "memory_mib": 143771, "mig_enabled": False}],
}
SAMPLE_LIST = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1a0ce899-7717-5703-9b83-3909d42a379c)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-28ba8e02-f00c-5cb2-afa1-b21c4051ea29)\n")
SAMPLE_PLAIN = "NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4\n" + SAMPLE_LIST
SAMPLE_SPEC: dict[str, Any] = {
    "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
    "devices": [{"name": "0", "containerEdits": {"deviceNodes": [
        {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
         "fileMode": 438, "permissions": "rw"}]}},
        {"name": "1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1", "type": "c", "major": 195,
                                                          "minor": 1, "fileMode": 438}]}}],
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438}],
        "mounts": [{"hostPath": "/drv/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
                    "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]},
                   {"hostPath": "/drv/usr/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi",
                    "options": ["ro", "rbind"], "type": "bind"}],
        "hooks": [{"hookName": "createContainer", "path": "/x/gpuhook-hook",
                   "args": ["/x/gpuhook-hook", "cdi-hook", "update-container", "--folder", "/usr/lib/x"]}],
    },
}


def self_test() -> int:
    checks: list[tuple[str, bool, str]] = []

    def expect(name: str, ok: bool, got: object = "") -> None:
        checks.append((name, bool(ok), "" if ok else f"got {got!r}"))

    smi = parse_smi_xml(SAMPLE_XML)
    expect("xml: driver, CUDA, count", (smi["driver_version"], smi["cuda_version"], smi["attached_gpus"],
                                        len(smi["gpus"])) == ("580.95.05", "13.0", 1, 1), smi)
    g = smi["gpus"][0]
    expect("xml: GPU fields", (g["uuid"], g["pci_bus_id"], g["name"], g["minor"], g["mig_enabled"], g["memory_mib"])
           == (SAMPLE_INFO["gpus"][0]["uuid"], "0000:19:00.0", "NVIDIA H200", 0, False, 143771), g)
    same = compare(info_view(SAMPLE_INFO), smi)
    expect("xml: the matching info has no difference", same == [], same)
    other = json.loads(json.dumps(SAMPLE_INFO))
    other["cuda_version"] = "12.9"
    other["gpus"][0].update(memory_mib=143360, name="NVIDIA H200 NVL", pci_bus_id="0000:1A:00.0", mig_enabled=True)
    other["gpus"].append({"index": 1, "minor": 1, "uuid": "GPU-extra", "pci_bus_id": "0000:2a:00.0",
                          "name": "NVIDIA H200", "memory_mib": 143771, "mig_enabled": False})
    diffs = compare(info_view(other), smi)
    wanted = ["cuda_version", "GPU count", "GPU-extra", "pci_bus_id", "name", "memory_mib", "mig_enabled"]
    expect("xml: each changed field is one difference", len(diffs) == len(wanted)
           and all(any(w in d for d in diffs) for w in wanted), diffs)
    na = SAMPLE_XML.replace("<current_mig>Disabled</current_mig>", "<current_mig>N/A</current_mig>")
    expect("xml: MIG N/A equals gpuhook's false", compare(info_view(SAMPLE_INFO), parse_smi_xml(na)) == [])
    try:
        parse_smi_xml(SAMPLE_PLAIN)
        expect("xml: plain text is refused", False, "parsed")
    except ValueError:
        expect("xml: plain text is refused", True)
    text = parse_smi_text(SAMPLE_LIST, SAMPLE_PLAIN)
    expect("text: -L and the version line", (len(text["gpus"]), text["driver_version"], text["cuda_version"])
           == (2, "550.54.15", "12.4"), text)
    fake_info = {"driver_version": "550.54.15", "cuda_version": "12.4", "gpus": [
        {"index": i, "uuid": g["uuid"], "name": g["name"], "pci_bus_id": "", "minor": i, "memory_mib": 1}
        for i, g in enumerate(text["gpus"])]}
    expect("text: matching info has no difference", compare(info_view(fake_info), text) == [])
    fake_info["gpus"].reverse()
    expect("text: order is compared", any("order" in d for d in compare(info_view(fake_info), text)))
    expect("bus ids", normalize_bus_id("00000000:2A:00.0") == "0000:2a:00.0" == normalize_bus_id("0000:2a:00.0"))
    config: dict[str, Any] = {"process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]},
                              "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                                         {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}],
                              "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}}}
    applied = apply_cdi(config, SAMPLE_SPEC, "0")
    env = config["process"]["env"]
    expect("cdi: env replaced by key", env == ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=void"], env)
    paths = [d["path"] for d in config["linux"]["devices"]]
    expect("cdi: the device's node and the control node only", paths == ["/dev/nvidia0", "/dev/nvidiactl"], paths)
    rules = config["linux"]["resources"]["devices"]
    expect("cdi: allow rules after the deny-all", [r.get("access") for r in rules] == ["rwm", "rw", "rwm"]
           and rules[1] == {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"}, rules)
    dests = [m["destination"] for m in config["mounts"]]
    expect("cdi: mounts ordered by depth", dests == ["/proc", "/dev/shm", "/usr/bin/nvidia-smi",
                                                     "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"], dests)
    expect("cdi: mount type only when given", "type" not in config["mounts"][3]
           and config["mounts"][2]["type"] == "bind", config["mounts"])
    hooks = config.get("hooks", {})
    expect("cdi: hooks by hookName", list(hooks) == ["createContainer"]
           and hooks["createContainer"][0]["args"][1:3] == ["cdi-hook", "update-container"], hooks)
    expect("cdi: summary", applied["mounts"] == 2 and applied["hooks"] == {"createContainer": 1}, applied)
    try:
        apply_cdi({}, SAMPLE_SPEC, "7")
        expect("cdi: an unknown device is refused", False, "applied")
    except KeyError:
        expect("cdi: an unknown device is refused", True)
    out = ("GPU 0: NVIDIA H200 (UUID: GPU-5f3e2a10-94c1-7b2d-8e6f-0123456789ab)\nnvidia-smi-rc=0\n"
           "cuInit=0 count=1 version=13000\ngpuprobe-rc=0\n")
    problems, _ = container_findings(out, SAMPLE_INFO["gpus"][0]["uuid"])
    expect("container: a good run", problems == [], problems)
    problems, _ = container_findings("nvidia-smi-rc=9\ncuInit=100 count=0 version=0\ngpuprobe-rc=0\n", None)
    expect("container: a bad run", len(problems) == 4, problems)
    blob = b"\0libc.so.6\0libseccomp.so.2\0GLIBC_2.34\0"
    patched = patch_needed(blob)
    expect("runc: DT_NEEDED patched in place", len(patched) == len(blob) and SECCOMP_PRIVATE in patched, patched)
    expect("output names are plain", all(PLAIN_NAME.match(n) for n in OUT_NAMES) and len(OUT_NAMES) <= 8)
    for name, ok, why in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + clip(why, 400) if why else ''}")
    failures = sum(1 for _, ok, _ in checks if not ok)
    print(f"self-test: {len(checks) - failures}/{len(checks)} ok")
    return 1 if failures else 0


# --- --make-kit -------------------------------------------------------------------------------------------------


def _kit_python() -> str | None:
    candidates = sorted(Path("/root/.pyenv/versions").glob("3.12*/bin/python3"))
    found = shutil.which("python3.12")
    return str(candidates[-1]) if candidates else found


def _tests_on_path() -> None:
    """tests/ on sys.path, for its support package (the containers and probes the tests use)."""
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(1, str(TESTS_DIR))


def make_kit(folder: Path, python: str | None) -> int:
    """What the device machine lacks, in one folder to carry: wheels (gpuhook from this checkout, its
    dependencies, pytest, pip) for `python`'s version, runc and the libseccomp it links, busybox, gpuprobe."""
    python = python or _kit_python()
    if not python:
        print("make-kit: no Python 3.12 (give --kit-python)", file=sys.stderr)
        return 1
    folder = folder.resolve()
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "wheels").mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpuhook-kit-") as tmp:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                                capture_output=True, check=True).stdout.decode().split("\0")
        src = Path(tmp) / "src"
        for name in filter(None, listed):
            if name.startswith("bench/results/") or not (REPO / name).is_file():
                continue
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)  # a copy: building must not touch the shared checkout
        result = subprocess.run([python, "-m", "pip", "wheel", "-q", "--wheel-dir", str(folder / "wheels"),
                                 str(src), "pytest", "pip"], check=False)
        if result.returncode != 0:
            print("make-kit: pip wheel failed", file=sys.stderr)
            return 1
    runc = shutil.which("runc")
    if runc:
        shutil.copy2(runc, folder / "runc")
        for line in subprocess.run(["ldd", runc], capture_output=True, text=True, check=False).stdout.splitlines():
            m = re.match(r"\s*(libseccomp\.so\.\S+) => (\S+)", line)
            if m:
                shutil.copy2(os.path.realpath(m.group(2)), folder / m.group(1))
    _tests_on_path()
    from support.glibc import build_probe  # the tests' probe and busybox: the same files a test run uses

    from gpuhook.fakedriver.rootfs import find_static_busybox

    busybox = find_static_busybox()  # a dynamic one would be refused on the device (setup_busybox)
    if busybox:
        shutil.copy2(busybox, folder / "busybox")
    (folder / "gpuprobe").unlink(missing_ok=True)  # build_probe keeps one that is there
    build_probe(folder)
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    rel = folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder
    print(f"kit in {folder} ({total / 2**20:.1f} MiB): {', '.join(sorted(p.name for p in folder.iterdir()))}")
    print(f"device: bash bench/device-check.sh \"$OUT\" --wheels {rel}/wheels --runc {rel}/runc "
          f"--busybox {rel}/busybox --probe {rel}/gpuprobe    (carry: {rel})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/device-check.sh", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("outdir", nargs="?", help="where every result goes (created)")
    parser.add_argument("--simulate", action="store_true", help="on gpuhook's simulated driver (a dry run)")
    parser.add_argument("--wheels", metavar="DIR", help="install gpuhook from these wheels (pip --no-index --target)")
    parser.add_argument("--runc", metavar="PATH", help="the runc binary [default: runc on PATH]")
    parser.add_argument("--busybox", metavar="PATH", help="a static busybox [default: busybox-static's]")
    parser.add_argument("--probe", metavar="PATH", help="a prebuilt gpuprobe, used where there is no gcc")
    parser.add_argument("--nvidia-dir", default=DEFAULT_NVIDIA_DIR, metavar="DIR",
                        help="NVIDIA's files (lib64 or lib, bin) [default: %(default)s]")
    parser.add_argument("--dev-root", default="/", metavar="DIR",
                        help="device nodes' root for NVIDIA's files [default: %(default)s]")
    parser.add_argument("--proc-root", default="/proc", metavar="DIR",
                        help="procfs for NVIDIA's files [default: %(default)s]")
    parser.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT, metavar="S",
                        help="the whole run's limit [default: %(default)s]")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--self-test", action="store_true", help="check the parsers and the CDI applier; exit 0/1")
    parser.add_argument("--make-kit", nargs="?", const=str(DEFAULT_KIT), metavar="DIR",
                        help=f"build the kit to carry to the device machine [default: {DEFAULT_KIT}]")
    parser.add_argument("--kit-python", metavar="PYTHON", help="the device's Python version here [default: 3.12]")
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    if args.make_kit:
        return make_kit(Path(args.make_kit), args.kit_python)
    if not args.outdir:
        parser.error("OUTDIR is required (or --self-test / --make-kit)")
    if args.timeout < 10:
        parser.error("--timeout must be at least 10 seconds")
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
