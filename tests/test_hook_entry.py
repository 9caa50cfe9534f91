"""The lean hook entry (`gpuhook hook install`) and the fast paths behind it.

The entry script starts `python -IS` with two sys.path entries; it must run the prestart hook (no-GPU fast path
and a real runc container with a GPU) and the CDI spec's `cdi-hook` calls exactly as the full commands do.
The fast paths it relies on (quick_skip, the JSON loader without `json`, the config subset without tomllib)
must give what the full paths give, which is checked against them here.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.e2e import need_root, need_tool
from support.glibc import glibc_rootfs
from support.runc import busybox_rootfs, make_bundle, need_busybox, runc_run, unique_id
from test_hook_e2e import PROBE, nodes, write_config

import gpuhook
from gpuhook import _native
from gpuhook.cli import entry as hook_entry
from gpuhook.errors import GpuhookError
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.hook import prestart as hook
from gpuhook.hook.config import Config, load_config, parse_config, parse_simple
from gpuhook.hook.installed import is_ours

WATCHED = ("yaml", "jsonschema", "click", "grpc", "pynvml")
HOOK_ENV = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]


@pytest.fixture(scope="module")
def entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(hook_entry.install(str(tmp_path_factory.mktemp("entry") / "bin" / "gpuhook-hook"))[0])


def state(bundle: Path, cid: str = "c1", pid: int = 1) -> bytes:
    return json.dumps({"ociVersion": "1.0.2", "id": cid, "pid": pid, "status": "creating",
                       "bundle": str(bundle)}).encode()  # fmt: skip


def bundle_dir(tmp: Path, env: list[str], **config: Any) -> Path:
    bundle = tmp / "bundle"
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    spec = {"root": {"path": "rootfs"}, "process": {"env": ["PATH=/bin", *env]}, **config}
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def run_entry(entry: Path, args: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(entry), *args], input=stdin, capture_output=True, timeout=60, check=False)


# --- the installed script -------------------------------------------------------------------------------------


def script_of(entry: Path) -> Path:
    """The Python entry script: beside the native entry (PATH.py) when that was built, else PATH itself."""
    return entry.with_name(entry.name + ".py") if hook_entry.native_entry() else entry


def test_script_starts_python_isolated_with_exact_paths(entry: Path) -> None:
    script = script_of(entry)
    text = script.read_text()
    assert text.splitlines()[0] == f"#!{sys.executable} -IS"  # one word after the interpreter: Linux passes one
    assert stat.S_IMODE(entry.stat().st_mode) == 0o755 and stat.S_IMODE(script.stat().st_mode) == 0o755
    paths = hook_entry.search_paths()
    assert f"sys.path += {paths!r}" in text
    assert (Path(paths[0]) / "gpuhook" / "__init__.py").is_file()
    assert any(name.startswith("_cffi_backend") for name in os.listdir(paths[-1]))
    names = sorted(p.name for p in entry.parent.iterdir())  # no temp file left behind
    assert names == sorted({"gpuhook-hook", script.name})


def test_install_replaces_atomically_through_the_cli(tmp_path: Path) -> None:
    from gpuhook.cli.app import main

    target = tmp_path / "gpuhook-hook"
    target.write_text("old")
    before = target.stat().st_ino
    assert main(["hook", "install", "--path", str(target)]) == 0
    assert script_of(target).read_text().startswith("#!") and target.stat().st_ino != before
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_docker_gpus_install_writes_nvidias_name_and_never_replaces_a_foreign_one(tmp_path: Path) -> None:
    """`docker run --gpus` runs `nvidia-container-runtime-hook prestart` from dockerd's PATH."""
    from gpuhook.cli.app import main

    target = tmp_path / "bin" / "gpuhook-hook"
    target.parent.mkdir()
    docker = target.parent / "nvidia-container-runtime-hook"
    assert main(["hook", "install", "--path", str(target), "--docker-gpus"]) == 0
    assert docker.read_bytes() == target.read_bytes() and stat.S_IMODE(docker.stat().st_mode) == 0o755
    assert script_of(docker).read_text() == script_of(target).read_text()
    assert main(["hook", "install", "--path", str(target), "--docker-gpus"]) == 0  # ours: replaced again
    docker.write_text("#!/bin/sh\n# NVIDIA's nvidia-container-runtime-hook\n")
    target.unlink()
    with pytest.raises(GpuhookError, match="is not gpuhook's .*not replaced"):
        hook_entry.install(str(target), docker_gpus=True)
    assert docker.read_text().startswith("#!/bin/sh") and not target.exists()  # nothing written at all
    docker.unlink()
    docker.symlink_to("/usr/bin/true")  # a link is never ours: replacing it would replace its target for its owner
    with pytest.raises(GpuhookError, match="not replaced"):
        hook_entry.install(str(target), docker_gpus=True)
    assert docker.is_symlink()


def test_runtime_configure_docker_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuhook.cli.app import main

    target = tmp_path / "gpuhook-hook"
    assert main(["runtime", "configure", "--runtime", "docker", "--mode", "gpus", "--hook-path", str(target)]) == 0
    assert "restart dockerd" in capsys.readouterr().out and (tmp_path / "nvidia-container-runtime-hook").is_file()
    assert main(["runtime", "configure", "--runtime", "podman", "--mode", "gpus"]) == 1
    assert "Docker's --gpus route" in capsys.readouterr().err


def test_hook_reads_gpuhook_config_from_the_environment(tmp_path: Path, entry: Path) -> None:
    """Docker's --gpus passes no --config, but dockerd's environment: GPUHOOK_CONFIG names the file."""
    config = write_config(tmp_path, Path("/"))
    env = {**os.environ, "GPUHOOK_CONFIG": str(config)}
    result = subprocess.run([str(entry), "prestart"], input=state(bundle_dir(tmp_path, [])), capture_output=True,
                            timeout=60, check=False, env=env)
    assert result.returncode == 0, result.stderr
    assert " skip request=unset took=" in (tmp_path / "gpuhook.log").read_text()


def test_install_refuses_an_interpreter_a_shebang_cannot_carry(tmp_path: Path) -> None:
    with pytest.raises(GpuhookError, match="whitespace"):
        hook_entry.install(str(tmp_path / "h"), python="/opt/my python/bin/python3")
    with pytest.raises(GpuhookError, match="too long"):
        hook_entry.install(str(tmp_path / "h"), python="/" + "p" * 300)
    assert not (tmp_path / "h").exists()


def test_works_from_a_non_editable_layout(tmp_path: Path) -> None:
    """gpuhook copied into a plain site directory (as a wheel installs it): the script points there."""
    site = tmp_path / "site"
    shutil.copytree(Path(gpuhook.__file__).parent, site / "gpuhook", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "gpuhook-hook"
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); import gpuhook.cli.entry as h; "
            f"assert h.__file__.startswith({str(site)!r}); h.install({str(target)!r})")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)
    assert f"sys.path += [{str(site)!r}, " in script_of(target).read_text()
    config = write_config(tmp_path, Path("/"))
    result = run_entry(target, ["--config", str(config)], state(bundle_dir(tmp_path, [])))
    assert result.returncode == 0, result.stderr
    assert " skip request=unset took=" in (tmp_path / "gpuhook.log").read_text()


# --- the prestart hook through the entry ------------------------------------------------------------------------


def test_no_gpu_fast_path(entry: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, Path("/nonexistent-driver"))  # never looked at for a container without GPU
    result = run_entry(entry, ["--config", str(config), "prestart"], state(bundle_dir(tmp_path, []), "plain-1"))
    assert result.returncode == 0 and result.stderr == b""
    (line,) = (tmp_path / "gpuhook.log").read_text().splitlines()
    assert " plain-1 skip request=unset took=" in line


def test_no_gpu_fast_path_imports_only_the_basics(entry: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, Path("/"))
    result = subprocess.run([sys.executable, "-IS", "-X", "importtime", str(script_of(entry)), "--config",
                             str(config)],
                            input=state(bundle_dir(tmp_path, [])), capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.decode().splitlines() if "|" in line}
    assert not imported & {"dataclasses", "inspect", "typing", "tomllib", "gpuhook.model.request"}


def test_errors_keep_their_wording(entry: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, Path("/"))
    bad = run_entry(entry, ["--config", str(config)], b'{"id": "x", "bundle": "relative"}')
    assert bad.returncode == 1 and b"gpuhook-hook: OCI state: invalid bundle 'relative'" in bad.stderr
    missing = run_entry(entry, ["--config", str(tmp_path / "absent.toml")], b"{}")
    assert missing.returncode == 1 and b"config file" in missing.stderr and b"not found" in missing.stderr
    usage = run_entry(entry, ["--bogus"])
    assert usage.returncode == 1 and b"unexpected argument '--bogus'" in usage.stderr


BIG = 200_000  # under the request bound (256 KiB per value): these reach the per-item checks


@pytest.mark.parametrize(("env", "annotations", "words"), [
    ([f"NVIDIA_VISIBLE_DEVICES=GPU-{'a' * BIG}"], {}, "unknown device 'GPU-aaa"),
    (["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_DRIVER_CAPABILITIES={'x' * BIG}"], {}, "unknown driver capability"),
    (["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_REQUIRE_CUDA=cuda>={'1x' * (BIG // 2)}"], {}, "invalid requirement"),
    (["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_REQUIRE_CUDA=cuda>=99.{'0' * BIG}"], {}, "unsatisfied requirement"),
    (["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_REQUIRE_CUDA={','.join(['cuda>=99.0'] * (BIG // 11))}"], {},
     "hold more than 4096 conditions"),
    ([f"CUDA_VERSION={'x' * BIG}"], {}, "invalid CUDA_VERSION"),
    ([], {"cdi.k8s.io/x": f"nvidia.com/gpu={'b' * BIG}"}, "unknown device 'bbb"),
], ids=["device", "capability", "requirement", "unmet-requirement", "conditions", "cuda-version",
        "annotation"])  # fmt: skip
def test_image_values_are_clipped_in_every_message(entry: Path, tmp_path: Path, fake_driver: Any, env: list[str],
                                                   annotations: dict[str, str], words: str) -> None:
    """An image-supplied value is echoed clipped (errors.clip): 200 KB in a variable must not become a
    200 KB stderr line and log line."""
    config = write_config(tmp_path, Path(fake_driver.root))
    bundle = bundle_dir(tmp_path, env, annotations=annotations)
    result = run_entry(entry, ["--config", str(config)], state(bundle))
    err = result.stderr.decode()
    assert result.returncode == 1 and err.startswith("gpuhook-hook: ") and words in err, err[:500]
    assert err.count("\n") == 1 and len(err) < 1000, err[:2000]
    log = (tmp_path / "gpuhook.log").read_text().splitlines()
    assert len(log) == 1 and words in log[0] and len(log[0]) < 1200, log[0][:2000]


@pytest.fixture()
def runc_e2e(tmp_path: Path) -> Path:
    need_root()
    need_tool("runc")
    need_busybox()
    return tmp_path


@pytest.mark.e2e
def test_runc_container_with_one_gpu_through_the_entry(runc_e2e: Path, entry: Path, fake_driver: Any) -> None:
    """A real container: node, libraries, ld cache, CUDA sees one GPU; with a warm cache no heavy module loads."""
    tmp = runc_e2e
    config = write_config(tmp, Path(fake_driver.root))
    traces = tmp / "traces"
    traces.mkdir()
    traced = tmp / "traced-hook"
    traced.write_text(f'#!/bin/sh\nexec {sys.executable} -IS -X importtime {script_of(entry)} "$@" 2>"{traces}/$$"\n')
    traced.chmod(0o755)
    for round_, hook_path in enumerate((entry, traced)):  # the first start fills the inventory cache
        work = tmp / f"run{round_}"
        rootfs = glibc_rootfs(work, probe_cache=tmp / "probe")
        hooks = {"prestart": [{"path": str(hook_path), "args": ["gpuhook-hook", "--config", str(config), "prestart"],
                               "env": HOOK_ENV}]}  # fmt: skip
        bundle = make_bundle(work, rootfs, ["sh", "-c", PROBE], env=["NVIDIA_VISIBLE_DEVICES=1"], hooks=hooks)
        result = runc_run(bundle, unique_id("entry"))
        assert result.returncode == 0, result.stderr
        assert nodes(result.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
        assert "cuInit=0 count=1 version=12040" in result.stdout
    log = (tmp / "gpuhook.log").read_text().splitlines()
    assert len(log) == 2 and all(" inject devices=" in line for line in log)
    (trace,) = traces.iterdir()
    imported = {line.split("|")[-1].strip() for line in trace.read_text().splitlines() if "|" in line}
    assert "gpuhook.inject.apply" in imported
    assert not {m.split(".")[0] for m in imported} & set(WATCHED)


# --- cdi-hook through the entry: the click command's results and messages ---------------------------------------


def cdi_twins(tmp: Path) -> list[tuple[Path, bytes]]:
    out = []
    for name in ("lean", "click"):
        bundle = tmp / name
        busybox_rootfs(bundle)
        (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}}))
        out.append((bundle, state(bundle)))
    return out


def click_cdi_hook(args: list[str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "gpuhook.cli", "cdi-hook", *args], input=stdin,
                          capture_output=True, timeout=60, check=False)  # fmt: skip


def test_cdi_hook_create_symlinks_as_click(entry: Path, tmp_path: Path) -> None:
    args = ["create-symlinks", "--link", "libcuda.so.550::/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "--link=libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"]  # fmt: skip
    (lean, lean_state), (ref, ref_state) = cdi_twins(tmp_path)
    assert run_entry(entry, ["cdi-hook", *args], lean_state).returncode == 0
    assert click_cdi_hook(args, ref_state).returncode == 0
    for bundle in (lean, ref):
        libdir = bundle / "rootfs/usr/lib/x86_64-linux-gnu"
        assert os.readlink(libdir / "libcuda.so.1") == "libcuda.so.550"
        assert os.readlink(libdir / "libcuda.so") == "libcuda.so.1"


def test_cdi_hook_update_ldcache_as_click(entry: Path, tmp_path: Path) -> None:
    need_root()
    (lean, lean_state), (ref, ref_state) = cdi_twins(tmp_path)
    args = ["update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"]
    lean_result = run_entry(entry, ["cdi-hook", *args], lean_state)
    assert lean_result.returncode == 0, lean_result.stderr
    assert click_cdi_hook(args, ref_state).returncode == 0
    for bundle in (lean, ref):
        assert (bundle / "rootfs/etc/ld.so.cache").is_file()
        assert (bundle / "rootfs/etc/ld.so.conf.d/00-gpuhook.conf").read_text() == "/usr/lib/x86_64-linux-gnu\n"


def test_cdi_hook_update_container_as_click(entry: Path, tmp_path: Path) -> None:
    """What gpuhook's specs call: links then the ld cache, in one process."""
    need_root()
    (lean, lean_state), (ref, ref_state) = cdi_twins(tmp_path)
    src = tmp_path / "cuda.c"
    src.write_text("int cuInit(unsigned f) { return (int)f; }\n")
    for bundle in (lean, ref):  # a real library behind the link: ldconfig drops dangling soname links
        libdir = bundle / "rootfs/usr/lib/x86_64-linux-gnu"
        libdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(libdir / "libcuda.so.550"),
                        str(src)], check=True, capture_output=True)
    args = ["update-container", "--link", "libcuda.so.550::/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "--folder", "/usr/lib/x86_64-linux-gnu"]  # fmt: skip
    lean_result = run_entry(entry, ["cdi-hook", *args], lean_state)
    assert lean_result.returncode == 0, lean_result.stderr
    assert click_cdi_hook(args, ref_state).returncode == 0
    for bundle in (lean, ref):
        assert os.readlink(bundle / "rootfs/usr/lib/x86_64-linux-gnu/libcuda.so.1") == "libcuda.so.550"
        assert (bundle / "rootfs/etc/ld.so.conf.d/00-gpuhook.conf").read_text() == "/usr/lib/x86_64-linux-gnu\n"


def test_cdi_hook_cuda_compat_as_click(entry: Path, tmp_path: Path) -> None:
    """--host-driver-version: an image's compat libcuda of a newer driver major goes first (00-compat conf and
    the first ld cache entry), in the lean entry and in click alike."""
    need_root()
    (lean, lean_state), (ref, ref_state) = cdi_twins(tmp_path)
    src = tmp_path / "cuda.c"
    src.write_text("int cuInit(unsigned f) { return (int)f; }\n")
    for bundle in (lean, ref):
        for folder, name in (("usr/lib/x86_64-linux-gnu", "libcuda.so.535.309.01"),
                             ("usr/local/cuda/compat", "libcuda.so.550.54.15")):
            (bundle / "rootfs" / folder).mkdir(parents=True, exist_ok=True)
            subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                            str(bundle / "rootfs" / folder / name), str(src)], check=True, capture_output=True)
    args = ["update-container", "--folder", "/usr/lib/x86_64-linux-gnu", "--host-driver-version", "535.309.01"]
    lean_result = run_entry(entry, ["cdi-hook", *args], lean_state)
    assert lean_result.returncode == 0, lean_result.stderr
    assert click_cdi_hook(args, ref_state).returncode == 0
    for bundle in (lean, ref):
        conf = bundle / "rootfs/etc/ld.so.conf.d/00-compat-gpuhook.conf"
        assert conf.read_text() == "/usr/local/cuda/compat\n"
        entries = [e for e in _native.read_ldcache(str(bundle / "rootfs/etc/ld.so.cache")) if e.key == "libcuda.so.1"]
        assert entries[0].value == "/usr/local/cuda/compat/libcuda.so.1", entries


@pytest.mark.parametrize("args", [
    ["update-container", "--link", "a::relative"],
    ["update-container", "--folder", "relative"],
    ["create-symlinks", "--link", "no-separator"],
    ["create-symlinks", "--link", "a::relative"],
    ["create-symlinks", "--bogus"],
    ["create-symlinks", "--link"],
    ["update-ldcache", "--folder", "relative"],
    ["update-ldcache", "--ldconfig-path", "/a", "--ldconfig-path", "/b", "--help"],
    ["update-ldcache", "extra"],
    ["update-container", "--host-driver-version", "5x5"],
    ["update-ldcache", "--host-driver-version", "535", "--host-driver-version", "550"],
    ["no-such-hook"],
    [],
])  # fmt: skip
def test_cdi_hook_usage_errors_are_clicks(entry: Path, tmp_path: Path, args: list[str]) -> None:
    lean = run_entry(entry, ["cdi-hook", *args], b"{}")
    ref = click_cdi_hook(args, b"{}")
    assert (lean.returncode, lean.stdout, lean.stderr) == (ref.returncode, ref.stdout, ref.stderr)


def test_cdi_hook_runtime_errors_are_clicks(entry: Path, tmp_path: Path) -> None:
    for stdin in (b"not json", json.dumps({"id": "x", "bundle": str(tmp_path / "absent")}).encode()):
        lean = run_entry(entry, ["cdi-hook", "create-symlinks", "--link", "a::/b"], stdin)
        ref = click_cdi_hook(["create-symlinks", "--link", "a::/b"], stdin)
        assert lean.returncode == ref.returncode == 1
        assert lean.stderr == ref.stderr and lean.stderr.startswith(b"gpuhook: ")


# --- the fast paths agree with the full ones --------------------------------------------------------------------


SIGNALS = [
    (["NVIDIA_VISIBLE_DEVICES=0"], {}),
    (["NVIDIA_VISIBLE_DEVICES=void"], {}),
    (["NVIDIA_VISIBLE_DEVICES="], {}),
    (["CUDA_VERSION=12.2"], {}),
    ([], {"mounts": [{"destination": "/var/run/nvidia-container-devices/0", "source": "/dev/null"}]}),
    ([], {"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}}),
    ([], {"annotations": {"cdi.k8s.io/x": "vendor.com/other=0"}}),
]


@pytest.mark.parametrize(("env", "extra"), SIGNALS)
def test_any_gpu_signal_reaches_the_request_parser(tmp_path: Path, env: list[str], extra: dict[str, Any]) -> None:
    from gpuhook.model.contract import has_gpu_signal
    from gpuhook.oci.bundle import load_bundle, parse_state

    st_ = parse_state(state(bundle_dir(tmp_path, env, **extra)))
    bundle = load_bundle(st_.bundle)
    assert has_gpu_signal(bundle.env, bundle.mounts, {**bundle.annotations, **st_.annotations})


@pytest.mark.parametrize(("text", "words"), [
    (b"", "not JSON"), (b"[]", "not a JSON object"), (b'{"bundle": "/b"}', "missing id"),
    (b'{"id": "x"}', "missing bundle"), (b'{"id": "", "bundle": "/b"}', "invalid id ''"),
    (b'{"id": "x", "bundle": "b"}', "invalid bundle 'b'"),
    (b'{"id": "x", "bundle": "/b", "pid": -1}', "invalid pid -1"),
    (b'{"id": "x", "bundle": "/b", "pid": true}', "invalid pid True"),
    (b'{"id": "x", "bundle": "/nonexistent"}', "cannot read /nonexistent/config.json"),
    (b'{"id": "x", "bundle": "/tmp\\u0000"}', "invalid bundle"), (b"[" * 100000 + b"]" * 100000, "not JSON"),
])  # fmt: skip
def test_malformed_states_fail_with_one_line_naming_the_field(tmp_path: Path, text: bytes, words: str) -> None:
    config = Config(driver_root=str(tmp_path / "no-driver"), inventory_cache="")
    with pytest.raises(GpuhookError) as info:
        hook.run(text, config)
    message = str(info.value)
    assert words in message and "\n" not in message and len(message) < 400


def test_a_huge_bundle_path_is_echoed_bounded(tmp_path: Path) -> None:
    config = Config(driver_root=str(tmp_path / "no-driver"), inventory_cache="")
    with pytest.raises(GpuhookError) as info:
        hook.run(json.dumps({"id": "x", "bundle": "b" * 2_000_000}).encode(), config)
    assert len(str(info.value)) < 400 and "2000000 characters" in str(info.value)


_TOML_PIECES = ["key", "driver-root", "a_b", " ", "\t", "=", " = ", '"', "'", "[", "]", ",", "#", "true", "false",
                "1", "\\", "\n", "\r", "\x00", "\x1f", "\x7f", "é", "\u2028", "\ufeff", ".", "{", '"s"', "'l'",
                '"""', "\x0b", "\u00a0"]  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(_TOML_PIECES), max_size=16).map("".join),
       st.sampled_from(["", "k = ", "a = [", 'b = ["x", ', "c = '", "d = true"]))
def test_config_subset_is_tomllib(tail: str, head: str) -> None:
    text = head + tail
    fast = parse_simple(text)
    if fast is not None:
        assert fast == tomllib.loads(text)


def test_config_subset_reads_real_configs_without_tomllib(tmp_path: Path) -> None:
    text = ('# gpuhook\ndriver-root = "/run/nvidia/driver"   # the driver container\n\n'
            "log-file = ''\naccept-envvar-unprivileged = false\n"
            'supported-capabilities = [ "compute", \'utility\', ]\n')  # fmt: skip
    assert parse_simple(text) == tomllib.loads(text)
    path = tmp_path / "c.toml"
    path.write_text(text)
    config = load_config(str(path))
    assert config.supported_capabilities == ("compute", "utility") and config.log_file == ""
    code = f"from gpuhook.hook.config import load_config; load_config({str(path)!r})"
    trace = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True)
    assert "tomllib" not in trace.stderr


def test_config_outside_the_subset_goes_to_tomllib() -> None:
    text = 'driver-root = "/a\\u0062"\n[table]\n'
    assert parse_simple(text) is None
    with pytest.raises(GpuhookError, match="unknown key 'table'"):
        parse_config(text)


def test_config_is_immutable_and_compares_by_value() -> None:
    from gpuhook.model import catalogue

    config = Config()
    assert config.supported_capabilities == catalogue.CAPABILITIES
    assert config == Config(supported_capabilities=catalogue.CAPABILITIES) == Config(source="elsewhere")
    assert config != Config(log_file="")
    with pytest.raises(AttributeError):
        config.log_file = ""  # type: ignore[misc]
    with pytest.raises(TypeError):
        Config(bogus=1)


def test_links_if_present_follow_the_nodes_the_container_got(tmp_path: Path) -> None:
    """The CDI spec's one hook carries every GPU's by-path links; only those whose node is there are made."""
    from gpuhook.inject.containerhooks import update_container

    rootfs = tmp_path / "rootfs"
    (rootfs / "dev" / "dri").mkdir(parents=True)
    (rootfs / "dev" / "dri" / "card1").touch()
    given = ("../card1", "/dev/dri/by-path/pci-0000:18:00.0-card")
    absent = ("../card2", "/dev/dri/by-path/pci-0000:3b:00.0-card")
    escape = ("../../../../etc", "/dev/dri/by-path/pci-0000:5e:00.0-card")  # resolves inside the rootfs: absent
    update_container(str(rootfs), [], [], links_if_present=[given, absent, escape])
    by_path = rootfs / "dev" / "dri" / "by-path"
    assert sorted(p.name for p in by_path.iterdir()) == ["pci-0000:18:00.0-card"]
    assert os.readlink(by_path / "pci-0000:18:00.0-card") == "../card1"


def test_install_without_the_native_entry_writes_the_script_with_a_note(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler at build time: the hook path is today's Python entry, and install says why."""
    monkeypatch.setattr(hook_entry, "native_entry", lambda: None)
    notes: list[str] = []
    target = tmp_path / "gpuhook-hook"
    assert hook_entry.install(str(target), notes=notes) == [str(target)]
    assert target.read_text().startswith("#!") and not target.with_name("gpuhook-hook.py").exists()
    assert len(notes) == 1 and "native entry was not built" in notes[0]


def test_native_install_writes_the_binary_and_its_fallback_under_both_names(tmp_path: Path) -> None:
    if hook_entry.native_entry() is None:
        pytest.skip("the native entry was not built")
    target = tmp_path / "gpuhook-hook"
    docker = tmp_path / "nvidia-container-runtime-hook"
    written = hook_entry.install(str(target), docker_gpus=True)
    assert written == [str(target), f"{target}.py", str(docker), f"{docker}.py"]
    assert target.read_bytes().startswith(b"\x7fELF") and is_ours(str(target)) and is_ours(str(docker))
    assert Path(f"{docker}.py").read_text() == Path(f"{target}.py").read_text()
    Path(f"{docker}.py").write_text("#!/bin/sh\n# someone else's\n")  # a foreign fallback is never replaced
    with pytest.raises(GpuhookError, match=r"nvidia-container-runtime-hook\.py exists and is not gpuhook's"):
        hook_entry.install(str(target), docker_gpus=True)


def test_the_native_entry_needs_no_loader_where_a_static_libc_is_installed(tmp_path: Path) -> None:
    """setup.py links the native entry static-pie where the static libc is installed (Debian's libc6-dev), so no
    dynamic loader runs at each container start; without it the entry is linked dynamically."""
    from gpuhook.inject import ldcache

    entry = hook_entry.native_entry()
    if entry is None:
        pytest.skip("the native entry was not built")
    (tmp_path / "probe.c").write_text("int main(void) { return 0; }\n")
    linked = subprocess.run(["gcc", "-static-pie", "-fPIE", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")],
                            capture_output=True, check=False)
    if linked.returncode != 0:
        pytest.skip("no static libc here: the entry is linked dynamically")
    fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ldcache.check_static(fd, "the native entry")  # refuses an ELF with a PT_INTERP
    finally:
        os.close(fd)
