"""`gpuhook demo`: the real pipeline on a simulated driver, for a newcomer without a GPU.

Builds a driver root in a temp dir, discovers it, generates and validates a CDI spec, and (as root, with runc
and a static busybox installed) starts a runc container whose prestart hook is gpuhook-hook asking for GPU 0.
It ends with a verdict (what worked, what was skipped and why; exit 1 if a step failed) and says why ENXIO on
the simulated node is success: a newcomer reads "No such device or address" as a failure otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from gpuhook.model.record import Record, field

CONTAINER_SCRIPT = (
    "echo '  /dev:' $(ls /dev | grep nvidia); "
    "echo -n '  open /dev/nvidia0: '; cat /dev/nvidia0 2>&1 | head -1 | sed 's/^cat: //'; "
    "echo '  libcuda.so.1 ->' $(readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1); "
    "echo '  mount:' $(grep libcuda.so.5 /proc/self/mountinfo | cut -d' ' -f5,6)"
)


def _step(title: str) -> None:
    click.secho(f"\n== {title}", bold=True)


def _bundle(work: Path, hook: str, config: Path) -> Path:
    from gpuhook.fakedriver.rootfs import busybox_rootfs

    rootfs = busybox_rootfs(work / "bundle/rootfs")
    (rootfs / "usr/lib/x86_64-linux-gnu").mkdir(parents=True, exist_ok=True)
    spec = {
        "ociVersion": "1.0.2",
        "process": {
            "args": ["sh", "-c", CONTAINER_SCRIPT],
            "cwd": "/",
            "user": {"uid": 0, "gid": 0},
            "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0"],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        ],
        "hooks": {
            "prestart": [
                {
                    "path": hook,
                    "args": ["gpuhook-hook", "--config", str(config), "prestart"],
                    "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
                }
            ]
        },
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts")],
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
        },
    }
    (work / "bundle/config.json").write_text(json.dumps(spec, indent=2))
    return work / "bundle"


ENXIO_NOTE = (
    "\"No such device or address\" on /dev/nvidia0 is the expected success: the simulated GPU node has the real\n"
    "major:minor of an NVIDIA GPU, but no NVIDIA kernel module is loaded here. Opening it passed the container's\n"
    "device cgroup (which the hook opened for it) and only then found no driver (ENXIO). A node the container\n"
    "did not get would say \"No such file or directory\", one the cgroup refused \"Operation not permitted\"."
)


class Verdict(Record, frozen=False):
    """What each step of the demo came to: (status, step, detail), status ok | skipped | failed."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, status: str, step: str, detail: str) -> None:
        self.rows.append((status, step, detail))

    @property
    def failed(self) -> bool:
        return any(status == "failed" for status, _, _ in self.rows)

    def render(self) -> str:
        return "\n".join(f"  {status:<8} {step}: {detail}" for status, step, detail in self.rows)


def _run_container(work: Path, root: Path, verdict: Verdict) -> None:
    from gpuhook.errors import clip
    from gpuhook.fakedriver.rootfs import find_static_busybox

    hook = str(Path(sys.executable).with_name("gpuhook-hook"))
    busybox = find_static_busybox()
    missing = [
        what
        for what, ok in (
            ("root", os.geteuid() == 0),
            ("runc", shutil.which("runc")),
            ("static busybox", busybox),
            ("gpuhook-hook", os.path.exists(hook)),
        )
        if not ok
    ]
    if missing:
        why = f"needs {', '.join(missing)} (apt-get install runc busybox-static; run as root)"
        click.echo(f"skipped: {why}")
        verdict.add("skipped", "container with the prestart hook", why)
        return
    config = work / "config.toml"
    config.write_text(
        f'driver-root = "{root}"\nproc-root = "{root}/proc"\nlog-file = "{work}/gpuhook.log"\n'
        f'inventory-cache = "{work}/inventory.json"\n'
    )
    bundle = _bundle(work, hook, config)
    click.echo("runc run with NVIDIA_VISIBLE_DEVICES=0 and gpuhook-hook as prestart hook:")
    cid = f"gpuhook-demo-{os.getpid()}"
    try:
        result = subprocess.run(
            ["runc", "run", "--bundle", str(bundle), cid],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    finally:
        subprocess.run(["runc", "delete", "-f", cid], capture_output=True, check=False)
    click.echo(result.stdout.rstrip() or result.stderr.rstrip())
    log = work / "gpuhook.log"
    if log.exists():
        click.echo("  hook log: " + log.read_text().strip().splitlines()[-1])
    seen = result.stdout.split("open /dev/nvidia0:", 1)[-1].splitlines()[0].strip() if result.stdout else ""
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        verdict.add("failed", "container with the prestart hook", f"runc failed: {clip(last, quote=False)}")
    elif seen.endswith("No such device or address") and "libcuda.so.1 -> libcuda.so." in result.stdout:
        verdict.add("ok", "container with the prestart hook",
                    "it saw GPU 0's node and the driver libraries; opening the node gave ENXIO, as it should here")
    else:
        verdict.add("failed", "container with the prestart hook",
                    f"opening /dev/nvidia0 gave {clip(seen or 'nothing', quote=False)} (ENXIO expected), or "
                    "libcuda.so.1 is missing")


@click.command()
@click.option("--gpus", default=2, show_default=True, help="Simulated GPUs.")
@click.option("--keep", is_flag=True, help="Keep the temp dir (printed) for a look around.")
def demo(gpus: int, keep: bool) -> None:
    """The real pipeline (discovery, CDI, the prestart hook in runc) on a simulated driver."""
    from gpuhook.cdi.codec import dumps
    from gpuhook.cdi.spec import build_spec
    from gpuhook.cdi.validate import validate_spec
    from gpuhook.discover import Roots, discover
    from gpuhook.fakedriver import build_fake_driver
    from gpuhook.model.report import format_inventory

    verdict = Verdict()
    work = Path(tempfile.mkdtemp(prefix="gpuhook-demo-"))
    try:
        _step(f"simulated driver: {gpus} GPUs, MIG on the last one ({work}/driver)")
        fake = build_fake_driver(work / "driver", gpus=gpus, mig={gpus - 1: ["3g.40gb", "3g.40gb"]} if gpus else None)
        root = Path(fake.root)
        _step("gpuhook info")
        inv = discover(Roots.make(str(root), None, str(root / "proc")))
        click.echo(format_inventory(inv))
        verdict.add("ok", "discovery", f"{len(inv.gpus)} GPUs and {len(inv.files)} driver files through {inv.source}")
        _step("gpuhook generate-cdi")
        hook_path = str(Path(sys.executable).with_name("gpuhook"))
        spec = build_spec(inv, hook_path=hook_path)
        problems = validate_spec(spec, "nvidia.yaml")
        (work / "nvidia.yaml").write_text(dumps(spec))
        names = [f"{spec['kind']}={d['name']}" for d in spec["devices"]]
        click.echo(f"cdiVersion {spec['cdiVersion']}, {len(names)} devices: {' '.join(names)}")
        click.echo(f"validation: {'OK' if not problems else '; '.join(problems)}  (spec: {work}/nvidia.yaml)")
        if problems:
            verdict.add("failed", "CDI spec", "; ".join(problems))
        else:
            verdict.add("ok", "CDI spec", f"cdiVersion {spec['cdiVersion']}, {len(names)} devices, valid")
        _step("a container with the prestart hook")
        _run_container(work, root, verdict)
    finally:
        if keep:
            click.echo(f"\nkept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    _step("verdict")
    click.echo(verdict.render())
    click.echo("\n" + ENXIO_NOTE)
    if verdict.failed:
        raise click.exceptions.Exit(1)
