"""An installed hook entry whose Python is gone (its #! interpreter removed: Python upgraded, the venv deleted) or
whose package is gone (gpuhook removed): a start with any sign of a GPU request fails with one line naming the fix,
a start with none succeeds untouched. The native entry decides this in `stranded()` (entry.c) when it cannot exec
the Python entry; the Python entry script in its `except ImportError` block (cli/entry.stranded_source)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.e2e import need_root, need_tool
from support.runc import busybox_rootfs, make_bundle, need_busybox, runc_run, unique_id

from gpuhook.cli import entry
from gpuhook.model import contract

FIX = "reinstall gpuhook, then run `gpuhook hook install`"
ENTRY_C = Path(entry.__file__).parents[1] / "_native" / "entry.c"
NO_SERVICE = {"GPUHOOK_SERVICE_SOCKET": "/nonexistent/gpuhook.sock", "PATH": "/usr/bin:/bin"}

GPU_SIGNS = {  # a sign model/request.py could read as a request, whatever its value
    "visible": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]},
    "void-still-counts": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]},
    "other-nvidia": {"env": ["NVIDIA_DRIVER_CAPABILITIES=compute"]},
    "legacy-cuda": {"env": ["CUDA_VERSION=12.2"]},
    "cdi-annotation": {"annotations": {"cdi.k8s.io/gpuhook": "nvidia.com/gpu=0"}},
    "device-mount": {"mounts": [{"destination": "/var/run/nvidia-container-devices/0", "source": "/dev/null",
                                 "type": "bind", "options": ["bind"]}]},
}
NO_SIGNS = {
    "plain": {"env": ["PATH=/bin", "HOME=/root"]},
    "near-misses": {"env": ["MY_NVIDIA_THING=1", "CUDA_VERSIONS=1"], "annotations": {"example.com/cdi": "x"}},
}


def write_bundle(where: Path, case: dict[str, object]) -> Path:
    where.mkdir(parents=True)
    spec = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": case.get("env", [])},
            "root": {"path": "rootfs"}, "mounts": case.get("mounts", []), "annotations": case.get("annotations", {})}
    (where / "config.json").write_text(json.dumps(spec))
    return where


def state(bundle: Path) -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1, "bundle": str(bundle)})


@pytest.fixture(scope="module")
def interpreter_gone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The native entry installed for an interpreter (a link to this one) that is then removed."""
    if entry.native_entry() is None:
        pytest.skip("the native entry was not built (no C compiler when gpuhook was installed)")
    top = tmp_path_factory.mktemp("gone")
    python = top / "venv" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    hook = top / "gpuhook-hook"
    entry.install(str(hook), python=str(python))
    python.unlink()
    return hook


@pytest.fixture(scope="module")
def package_gone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python entry script whose sys.path no longer holds gpuhook (its site-packages emptied)."""
    top = tmp_path_factory.mktemp("pkg-gone")
    (top / "site-packages").mkdir()
    script = top / "gpuhook-hook"
    script.write_text(entry.entry_script(sys.executable, [str(top / "site-packages")]))
    script.chmod(0o755)
    return script


def run_entry(hook: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(hook), *args], input=stdin, capture_output=True, text=True, env=NO_SERVICE,
                          timeout=60, check=False)


@pytest.mark.parametrize("which", ["interpreter_gone", "package_gone"])
@pytest.mark.parametrize("case", sorted(GPU_SIGNS))
def test_a_gpu_request_fails_in_one_line(request: pytest.FixtureRequest, tmp_path: Path, which: str,
                                         case: str) -> None:
    hook = request.getfixturevalue(which)
    bundle = write_bundle(tmp_path / "b", GPU_SIGNS[case])
    result = run_entry(hook, "prestart", stdin=state(bundle))
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and FIX in lines[0] and "GPU container cannot start" in lines[0], result.stderr
    if which == "interpreter_gone":  # the script is there: what is missing is its interpreter, named
        python = hook.parent / "venv" / "bin" / "python3"
        assert f"(its interpreter {python} is missing)" in lines[0], lines[0]


@pytest.mark.parametrize("which", ["interpreter_gone", "package_gone"])
@pytest.mark.parametrize("case", sorted(NO_SIGNS))
def test_no_gpu_request_starts(request: pytest.FixtureRequest, tmp_path: Path, which: str, case: str) -> None:
    hook = request.getfixturevalue(which)
    bundle = write_bundle(tmp_path / "b", NO_SIGNS[case])
    result = run_entry(hook, "--config", "/etc/gpuhook/config.toml", "prestart", stdin=state(bundle))
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("which", ["interpreter_gone", "package_gone"])
def test_what_cannot_be_read_counts_as_a_request(request: pytest.FixtureRequest, tmp_path: Path, which: str) -> None:
    hook = request.getfixturevalue(which)
    for stdin in ("", "not json", json.dumps({"id": "c1"}), state(tmp_path / "missing"),
                  state(tmp_path).replace('"bundle": "', '"bundle": "\\u002f')):
        result = run_entry(hook, "prestart", stdin=stdin)
        assert result.returncode == 1 and FIX in result.stderr, stdin
    big = write_bundle(tmp_path / "big", NO_SIGNS["plain"])
    with open(big / "config.json", "a") as f:  # one byte over the bound, past the JSON: still no reading of it
        f.truncate((64 << 20) + 1)
    assert run_entry(hook, "prestart", stdin=state(big)).returncode == 1


@pytest.mark.parametrize("which", ["interpreter_gone", "package_gone"])
def test_commands_and_cdi_hooks_always_say_so(request: pytest.FixtureRequest, tmp_path: Path, which: str) -> None:
    hook = request.getfixturevalue(which)
    bundle = write_bundle(tmp_path / "b", NO_SIGNS["plain"])
    for args in (["cdi-hook", "update-ldcache", "--folder", "/usr/lib"], ["--help"], ["generate-cdi"]):
        result = run_entry(hook, *args, stdin=state(bundle))
        assert result.returncode == 1 and FIX in result.stderr, (args, result.stderr)
        assert len(result.stderr.splitlines()) == 1


def test_native_signs_match_the_contract() -> None:
    """entry.c's byte signs name the variables, annotation prefix and mount folder model/contract.py defines."""
    text = ENTRY_C.read_text()
    block = text[text.index("STRANDED_SIGNS[] = {"):]
    signs = re.findall(r'^\s+"((?:[^"\\]|\\.)*)",', block[:block.index("};")], re.M)
    assert signs == ['\\"NVIDIA_', f'\\"{contract.LEGACY_CUDA_VERSION}=', f'\\"{contract.CDI_ANNOTATION_PREFIX}',
                     contract.VOLUME_MOUNT_DIR.rsplit("/", 1)[1]]
    assert contract.VISIBLE_DEVICES.startswith("NVIDIA_")
    overlap = int(re.search(r"#define STRANDED_OVERLAP (\d+)", text).group(1))  # type: ignore[union-attr]
    assert overlap > max(len(s) for s in signs)


@pytest.mark.e2e
def test_runc_start_with_the_interpreter_gone(interpreter_gone: Path, tmp_path: Path) -> None:
    """A real start: runc runs the stranded entry at prestart; the plain container runs, the GPU one is refused."""
    need_root()
    need_tool("runc")
    need_busybox()
    rootfs = busybox_rootfs(tmp_path)
    hooks = {"prestart": [{"path": str(interpreter_gone), "args": ["gpuhook-hook", "prestart"],
                           "env": [f"{k}={v}" for k, v in NO_SERVICE.items()]}]}
    plain = make_bundle(tmp_path / "plain", rootfs, ["echo", "started"], hooks=hooks)
    result = runc_run(plain, unique_id("stranded"))
    assert (result.returncode, result.stdout.strip()) == (0, "started"), result.stderr
    gpu = make_bundle(tmp_path / "gpu", rootfs, ["echo", "started"], env=["NVIDIA_VISIBLE_DEVICES=all"], hooks=hooks)
    result = runc_run(gpu, unique_id("stranded"))
    assert result.returncode != 0 and "started" not in result.stdout
    assert FIX in result.stderr
    assert os.path.exists(str(interpreter_gone) + ".py")


def test_doctor_reports_a_stranded_entry(tmp_path: Path) -> None:
    from gpuhook.doctor.entries import check_entries
    from gpuhook.doctor.model import OK, PROBLEM

    python = tmp_path / "venv" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    hook = tmp_path / "gpuhook-hook"
    entry.install(str(hook), python=str(python))
    (ok,) = check_entries([str(hook)])
    assert ok.status == OK and str(hook) in ok.message
    python.unlink()
    (gone,) = check_entries([str(hook)])
    assert gone.status == PROBLEM and f"its Python {python} is gone" in gone.message and gone.fix == FIX
    script = tmp_path / "script-hook"
    script.write_text(entry.entry_script(sys.executable, [str(tmp_path / "empty")]))
    script.chmod(0o755)
    (unimportable,) = check_entries([str(script)])
    assert unimportable.status == PROBLEM and "gpuhook does not import" in unimportable.message
    assert check_entries([str(tmp_path / "absent")]) == []
