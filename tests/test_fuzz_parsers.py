"""Bad input, property-based (hypothesis): every reader of untrusted bytes fails with its documented exception.

The contract (errors.py): a failure the user can fix is a GpuhookError subclass with one line, never a
traceback. Per reader: the request parser and device/requirement resolution -> RequestError; the OCI state and
config.json readers -> BundleError; the config file -> ConfigError; CDI validation -> a list of problems
(never an exception); the native ld.so.cache and ELF parsers -> ValueError (OSError only for I/O).

Inputs are arbitrary values and bytes, and mutations of real ones (the host's ld.so.cache and libraries, a
generated CDI spec). Bugs it found are pinned by regression tests next to the property that found them.
Compiled-in memory safety of the native parsers is checked separately under ASan/UBSan (tests/fuzz/).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import tomlkit
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.inv import sample_inventory

from gpuhook import _native
from gpuhook.cdi import codec
from gpuhook.cdi.spec import build_spec
from gpuhook.cdi.validate import validate_file, validate_spec
from gpuhook.discover import cache as invcache
from gpuhook.discover.roots import Roots
from gpuhook.errors import ConfigError, RequestError
from gpuhook.hook import config
from gpuhook.model import catalogue
from gpuhook.model import requirements as require
from gpuhook.model.contract import has_gpu_signal
from gpuhook.model.request import (
    CDI_ANNOTATION_PREFIX,
    CDI_KIND,
    VOLUME_MOUNT_DIR,
    Policy,
    Request,
    is_privileged,
    parse_request,
)
from gpuhook.model.selection import resolve
from gpuhook.oci.bundle import BundleError, load_bundle, parse_state

# GPUHOOK_FUZZ_EXAMPLES=5000 for a longer hunt than the suite's default.
FUZZ = settings(max_examples=int(os.environ.get("GPUHOOK_FUZZ_EXAMPLES", "250")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
INV = sample_inventory()

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=16)


# --- the request parser, device selection and NVIDIA_REQUIRE_* ------------------------------------------------

WORDS = ["0", "1", "2", "3", "7", "00", "-1", "all", "none", "void", "ALL", "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",
         "GPU-nope", "MIG-00000002-0000", "MIG-", "2:0", "2:1", "0:0", ":", "1:", "0000:18:00.0", "18:00.0",
         "0000:zz:00.0", f"{CDI_KIND}=0", f"{CDI_KIND}=all", "other.com/x=0", "=", ""]
REQS = ["cuda>=12.0", "cuda<1", "driver=550.54.15", "arch>=9.0", "brand=nvidia", "brand>nvidia", "cuda>=x",
        "foo=1", "cuda", ">=1", "cuda>=12.0,brand=tesla", "arch=8.0 brand=tesla"]
ENV_KEYS = ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_REQUIRE_ARCH",
            "NVIDIA_REQUIRE_JETPACK", "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES",
            "NVIDIA_MIG_MONITOR_DEVICES", "CUDA_VERSION", "PATH"]

word = st.sampled_from(WORDS) | st.text(max_size=8)
device_list = st.lists(word, max_size=4).map(",".join) | st.text(max_size=30)
capability_list = (st.lists(st.sampled_from([*catalogue.CAPABILITIES, "all", "bogus", " compute", ""]),
                            max_size=4).map(",".join))
requirement = st.lists(st.sampled_from(REQS) | st.text(max_size=10), max_size=3).map(" ".join)
env_value = device_list | capability_list | requirement | st.sampled_from(["12.4", "11.0.3", "x.y", "1", "true"])
env_entry = (st.builds("{}={}".format, st.sampled_from(ENV_KEYS) | st.text(max_size=8), env_value)
             | st.text(max_size=20))
mount = st.dictionaries(
    st.sampled_from(["destination", "source", "type", "options"]) | st.text(max_size=6),
    st.builds(lambda d: f"{VOLUME_MOUNT_DIR}/{d}", word) | st.text(max_size=20) | json_values, max_size=4)
annotations = st.dictionaries(
    st.builds(lambda k: CDI_ANNOTATION_PREFIX + k, st.text(max_size=8)) | st.text(max_size=12),
    st.builds(lambda d: f"{CDI_KIND}={d}", word) | device_list | json_values, max_size=3)
policies = st.builds(Policy, st.booleans(), st.booleans(), st.booleans(),
                     st.frozensets(st.sampled_from(catalogue.CAPABILITIES), min_size=1))


def select_and_check(request: Request) -> None:
    """What the hook does with a request: resolve its devices, check its requirements."""
    try:
        selection = resolve(INV, request)
        require.check(INV, request.requirements, selection.devices)
    except RequestError:
        pass


@FUZZ
@given(st.lists(env_entry, max_size=8), st.lists(mount, max_size=3), annotations, st.booleans(), policies)
@example(["NVIDIA_VISIBLE_DEVICES=0,all", "NVIDIA_DRIVER_CAPABILITIES=all"], [], {}, False, Policy())
@example(["CUDA_VERSION=12.0"], [{"destination": f"{VOLUME_MOUNT_DIR}/2:1"}], {}, True, Policy())
def test_request_parser(env: list[str], mounts: list[dict[str, Any]], ann: dict[str, Any], privileged: bool,
                        policy: Policy) -> None:
    try:
        request = parse_request(env, mounts, ann, privileged, policy)
    except RequestError:
        return
    assert request.kind in ("unset", "void", "none", "all", "list")
    if request.wants_gpu_setup:
        select_and_check(request)


@FUZZ
@given(json_values)
def test_request_parser_on_any_json(env: Any) -> None:
    """process.env straight from a config.json of any shape (bundle.env filters, parse_request must not rely on it)."""
    with contextlib.suppress(RequestError):
        parse_request(env if isinstance(env, list) else [env])


@pytest.mark.parametrize("devices", ["²", "1" * 5000, f"{CDI_KIND}=³", "2:²"])
def test_unicode_and_huge_digits_are_unknown_devices(devices: str) -> None:
    """Regression: str.isdigit() holds for '²' and for numbers int() refuses; these were tracebacks."""
    request = parse_request([f"NVIDIA_VISIBLE_DEVICES={devices}"])
    with pytest.raises(RequestError):
        resolve(INV, request)


def test_huge_required_version_is_a_request_error() -> None:
    """Regression: int() of a >4300-digit version was a traceback from the hook."""
    request = parse_request(["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_REQUIRE_CUDA=cuda>={'9' * 5000}"])
    with pytest.raises(RequestError):
        require.check(INV, request.requirements, resolve(INV, request).devices)


@FUZZ
@given(json_values)
def test_is_privileged_on_any_process(process: Any) -> None:
    assert is_privileged(process if isinstance(process, dict) else {"capabilities": process}) in (True, False)


# --- OCI state (stdin) and config.json ----------------------------------------------------------------------

state_objects = st.fixed_dictionaries(
    {}, optional={"ociVersion": json_values, "id": st.text(max_size=10) | json_values,
                  "status": json_values, "pid": st.integers(-5, 1 << 70) | json_values,
                  "bundle": st.sampled_from(["/", "/tmp", "relative", "/a\0b", ""]) | st.text(max_size=10),
                  "annotations": st.dictionaries(st.text(max_size=8), json_values, max_size=3) | json_values})
state_bytes = (st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode())
               | state_objects.map(lambda v: json.dumps(v).encode()))
DEEP = b"[" * 100_000 + b"]" * 100_000


@FUZZ
@given(state_bytes)
@example(DEEP)
@example(b'{"id": "x", "bundle": "/a\\u0000b"}')
@example('{"id": "\udc80", "bundle": "/"}'.encode("utf-8", "surrogatepass"))
def test_state_reader(data: bytes) -> None:
    try:
        state = parse_state(data)
    except BundleError:
        return
    assert state.id and state.bundle.startswith("/") and "\0" not in state.bundle and state.pid >= 0


config_objects = st.fixed_dictionaries(
    {}, optional={"root": st.fixed_dictionaries({}, optional={"path": st.sampled_from(
                      ["rootfs", "/abs", "", "a\0b", "../up"]) | json_values}) | json_values,
                  "process": st.fixed_dictionaries({}, optional={"env": st.lists(env_entry | json_values, max_size=4)
                                                                 | json_values,
                                                                 "capabilities": json_values}) | json_values,
                  "mounts": st.lists(mount | json_values, max_size=3) | json_values,
                  "annotations": annotations | json_values})
config_bytes = (st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode())
                | config_objects.map(lambda v: json.dumps(v).encode()))


@FUZZ
@given(config_bytes)
@example(DEEP)
@example(b'{"root": {"path": "a\\u0000b"}}')
def test_config_json_reader(data: bytes) -> None:
    """load_bundle, then everything the hook reads from it, then the request parser on it."""
    with tempfile.TemporaryDirectory() as bundle_dir:
        Path(bundle_dir, "config.json").write_bytes(data)
        try:
            bundle = load_bundle(bundle_dir)
        except BundleError:
            return
        assert bundle.rootfs.startswith("/") and "\0" not in bundle.rootfs
        env, mounts, ann = bundle.env, bundle.mounts, bundle.annotations
        try:
            request = parse_request(env, mounts, ann, is_privileged(bundle.process))
        except RequestError:
            return
        if request.wants_gpu_setup:
            select_and_check(request)


def test_missing_or_unreadable_config_json(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="cannot read"):
        load_bundle(str(tmp_path))
    (tmp_path / "config.json").mkdir()
    with pytest.raises(BundleError, match="cannot read"):
        load_bundle(str(tmp_path))


# The hook stops before the request parser when contract.has_gpu_signal says no: that must never skip a container
# the parser would have given a GPU, under any policy.
@FUZZ
@given(config_objects, st.dictionaries(st.text(max_size=8), json_values, max_size=2) | json_values)
def test_no_gpu_signal_means_unset_under_every_policy(cfg: dict[str, Any], state_ann: Any) -> None:
    with tempfile.TemporaryDirectory() as bundle_dir:
        Path(bundle_dir, "config.json").write_text(json.dumps(cfg))
        state = json.dumps({"id": "c1", "pid": 1, "bundle": bundle_dir, "annotations": state_ann}).encode()
        try:
            full = parse_state(state)
            bundle = load_bundle(full.bundle)
        except BundleError:
            return
        annotations = {**bundle.annotations, **full.annotations}
        if has_gpu_signal(bundle.env, bundle.mounts, annotations):
            return
        for policy in (Policy(), Policy(accept_envvar_unprivileged=False), Policy(accept_volume_mounts=True)):
            request = parse_request(bundle.env, bundle.mounts, annotations, is_privileged(bundle.process), policy)
            assert request.kind == "unset", (cfg, request)


# --- the config file ---------------------------------------------------------------------------------------

CONFIG_KEYS = ["driver-root", "dev-root", "proc-root", "ldconfig", "log-file", "accept-envvar-unprivileged",
               "accept-volume-mounts", "disable-require", "supported-capabilities", "inventory-cache", "source",
               "driver_root", "bogus"]
toml_values = (st.text(max_size=12) | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
               | st.lists(st.sampled_from([*catalogue.CAPABILITIES, "bogus"]) | st.text(max_size=6), max_size=3)
               | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
toml_docs = st.dictionaries(st.sampled_from(CONFIG_KEYS) | st.text(max_size=8), toml_values, max_size=5).map(
    tomlkit.dumps)
# the hook's hand-written subset parser: its own corner cases, valid or not
subset_lines = st.lists(st.one_of(
    st.builds("{} = {}".format, st.sampled_from(CONFIG_KEYS),
              st.sampled_from(['"/x"', "'/y'", "true", "false", "[]", '["compute", "utility",]', "['a' , \"b\"]",
                               '"a\\"b"', '"""x"""', "'''x'''", '"x" # c', '"x"#c', "True", "1", '"', "[", '["a"',
                               '"tab\there"', '["a" "b"]', '"\x7f"'])),
    st.sampled_from(["", "# comment", "  # indented", "[table]", "a.b = 1", '"quoted" = 1', "x =", "= 1", " \t",
                     "key=\"v\"\r", "\ufeffkey = 'v'", "ldconfig = '@/sbin/ldconfig'"]),
    st.text(max_size=15)), max_size=6).map("\n".join)


@FUZZ
@given(toml_docs | subset_lines | st.text(max_size=60))
@example('driver-root = "/"\ndriver-root = "/x"\n')
@example("supported-capabilities = ['compute', 'bogus']\n")
def test_config_file(text: str) -> None:
    try:
        cfg = config.parse_config(text, "fuzz.toml")
    except ConfigError:
        return
    assert isinstance(cfg.policy, Policy)


parse_simple = getattr(config, "parse_simple", None)


@pytest.mark.skipif(parse_simple is None, reason="this config module has no fast subset parser")
@FUZZ
@given(subset_lines | toml_docs)
def test_config_subset_parser_agrees_with_tomllib(text: str) -> None:
    """A fast path must never read a file differently than tomllib (or accept one tomllib refuses)."""
    from gpuhook.fileio.tomlfile import tomllib

    assert parse_simple is not None
    simple = parse_simple(text)
    if simple is None:
        return
    assert simple == tomllib.loads(text), text


@FUZZ
@given(st.binary(max_size=200))
def test_config_file_bytes(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "config.toml")
        Path(path).write_bytes(data)
        with contextlib.suppress(ConfigError):
            config.load_config(path)


# --- the inventory cache (read by the hook on every GPU start) -----------------------------------------------


@FUZZ
@given(st.dictionaries(st.sampled_from(["format", "gpus", "files", "driver_version", "control_nodes",
                                        "fingerprint"]) | st.text(max_size=5),
                       json_values | st.just(1), max_size=5))
def test_inventory_cache_reader(data: dict[str, Any]) -> None:
    """A cache that is not a valid inventory is ignored (the hook rediscovers), never an exception."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "inventory.json")
        Path(path).write_text(json.dumps(data))
        assert invcache.load_fresh(path, Roots.make(folder)) is None


@pytest.mark.parametrize("data", ["[]", "7", '"x"', "null"])
def test_inventory_cache_not_an_object(tmp_path: Path, data: str) -> None:
    (tmp_path / "inventory.json").write_text(data)
    assert invcache.load_fresh(str(tmp_path / "inventory.json"), Roots.make(str(tmp_path))) is None


# --- CDI validation ------------------------------------------------------------------------------------------

SPEC = build_spec(INV, hook_path="/usr/bin/gpuhook")


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


SPEC_PATHS = _paths(SPEC)


@st.composite
def mutated_specs(draw: st.DrawFn) -> Any:
    """The generated spec with a few values replaced, keys dropped or added, anywhere in the tree."""
    spec = copy.deepcopy(SPEC)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(SPEC_PATHS))
        if not path:
            continue
        parent = spec
        try:
            for part in path[:-1]:
                parent = parent[part]
            action = draw(st.sampled_from(["replace", "drop", "add"]))
            if action == "replace":
                parent[path[-1]] = draw(json_values | st.sampled_from(["", "0.5.0", "9.9.9", "nvidia.com/gpu", "c",
                                                                        "x", -1, 1 << 40, True, "/dev/null"]))
            elif action == "drop":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(max_size=10))] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue
    return spec


def test_the_generated_spec_is_valid() -> None:
    assert validate_spec(SPEC, "generated") == []


@FUZZ
@given(mutated_specs() | json_values)
def test_cdi_validation_never_raises(spec: Any) -> None:
    problems = validate_spec(spec, "fuzz")
    assert isinstance(problems, list) and all(p.startswith("fuzz: $") for p in problems)


@FUZZ
@given(st.text(max_size=200) | mutated_specs().map(lambda s: codec.dumps(s) if isinstance(s, dict) else "x"))
@example("cdiVersion: 2001-13-01\n")
@example("a: !!int 0x\n")
@example("[" * 5000 + "]" * 5000)
@example("a: &a [*a, *a]\n")
def test_cdi_validate_file_never_raises(text: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
        f.flush()
        problems = validate_file(f.name)
    assert isinstance(problems, list) and all(p.startswith(f.name + ": ") for p in problems)


def test_cdi_list_reports_a_bad_scalar(tmp_path: Path) -> None:
    """Regression: a YAML constructor's ValueError escaped cdi.codec.loads and `gpuhook cdi list` tracebacked."""
    (tmp_path / "bad.yaml").write_text("cdiVersion: 2001-13-01\nkind: nvidia.com/gpu\n")
    from gpuhook.cdi.registry import scan

    assert scan([str(tmp_path)]).errors


# --- the native ld.so.cache and ELF parsers -----------------------------------------------------------------


def _corpus(paths: list[str]) -> list[bytes]:
    out = []
    for path in paths:
        try:
            out.append(Path(path).read_bytes())
        except OSError:
            continue
    return out


CACHES = _corpus(["/etc/ld.so.cache"])
ELVES = _corpus(["/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libz.so.1", "/bin/true",
                 "/usr/lib/i386-linux-gnu/libc.so.6", "/usr/lib32/libc.so.6"])
INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]


@st.composite
def mutated(draw: st.DrawFn, corpus: list[bytes]) -> bytes:
    """A real file with bytes flipped or 32-bit fields overwritten, mostly in its headers, maybe truncated."""
    data = bytearray(draw(st.sampled_from(corpus)))
    for _ in range(draw(st.integers(1, 8))):
        near_start = draw(st.booleans())
        pos = draw(st.integers(0, min(len(data), 256) - 1 if near_start else len(data) - 1))
        if draw(st.booleans()):
            data[pos] = draw(st.integers(0, 255))
        else:
            value = draw(st.sampled_from(INTERESTING) | st.integers(0, 0xFFFFFFFF))
            pos -= pos % 4
            data[pos : pos + 4] = value.to_bytes(4, "little")[: len(data) - pos]
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@FUZZ
@given(st.binary(max_size=300) | (mutated(CACHES) if CACHES else st.binary()))
@example(b"glibc-ld.so.cache1.1" + b"\xff" * 28)
@example(b"ld.so-1.7.0\x00\xff\xff\xff\xff")
def test_ldcache_parser(data: bytes) -> None:
    try:
        entries = _native.parse_ldcache(data, "fuzz")
    except ValueError as exc:
        assert str(exc).startswith("fuzz: ")
        return
    for e in entries:
        assert isinstance(e.key, str) and isinstance(e.value, str)


@FUZZ
@given(st.binary(max_size=300) | (mutated(ELVES) if ELVES else st.binary()))
@example(b"\x7fELF\x02\x01\x01" + b"\x00" * 57)
def test_elf_parser(data: bytes) -> None:
    try:
        info = _native.elf_info_bytes(data, "fuzz")
    except ValueError as exc:
        assert str(exc).startswith("fuzz: ")
        return
    assert info.elf_class in (32, 64)


@settings(max_examples=60, deadline=None)
@given(mutated(ELVES) if ELVES else st.binary())
def test_elf_parser_from_a_file(data: bytes) -> None:
    """The pread path (no mmap: a file truncated while read must not SIGBUS) agrees with the buffer path."""
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        try:
            from_file: Any = _native.elf_info(f.name)
        except ValueError as exc:
            from_file = str(exc).split(": ", 1)[1]
    try:
        from_buffer: Any = _native.elf_info_bytes(data, f.name)
    except ValueError as exc:
        from_buffer = str(exc).split(": ", 1)[1]
    assert from_file == from_buffer
