"""The inventory cache is a hint: nothing at its path, and no driver change racing a scan, can make a start
accept what is not there (issue 12, faults B and D).

The driver changes during a scan by a wrapper around one discovery step (`all_files`, which runs after the
GPUs and their nodes are read and before discover() takes its fingerprint), the way a driver finishing its load
or a MIG reconfiguration lands in the middle of a real scan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gpuhook.discover.scan as discovery
from gpuhook.discover import Roots, cache
from gpuhook.model import record
from gpuhook.model.inventory import Inventory


def roots(fake: Any) -> Roots:
    return Roots.make(str(fake.root), None, str(Path(fake.root) / "proc"))


def during_scan(monkeypatch: pytest.MonkeyPatch, change: Callable[[int], None]) -> None:
    """Run `change(n)` in the middle of the n-th scan (n from 1)."""
    real = discovery.all_files
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        change(calls[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(discovery, "all_files", wrapped)


def whole(inv: Inventory) -> None:
    assert all(g.node is not None for g in inv.gpus)
    assert all(len(m.cap_nodes) == 2 for m in inv.all_mig_devices())


def test_nodes_appearing_during_the_scan_are_not_cached_missing(fake_driver_factory: Any, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver finishes creating /dev/nvidia1 while the first scan runs: that scan saw no node, its
    fingerprint (taken after) sees one; storing it would give every later start a GPU without its node."""
    fake = fake_driver_factory(gpus=2, fresh=True)
    node = fake.root / "dev/nvidia1"
    away = fake.root / "dev/away-nvidia1"
    node.rename(away)
    during_scan(monkeypatch, lambda n: away.rename(node) if n == 1 else None)
    path = tmp_path / "inventory.json"
    inv = cache.inventory(roots(fake), str(path))
    whole(inv)
    assert len(inv.gpus) == 2
    stored = cache.load_fresh(str(path), roots(fake))
    assert stored is not None, "the second, stable scan is cached"
    whole(stored)


def test_a_driver_that_keeps_changing_is_never_cached(fake_driver_factory: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_driver_factory(gpus=2, fresh=True)
    node = fake.root / "dev/nvidia1"
    away = fake.root / "dev/away-nvidia1"

    def flip(_n: int) -> None:
        if node.exists():
            node.rename(away)
        else:
            away.rename(node)

    during_scan(monkeypatch, flip)
    path = tmp_path / "inventory.json"
    cache.inventory(roots(fake), str(path))
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_a_mig_layout_changing_during_the_scan_is_not_cached(fake_driver_factory: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """MIG instances destroyed mid-scan: the scan holds MIG devices that no longer exist."""
    fake = fake_driver_factory(gpus=2, mig={1: ["1g.10gb", "1g.10gb"]}, fresh=True)
    caps = fake.root / "proc/driver/nvidia/capabilities"
    mig = next(caps.glob("gpu*/mig"))
    gone = tmp_path / "gone"

    def destroy(n: int) -> None:
        if n == 1:
            mig.rename(gone)

    during_scan(monkeypatch, destroy)
    path = tmp_path / "inventory.json"
    inv = cache.inventory(roots(fake), str(path))
    assert not path.exists(), "MIG devices without their nvidia-caps nodes are never cached"
    assert "has no nvidia-caps device nodes" in inv.incomplete(), "a start asking for one fails instead"


@pytest.mark.parametrize("damage", ["gpu-node", "mig-caps", "driver-version"])
def test_a_cache_missing_what_a_start_needs_is_rediscovered_and_replaced(
        fake_driver_factory: Any, tmp_path: Path, damage: str) -> None:
    """A cache poisoned before this fix (right fingerprint, incomplete content) is not trusted."""
    fake = fake_driver_factory(gpus=2, mig={1: ["1g.10gb"]})
    path = tmp_path / "inventory.json"
    good = cache.inventory(roots(fake), str(path))
    whole(good)
    gpus = list(good.gpus)
    if damage == "gpu-node":
        gpus[0] = record.replace(gpus[0], node=None)
    elif damage == "mig-caps":
        gpus[1] = record.replace(gpus[1], mig_devices=tuple(
            record.replace(m, cap_nodes=()) for m in gpus[1].mig_devices))
    bad = record.replace(good, gpus=gpus, driver_version="" if damage == "driver-version" else
                              good.driver_version)
    path.write_text(json.dumps(bad.to_dict()))
    assert cache.load_fresh(str(path), roots(fake)) is None
    again = cache.inventory(roots(fake), str(path))
    whole(again)
    assert json.loads(path.read_text()) == json.loads(json.dumps(good.to_dict())), "the damaged cache was replaced"


def test_a_deeply_nested_cache_is_rediscovered_and_replaced(fake_driver: Any, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    inv = cache.inventory(roots(fake_driver), str(path))
    whole(inv)
    assert cache.load_fresh(str(path), roots(fake_driver)) is not None


def test_a_directory_at_the_cache_path_leaves_no_temp_file(fake_driver: Any, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.mkdir()
    for _ in range(3):
        whole(cache.inventory(roots(fake_driver), str(path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.json"]
    assert path.is_dir() and not any(path.iterdir())


def test_temp_files_of_a_killed_writer_are_cleaned_up(fake_driver: Any, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    child = subprocess.Popen(["true"])
    child.wait()  # a writer killed mid-write left its (empty) temp file
    (tmp_path / f".inventory.json.{child.pid}.0123456789ab.tmp").write_bytes(b"")
    cache.inventory(roots(fake_driver), str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.json"]


def test_a_fifo_at_the_cache_path_does_not_block(fake_driver: Any, tmp_path: Path) -> None:
    """Nothing writes to the FIFO: a blocking open would wait for a writer until the runtime's hook timeout.
    The check runs in a child (with a generous guard, not a speed limit) so a regression cannot hang the suite."""
    path = tmp_path / "inventory.json"
    os.mkfifo(path)
    code = ("import sys; from gpuhook.discover import Roots, cache; "
            f"inv = cache.inventory(Roots.make({str(fake_driver.root)!r}, None, {str(fake_driver.root / 'proc')!r}),"
            f" {str(path)!r}); print(len(inv.gpus))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "2", result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.json"]
