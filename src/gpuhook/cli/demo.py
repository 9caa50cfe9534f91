"""`gpuhook demo`: the real pipeline on a simulated driver, for a newcomer without a GPU.

Builds a driver root in a temp dir, discovers it, generates and validates a CDI spec, and (as root, with runc
and a static busybox installed) starts a runc container whose prestart hook is gpuhook-hook asking for GPU 0.
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


def _run_container(work: Path, root: Path) -> None:
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
        click.echo(f"skipped: needs {', '.join(missing)} (apt-get install runc busybox-static; run as root)")
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

    work = Path(tempfile.mkdtemp(prefix="gpuhook-demo-"))
    try:
        _step(f"simulated driver: {gpus} GPUs, MIG on the last one ({work}/driver)")
        fake = build_fake_driver(work / "driver", gpus=gpus, mig={gpus - 1: ["3g.40gb", "3g.40gb"]} if gpus else None)
        root = Path(fake.root)
        _step("gpuhook info")
        inv = discover(Roots.make(str(root), None, str(root / "proc")))
        click.echo(format_inventory(inv))
        _step("gpuhook generate-cdi")
        hook_path = str(Path(sys.executable).with_name("gpuhook"))
        spec = build_spec(inv, hook_path=hook_path)
        problems = validate_spec(spec, "nvidia.yaml")
        (work / "nvidia.yaml").write_text(dumps(spec))
        names = [f"{spec['kind']}={d['name']}" for d in spec["devices"]]
        click.echo(f"cdiVersion {spec['cdiVersion']}, {len(names)} devices: {' '.join(names)}")
        click.echo(f"validation: {'OK' if not problems else '; '.join(problems)}  (spec: {work}/nvidia.yaml)")
        _step("a container with the prestart hook")
        _run_container(work, root)
    finally:
        if keep:
            click.echo(f"\nkept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
