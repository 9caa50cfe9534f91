"""NVIDIA environment contract: parsing of NVIDIA_VISIBLE_DEVICES & co into a Request (pure)."""

from __future__ import annotations

import pytest

from gpuhook.errors import RequestError
from gpuhook.model.request import (
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
        ("all,none", ("all", ())),
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
    with pytest.raises(RequestError, match="unknown driver capability"):
        parse_capabilities(value)


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
    via_mount = parse_request(["NVIDIA_VISIBLE_DEVICES=all"], mounts, policy=policy)
    assert (via_mount.kind, via_mount.devices, via_mount.source) == ("list", ("1",), "volume-mounts")


def test_volume_mounts_win_over_env_and_annotations_win_over_both() -> None:
    mounts = [
        {"destination": "/var/run/nvidia-container-devices/GPU-x", "source": "/dev/null"},
        {"destination": "/var/run/nvidia-container-devices/GPU-x"},
        {"destination": "/etc/hosts"},
    ]
    assert volume_mount_devices(mounts) == ("GPU-x",)
    req = parse_request(["NVIDIA_VISIBLE_DEVICES=0"], mounts)
    assert req.devices == ("GPU-x",)
    assert parse_request(["NVIDIA_VISIBLE_DEVICES=0"], mounts, policy=Policy(accept_volume_mounts=False)).devices == (
        "0",
    )
    ann = {"cdi.k8s.io/gpuhook_a": "nvidia.com/gpu=1,other.com/x=2", "unrelated": "nvidia.com/gpu=0"}
    assert cdi_annotation_devices(ann) == ("1",)
    req = parse_request(["NVIDIA_VISIBLE_DEVICES=0"], mounts, ann)
    assert (req.devices, req.source) == (("1",), "cdi-annotations")
    assert parse_request([], (), {"cdi.k8s.io/x": "nvidia.com/gpu=all"}).kind == "all"


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
