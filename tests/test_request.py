"""NVIDIA environment contract: parsing of NVIDIA_VISIBLE_DEVICES & co into a Request (pure)."""

from __future__ import annotations

import pytest

from gpuhook.errors import RequestError
from gpuhook.model import catalogue
from gpuhook.model.record import replace
from gpuhook.model.request import (
    MAX_VALUE_CHARS,
    VOLUME_MOUNT_DIR,
    Policy,
    cdi_annotation_devices,
    is_privileged,
    parse_capabilities,
    parse_request,
    parse_visible_devices,
    volume_mount_devices,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ("unset", ())),
        ("", ("void", ())),
        ("  ", ("void", ())),
        ("void", ("void", ())),
        ("none", ("none", ())),
        ("all", ("all", ())),
        ("0", ("list", ("0",))),
        (" 0 , 1 ", ("list", ("0", "1"))),
        ("0,0", ("list", ("0",))),
        ("0,all", ("all", ())),
        ("none,all", ("none", ())),
        ("all,none", ("all", ())),  # void anywhere, else the first of all/none (NVIDIA end to end)
        ("none,0", ("none", ())),
        ("1,all", ("all", ())),
        ("all,void", ("void", ())),
        ("none,void", ("void", ())),
        ("0,none", ("none", ())),
        ("1,void,all", ("void", ())),
        ("GPU-abc,MIG-def,0:1", ("list", ("GPU-abc", "MIG-def", "0:1"))),
        ("nvidia.com/gpu=0", ("list", ("nvidia.com/gpu=0",))),
        ("0,,1", ("list", ("0", "1"))),
        ("ALL", ("list", ("ALL",))),  # case-sensitive: not the special word
    ],
)
def test_visible_devices(value: str | None, expected: tuple[str, tuple[str, ...]]) -> None:
    assert parse_visible_devices(value) == expected


def test_capabilities_default_and_all() -> None:
    assert parse_capabilities(None) == {"utility", "compute"}
    assert parse_capabilities("") == {"utility", "compute"}
    assert parse_capabilities("all") == {"compute", "utility", "video", "graphics", "display", "compat32", "ngx"}
    assert parse_capabilities(" utility , video ") == {"utility", "video"}


@pytest.mark.parametrize("value", ["Compute", "gpu", "compute,bogus"])
def test_capabilities_unknown_fails_naming_it(value: str) -> None:
    """The error names the unknown word and lists the valid ones (`gpuhook list --capabilities bogus` too)."""
    with pytest.raises(RequestError, match="unknown driver capability") as raised:
        parse_capabilities(value)
    assert str(raised.value).endswith("(known: all, compat32, compute, display, graphics, ngx, utility, video)")


def test_capabilities_outside_supported_set() -> None:
    with pytest.raises(RequestError, match="'graphics' is not supported"):
        parse_capabilities("graphics", frozenset({"compute", "utility"}))
    assert parse_capabilities("all", frozenset({"compute", "utility"})) == {"compute", "utility"}


def test_unset_is_not_a_gpu_container() -> None:
    req = parse_request(["PATH=/bin"])
    assert req.kind == "unset" and not req.wants_gpu_setup


def test_legacy_cuda_image_means_all_and_requires_its_cuda() -> None:
    req = parse_request(["CUDA_VERSION=12.2.1"])
    assert (req.kind, req.source) == ("all", "legacy-image")
    assert req.requirements == ("cuda>=12.2",)
    modern = parse_request(["CUDA_VERSION=12.2.1", "NVIDIA_REQUIRE_CUDA=cuda>=12.2"])
    assert modern.kind == "unset"
    assert parse_request(["CUDA_VERSION=12"]).requirements == ("cuda>=12.0",)  # semver's short form
    assert parse_request(["CUDA_VERSION="]).kind == "unset"  # empty: not legacy (NVIDIA's IsLegacy)


def test_legacy_cuda_image_without_capabilities_gets_every_supported_one() -> None:
    """NVIDIA's getDriverCapabilities: an image from before NVIDIA_DRIVER_CAPABILITIES gets them all."""
    assert parse_request(["CUDA_VERSION=12.2.1"]).capabilities == set(catalogue.CAPABILITIES)
    limited = Policy(supported_capabilities=frozenset({"utility", "compute", "video"}))
    assert parse_request(["CUDA_VERSION=12.2.1"], policy=limited).capabilities == {"utility", "compute", "video"}
    with_var = parse_request(["CUDA_VERSION=12.2.1", "NVIDIA_DRIVER_CAPABILITIES=utility"])
    assert with_var.capabilities == {"utility"}
    empty_var = parse_request(["CUDA_VERSION=12.2.1", "NVIDIA_DRIVER_CAPABILITIES="])
    assert empty_var.capabilities == {"utility", "compute"}
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=0"]).capabilities == {"utility", "compute"}


@pytest.mark.parametrize("version", ["abc", "12.x", "012.1", "1.2.3.4", "4294967296.0", "9" * 100000])
def test_legacy_cuda_version_that_is_not_a_version_fails_in_one_bounded_line(version: str) -> None:
    with pytest.raises(RequestError, match="invalid CUDA_VERSION") as err:
        parse_request([f"CUDA_VERSION={version}"])
    assert "\n" not in str(err.value) and len(str(err.value)) < 400
    # as NVIDIA's GetRequirements: with requirements off, the version is never read
    assert parse_request([f"CUDA_VERSION={version}", "NVIDIA_DISABLE_REQUIRE=1"]).kind == "all"


@pytest.mark.parametrize(
    ("value", "disabled"),
    [("1", True), ("t", True), ("T", True), ("TRUE", True), ("true", True), ("True", True),
     ("yes", False), ("on", False), ("y", False), ("tRuE", False), (" true", False), ("0", False), ("", False),
     ("bogus", False)],
)
def test_disable_require_is_go_parsebool(value: str, disabled: bool) -> None:
    """NVIDIA reads NVIDIA_DISABLE_REQUIRE with strconv.ParseBool and treats an invalid value as false."""
    env = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=12.0", f"NVIDIA_DISABLE_REQUIRE={value}"]
    req = parse_request(env)
    assert req.requirements == (() if disabled else ("cuda>=12.0",))


def test_requirements_collected_and_disabled() -> None:
    env = [
        "NVIDIA_VISIBLE_DEVICES=0",
        "NVIDIA_REQUIRE_CUDA=cuda>=12.0",
        "NVIDIA_REQUIRE_ARCH=arch>=8.0",
        "NVIDIA_REQUIRE_JETPACK=jetpack>=5",
    ]
    assert parse_request(env).requirements == ("arch>=8.0", "cuda>=12.0")
    assert parse_request([*env, "NVIDIA_DISABLE_REQUIRE=true"]).requirements == ()
    assert parse_request(env, policy=Policy(disable_require=True)).requirements == ()


def test_last_env_assignment_wins() -> None:
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=void"]).kind == "void"


def test_unprivileged_env_ignored_when_policy_says_so() -> None:
    policy = Policy(accept_envvar_unprivileged=False)
    req = parse_request(["NVIDIA_VISIBLE_DEVICES=all"], policy=policy)
    assert req.kind == "unset" and "ignored" in req.notes[0]
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=all"], privileged=True, policy=policy).kind == "all"
    mounts = [{"destination": "/var/run/nvidia-container-devices/1", "source": "/dev/null"}]
    policy = Policy(accept_envvar_unprivileged=False, accept_volume_mounts=True)
    via_mount = parse_request(["NVIDIA_VISIBLE_DEVICES=all"], mounts, policy=policy)
    assert (via_mount.kind, via_mount.devices, via_mount.source) == ("list", ("1",), "volume-mounts")


def test_volume_mounts_win_over_env_and_annotations_win_over_both() -> None:
    mounts = [
        {"destination": "/var/run/nvidia-container-devices/GPU-x", "source": "/dev/null"},
        {"destination": "/var/run/nvidia-container-devices/GPU-x"},
        {"destination": "/etc/hosts"},
    ]
    assert volume_mount_devices(mounts) == ("GPU-x",)
    req = parse_request(["NVIDIA_VISIBLE_DEVICES=0"], mounts, policy=Policy(accept_volume_mounts=True))
    assert req.devices == ("GPU-x",)
    # off by default, as NVIDIA's accept-nvidia-visible-devices-as-volume-mounts
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=0"], mounts).devices == ("0",)
    ann = {"cdi.k8s.io/gpuhook_a": "nvidia.com/gpu=1,other.com/x=2", "unrelated": "nvidia.com/gpu=0"}
    assert cdi_annotation_devices(ann) == ("1",)
    req = parse_request(["NVIDIA_VISIBLE_DEVICES=0"], mounts, ann, policy=Policy(accept_volume_mounts=True))
    assert (req.devices, req.source) == (("1",), "cdi-annotations")
    assert parse_request([], (), {"cdi.k8s.io/x": "nvidia.com/gpu=all"}).kind == "all"


def test_volume_mount_counts_only_with_a_dev_null_source() -> None:
    """NVIDIA's getDevicesFromMounts: a mount there of anything but /dev/null (an image's own volume, a host
    folder) requests nothing."""
    where = "/var/run/nvidia-container-devices/"
    mounts = [
        {"destination": where + "0", "source": "/tmp/x"},
        {"destination": where + "1", "source": "/dev/zero"},
        {"destination": where + "2"},
        {"destination": where + "3", "source": "/dev//null"},  # cleaned, as filepath.Clean
        {"destination": where + "4", "type": "tmpfs", "source": "tmpfs"},
    ]
    assert volume_mount_devices(mounts) == ("3",)
    req = parse_request(["NVIDIA_VISIBLE_DEVICES=void"], mounts[:2], policy=Policy(accept_volume_mounts=True))
    assert req.kind == "void"


def test_huge_device_lists_are_refused_in_one_bounded_line() -> None:
    """150,000 ids took 99 s through a list membership test; now bounded before per-item work."""
    many = ",".join(str(i) for i in range(150_000))
    with pytest.raises(RequestError, match="^NVIDIA_VISIBLE_DEVICES is 938889 characters, more than 262144") as err:
        parse_request([f"NVIDIA_VISIBLE_DEVICES={many}"])
    assert len(str(err.value)) < 400
    with pytest.raises(RequestError, match="^NVIDIA_VISIBLE_DEVICES names 10000 devices, more than 4096") as err:
        parse_request(["NVIDIA_VISIBLE_DEVICES=" + ",".join("GPU-x" for _ in range(10_000))])
    assert len(str(err.value)) < 400
    with pytest.raises(RequestError, match="NVIDIA_VISIBLE_DEVICES is 2000000 characters") as err:
        parse_request(["NVIDIA_VISIBLE_DEVICES=" + "0" * 2_000_000])
    assert len(str(err.value)) < 400
    names = ",".join(f"nvidia.com/gpu={i}" for i in range(200_000))
    with pytest.raises(RequestError, match="annotation 'cdi.k8s.io/x'") as err:
        parse_request([], (), {"cdi.k8s.io/x": names})
    assert len(str(err.value)) < 400
    spread = {f"cdi.k8s.io/{k}": ",".join(f"nvidia.com/gpu={k}-{i}" for i in range(4000)) for k in range(3)}
    with pytest.raises(RequestError, match="more than 4096 devices"):
        parse_request([], (), spread)
    with pytest.raises(RequestError, match="^NVIDIA_MIG_CONFIG_DEVICES is"):
        parse_request(["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_MIG_CONFIG_DEVICES={many}"], privileged=True)
    with pytest.raises(RequestError, match="^NVIDIA_IMEX_CHANNELS names 10000 devices, more than 4096"):
        parse_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=" + ",".join(["1"] * 10_000)])
    # the bound itself is accepted, duplicates collapse in order
    at_bound = ",".join(str(i % 2048) for i in range(4096))
    assert parse_request([f"NVIDIA_VISIBLE_DEVICES={at_bound}"]).devices == tuple(str(i) for i in range(2048))


def test_mig_config_needs_privilege() -> None:
    env = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_MIG_CONFIG_DEVICES=all"]
    with pytest.raises(RequestError, match="NVIDIA_MIG_CONFIG_DEVICES requires a privileged"):
        parse_request(env)
    req = parse_request([*env, "NVIDIA_MIG_MONITOR_DEVICES=all"], privileged=True)
    assert req.mig_config and req.mig_monitor


def test_privileged_is_cap_sys_admin_in_bounding_set() -> None:
    assert is_privileged({"capabilities": {"bounding": ["CAP_CHOWN", "CAP_SYS_ADMIN"]}})
    assert not is_privileged({"capabilities": {"effective": ["CAP_SYS_ADMIN"], "bounding": ["CAP_CHOWN"]}})
    assert not is_privileged({})
    assert not is_privileged(None)


def test_void_and_unset_skip_capability_parsing() -> None:
    # an invalid capability must not fail a container that asked for nothing
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_DRIVER_CAPABILITIES=bogus"]).kind == "void"
    with pytest.raises(RequestError, match="'bogus'"):
        parse_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=bogus"])


def test_non_string_env_entry_fails() -> None:
    with pytest.raises(RequestError, match="not a string"):
        parse_request([42])  # type: ignore[list-item]


def test_clip_bounds_any_echo_and_keeps_a_line_a_line() -> None:
    from gpuhook.errors import CLIP_LIMIT, clip

    huge = "0," * 1_500_000
    out = clip(huge)
    assert len(out) < CLIP_LIMIT + 40 and out.endswith("(3000000 characters)")
    assert clip("short") == "'short'"
    assert clip("a\nb\x7f", quote=False) == "a\\x0ab\\x7f"  # a log line stays one line
    assert "\n" not in clip("x\n" * 500, quote=False) and clip("x\n" * 500, quote=False).endswith("(1000 characters)")
    assert clip(list(range(1000))).endswith("(1000 characters)")


def test_requirements_are_bounded_before_they_are_split() -> None:
    """256 KiB per value and 4096 conditions in all, refused in one clipped line naming the variable;
    the count is linear, so a value at the bound costs milliseconds, not seconds."""
    big = "cuda>=1 " * (MAX_VALUE_CHARS // 8 + 1)
    with pytest.raises(RequestError, match=r"^NVIDIA_REQUIRE_CUDA is \d+ characters, more than 262144") as err:
        parse_request(["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_REQUIRE_CUDA={big}"])
    assert len(str(err.value)) < 500
    many = [f"NVIDIA_REQUIRE_X{i}={'cuda>=1,' * 300}" for i in range(15)]  # 4500 conditions over 15 variables
    with pytest.raises(RequestError, match="NVIDIA_REQUIRE_\\* hold more than 4096 conditions") as err:
        parse_request(["NVIDIA_VISIBLE_DEVICES=0", *many])
    assert len(str(err.value)) < 500
    fits = parse_request(["NVIDIA_VISIBLE_DEVICES=0", *many[:13]])  # 3900: checked, in linear time
    assert len(fits.requirements) == 13


def test_blank_driver_capabilities_give_none() -> None:
    """NVIDIA's getDriverCapabilities: set to blanks or commas, the variable names no capability (not the
    defaults, which only unset or empty give)."""
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES= "]).capabilities == frozenset()
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=,"]).capabilities == frozenset()
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES="]).capabilities == {
        "compute", "utility"}


def test_volume_mount_ids_keep_their_path() -> None:
    mounts = [{"source": "/dev/null", "destination": f"{VOLUME_MOUNT_DIR}/{d}"}
              for d in ("MIG-GPU-abc/1/0", "cdi/nvidia.com/gpu/2", "cdi/nvidia.com/gpu=3", "cdi/bogus", "imex/4",
                        "nvidia.com/gpu=all", "MIG-GPU-abc/1/0/")]
    notes: list[str] = []
    assert volume_mount_devices(mounts, notes) == (
        "MIG-GPU-abc/1/0", "nvidia.com/gpu=2", "nvidia.com/gpu=3", "nvidia.com/gpu=all")
    assert notes == ["ignored the mount request 'cdi/bogus': not cdi/<vendor>/<class>/<name>"]
    req = parse_request([], mounts[5:6], policy=Policy(accept_volume_mounts=True))
    assert (req.kind, req.source) == ("list", "volume-mounts")


# -- a runtime that ignored the CDI devices (contract.CDI_DEVICES_MARKER) --------------------------------------------

MARKER = "GPUHOOK_CDI_DEVICES=nvidia.com/gpu=GPU-a,nvidia.com/gpu=GPU-b"


@pytest.mark.parametrize(("env", "ignored"), [
    # Allocate's envs as containerd 1.6 leaves them: the variable still names the devices
    (["NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b", MARKER], ("nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b")),
    (["NVIDIA_VISIBLE_DEVICES=all", MARKER], ("nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b")),
    # a CDI runtime applied the spec: its NVIDIA_VISIBLE_DEVICES=void came last
    (["NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b", MARKER, "NVIDIA_VISIBLE_DEVICES=void"], ()),
    (["NVIDIA_VISIBLE_DEVICES=void", MARKER], ()),
    (["NVIDIA_VISIBLE_DEVICES=", MARKER], ()),  # empty is void
    ([MARKER], ()),  # no variable: nothing says how a GPU would come
    (["NVIDIA_VISIBLE_DEVICES=GPU-a"], ()),  # no marker: not gpuhook's plugin, or a strategy without CDI
    (["NVIDIA_VISIBLE_DEVICES=GPU-a", "GPUHOOK_CDI_DEVICES="], ()),
])
def test_cdi_ignored_is_the_marker_beside_a_variable_that_is_not_void(env: list[str],
                                                                     ignored: tuple[str, ...]) -> None:
    req = parse_request(env)
    assert req.cdi_ignored == ignored
    if "NVIDIA_VISIBLE_DEVICES=void" in env:
        assert req.kind == "void" and not req.wants_gpu_setup  # and the hook leaves the container alone


def test_cdi_ignored_does_not_change_what_is_injected() -> None:
    plain = parse_request(["NVIDIA_VISIBLE_DEVICES=GPU-a"])
    marked = parse_request(["NVIDIA_VISIBLE_DEVICES=GPU-a", MARKER])
    assert marked.cdi_ignored and marked == replace(plain, cdi_ignored=marked.cdi_ignored,
                                                    cdi_marker=marked.cdi_marker)


def test_cdi_ignored_is_bounded_like_every_list() -> None:
    with pytest.raises(RequestError, match="^GPUHOOK_CDI_DEVICES names 5000 devices, more than 4096"):
        parse_request(["NVIDIA_VISIBLE_DEVICES=0", "GPUHOOK_CDI_DEVICES=" + ",".join(f"x{i}" for i in range(5000))])
