"""The inventory cache is a hint: nothing at its path, and no driver change racing a scan, can make a start
accept what is not there.

The driver changes during a scan by a wrapper around one discovery step (`all_files`, which runs after the
GPUs and their nodes are read and before discover() takes its fingerprint), the way a driver finishing its load
or a MIG reconfiguration lands in the middle of a real scan.
"""

from __future__ import annotations

import json
import os
import stat
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


# --- only a cache root alone could have written is used ------------------------------------

FORGED_HOST_FILE = "/etc/shadow"


def forge(good: Inventory) -> dict[str, Any]:
    """The genuine cache with one more "config" file: the host's /etc/shadow, which a start would bind."""
    data = good.to_dict()
    data["files"].append({"kind": "config", "capability": "utility", "path": "/etc/forged",
                          "host_path": FORGED_HOST_FILE})
    return data


def _pty_link(path: Path) -> None:
    master, slave = os.openpty()
    path.symlink_to(os.ttyname(slave))  # kept open until the test ends: the pty must exist
    _PTYS.extend([master, slave])


_PTYS: list[int] = []
HOSTILE_CACHES: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "group-writable": lambda p, d: (p.write_text(json.dumps(d)), p.chmod(0o664)),
    "world-writable": lambda p, d: (p.write_text(json.dumps(d)), p.chmod(0o646)),
    "not-root-owned": lambda p, d: (p.write_text(json.dumps(d)), os.chown(p, 65534, 65534)),
    "link-to-a-cache": lambda p, d: ((p.parent / "real.json").write_text(json.dumps(d)),
                                     p.symlink_to(p.parent / "real.json")),
    "link-to-a-pty": lambda p, d: _pty_link(p),
    "sparse-1gib": lambda p, d: (p.write_text(json.dumps(d)), os.truncate(p, 1 << 30)),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_CACHES))
def test_an_untrusted_cache_is_ignored_with_one_note(fake_driver: Any, tmp_path: Path, kind: str) -> None:
    """A forged cache with the right fingerprint is used only when root alone could have written it; else it
    costs one note and a rediscovery, in bounded time and memory (a pty at the path hung the start, a 1 GiB
    sparse file cost 3.1 GiB). A regular file is replaced by the rediscovered cache (root's, 0644); a link is
    left as it is (nothing is written through it, nor over it)."""
    if os.geteuid() != 0:
        pytest.skip("ownership checks need root")
    good = cache.inventory(roots(fake_driver), str(tmp_path / "good.json"))
    path = tmp_path / "inventory.json"
    HOSTILE_CACHES[kind](path, forge(good))
    before = path.lstat()
    try:
        notes: list[str] = []
        inv = cache.inventory(roots(fake_driver), str(path), notes)
    finally:
        while _PTYS:
            os.close(_PTYS.pop())
    assert FORGED_HOST_FILE not in {f.host_path for f in inv.files}
    whole(inv)
    assert notes and all("ignored" in n for n in notes), notes
    after = path.lstat()
    if kind.startswith("link"):
        assert len(notes) == 2 and "not written" in notes[1], notes
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    else:
        assert len(notes) == 1, notes
        assert (after.st_uid, stat.S_IMODE(after.st_mode), after.st_size < 1 << 20) == (0, 0o644, True)
        assert cache.load_fresh(str(path), roots(fake_driver)) is not None


@pytest.mark.parametrize("kind", ["folder-is-a-link", "folder-world-writable", "folder-not-root-owned"])
def test_a_cache_in_an_untrusted_folder_is_neither_read_nor_written(fake_driver: Any, tmp_path: Path,
                                                                     kind: str) -> None:
    """A link in place of the cache folder made root create inventory.json anywhere; a folder others can write
    lets them replace the cache. Neither is read nor written."""
    if os.geteuid() != 0:
        pytest.skip("ownership checks need root")
    good = cache.inventory(roots(fake_driver), str(tmp_path / "good.json"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = tmp_path / "cache"
    if kind == "folder-is-a-link":
        folder.symlink_to(elsewhere)
        os.lchown(folder, 65534, 65534)
    else:
        folder.mkdir()
        if kind == "folder-world-writable":
            folder.chmod(0o777)
        else:
            os.chown(folder, 65534, 65534)
    target = elsewhere if kind == "folder-is-a-link" else folder
    (target / "inventory.json").write_text(json.dumps(forge(good)))
    before = (target / "inventory.json").read_text()
    notes: list[str] = []
    inv = cache.inventory(roots(fake_driver), str(folder / "inventory.json"), notes)
    assert FORGED_HOST_FILE not in {f.host_path for f in inv.files}
    assert (target / "inventory.json").read_text() == before, "the cache was written through the folder"
    assert sorted(p.name for p in target.iterdir()) == ["inventory.json"]
    assert notes and all("ignored" in n for n in notes), notes


def test_a_trusted_cache_is_used_and_a_missing_folder_made(fake_driver: Any, tmp_path: Path) -> None:
    """The control: a root-owned 0644 cache in a root-owned folder is used; missing folders are created."""
    path = tmp_path / "a/b/inventory.json"
    notes: list[str] = []
    first = cache.inventory(roots(fake_driver), str(path), notes)
    assert path.is_file() and notes == []
    assert cache.load_fresh(str(path), roots(fake_driver), notes) == first and notes == []
