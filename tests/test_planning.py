"""Selection (ids -> devices), requirements and the edits plan, on a hand-built inventory."""

from __future__ import annotations

import pytest
from support.inv import sample_inventory

from gpuhook.errors import RequestError, RequirementError
from gpuhook.model.edits import ALL_CAPABILITIES, common_edits, device_edits, plan
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.request import parse_request
from gpuhook.model.requirements import check, evaluate, parse_condition, terms
from gpuhook.model.selection import resolve


@pytest.fixture()
def inv() -> Inventory:
    return sample_inventory()


def names(devices: tuple[Gpu | MigDevice, ...]) -> list[str]:
    return [str(d.index) if isinstance(d, Gpu) else d.name for d in devices]


def select(inv: Inventory, value: str, caps: str = ""):  # type: ignore[no-untyped-def]
    env = [f"NVIDIA_VISIBLE_DEVICES={value}"] + ([f"NVIDIA_DRIVER_CAPABILITIES={caps}"] if caps else [])
    return resolve(inv, parse_request(env))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("all", ["0", "1", "2:0", "2:1"]),  # a MIG-enabled GPU contributes its MIG devices
        ("1", ["1"]),
        ("1,0", ["1", "0"]),
        ("GPU-00000001-aaaa-bbbb-cccc-dddddddddddd", ["1"]),
        ("1,GPU-00000001-aaaa-bbbb-cccc-dddddddddddd", ["1"]),  # same GPU twice collapses
        ("MIG-00000002-0001", ["2:1"]),
        ("2:0", ["2:0"]),
        ("0000:19:00.0", ["1"]),
        ("00000000:19:00.0", ["1"]),
        ("19:00.0", ["1"]),
        ("nvidia.com/gpu=0", ["0"]),
        ("nvidia.com/gpu=2:1", ["2:1"]),
        ("nvidia.com/gpu=all", ["0", "1", "2:0", "2:1"]),
        ("none", []),
    ],
)
def test_resolve(inv: Inventory, value: str, expected: list[str]) -> None:
    assert names(select(inv, value).devices) == expected


@pytest.mark.parametrize("value", ["7", "GPU-nope", "MIG-nope", "2:9", "0:0", "other.com/gpu=0", "ff:00.0"])
def test_unknown_device_fails_naming_it(inv: Inventory, value: str) -> None:
    with pytest.raises(RequestError, match=f"unknown device '{value}'"):
        select(inv, value)


def test_unknown_device_lists_the_valid_ids(inv: Inventory) -> None:
    """A refused start says what to ask for instead, the ids as `doctor --env` lists them."""
    with pytest.raises(RequestError) as err:
        select(inv, "7")
    gpus = inv.gpus
    listed = [str(gpus[0].index), gpus[0].uuid, str(gpus[1].index), gpus[1].uuid]
    assert f"; this host has: {', '.join(listed)}, 2:0, " in str(err.value)
    assert str(err.value).endswith(", all, none")


def test_plan_one_gpu_compute(inv: Inventory) -> None:
    edits = plan(inv, select(inv, "1"))
    assert [n.path for n in edits.device_nodes] == [
        "/dev/nvidia1",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    mounted = {m.container_path for m in edits.mounts}
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15" in mounted
    assert "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15" in mounted
    assert not any("GLX" in p or "i386" in p for p in mounted)
    assert all(m.read_only for m in edits.mounts)  # sockets too
    sock = next(m for m in edits.mounts if m.container_path.endswith("socket"))
    assert "ro" in sock.options and "noexec" in sock.options
    links = {(s.link, s.target) for s in edits.symlinks}
    assert ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "libcuda.so.550.54.15") in links
    assert ("/usr/lib/x86_64-linux-gnu/libcuda.so", "libcuda.so.1") in links
    assert ("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so", "libnvidia-ml.so.1") in links
    assert edits.ld_dirs == ["/usr/lib/x86_64-linux-gnu"]
    assert edits.proc_gpu_dirs == ["/proc/driver/nvidia/gpus/0000:19:00.0"]


def test_plan_utility_only_has_no_libcuda_nor_uvm(inv: Inventory) -> None:
    edits = plan(inv, select(inv, "0", "utility"))
    mounted = {m.container_path for m in edits.mounts}
    assert any("libnvidia-ml" in p for p in mounted) and not any("libcuda" in p for p in mounted)
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidia0", "/dev/nvidiactl"]


def test_plan_graphics_display_compat32(inv: Inventory) -> None:
    edits = plan(inv, select(inv, "0", "display,compat32,compute"))
    paths = [n.path for n in edits.device_nodes]
    assert "/dev/dri/card1" in paths and "/dev/dri/renderD128" in paths and "/dev/nvidia-modeset" in paths
    mounted = {m.container_path for m in edits.mounts}
    assert "/usr/lib/i386-linux-gnu/libcuda.so.550.54.15" in mounted
    assert "/usr/lib/x86_64-linux-gnu/libnvidia-glcore.so.550.54.15" in mounted
    links = {s.link for s in edits.symlinks}
    assert "/usr/lib/x86_64-linux-gnu/libGLX_indirect.so.0" in links
    assert "/usr/lib/x86_64-linux-gnu/libnvidia-glcore.so.550.54.15" not in links  # soname == file name


def test_plan_mig_device_gets_parent_node_and_caps(inv: Inventory) -> None:
    edits = plan(inv, select(inv, "2:1"))
    paths = [n.path for n in edits.device_nodes]
    assert paths[:3] == ["/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"]


def test_plan_none_gives_files_and_control_nodes_only(inv: Inventory) -> None:
    edits = plan(inv, select(inv, "none"))
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert edits.mounts


def test_cdi_parts_cover_all_capabilities(inv: Inventory) -> None:
    common = common_edits(inv, ALL_CAPABILITIES)
    assert {n.path for n in common.device_nodes} == {
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
    }
    assert len(common.mounts) == len(inv.files)
    dev = device_edits(inv, inv.gpus[0], ALL_CAPABILITIES)
    assert [n.path for n in dev.device_nodes] == ["/dev/nvidia0", "/dev/dri/card1", "/dev/dri/renderD128"]


def test_mig_control_nodes_when_requested(inv: Inventory) -> None:
    req = parse_request(["NVIDIA_VISIBLE_DEVICES=none", "NVIDIA_MIG_CONFIG_DEVICES=all"], privileged=True)
    edits = plan(inv, resolve(inv, req))
    assert "/dev/nvidia-caps/nvidia-cap1" in [n.path for n in edits.device_nodes]
    assert "/dev/nvidia-caps/nvidia-cap2" not in [n.path for n in edits.device_nodes]


def test_constraint_grammar() -> None:
    """Space separates terms (OR), comma factors (AND): NVIDIA's factory.go and dsl.c."""
    assert terms("cuda>=12.0 brand=tesla,driver>=535  ,") == [["cuda>=12.0"], ["brand=tesla", "driver>=535"], []]
    assert str(parse_condition("CUDA>=12.0")) == "cuda>=12.0"  # keys are case-insensitive in dsl.c
    assert parse_condition("cuda!12").op == "!="  # dsl.c matches a lone '!' as '!='
    for bad in ("cuda=>12", "foo>=1", "brand>=x", "cuda>=abc", "cuda>=", ">=12", "cuda==12", "cuda>=1.2-rc"):
        with pytest.raises(RequestError, match="invalid requirement"):
            parse_condition(bad)


@pytest.mark.parametrize(
    ("constraint", "ok"),
    [
        ("cuda>=12.0", True),
        ("cuda>=12.4", True),
        ("cuda>12.4", False),
        ("cuda!=12.4", False),
        ("cuda!=12.3", True),
        ("cuda<13", True),
        ("driver>=550", True),
        ("driver<550.54.15", False),
        ("driver=550.54.15.0", True),
        ("arch>=9.0", True),
        ("arch<8.0", False),
        ("brand=tesla,brand=nvidia", False),  # AND: one board is not both
        ("brand=tesla brand=nvidia", True),  # OR
        ("brand!=geforce", True),
        ("brand=geforce", False),
        ("cuda>=12.0 arch>=9.0 brand=NVIDIA", True),
        ("cuda>=13.0 arch>=10.0", False),
        ("cuda>=13.0 arch>=10.0 driver>=550,driver<551", True),
        ("cuda>=13.0 driver>=550,arch>=10.0", False),
    ],
)
def test_requirements(inv: Inventory, constraint: str, ok: bool) -> None:
    devices = select(inv, "0").devices
    if ok:
        check(inv, (constraint,), devices)
    else:
        with pytest.raises(RequirementError, match="unsatisfied requirement") as err:
            check(inv, (constraint,), devices)
        assert "cuda 12.4, driver 550.54.15, arch 9.0, brand nvidia on GPU 0" in str(err.value)
        assert str(err.value).endswith(", or set NVIDIA_DISABLE_REQUIRE=true to start it without the check")


@pytest.mark.parametrize(("constraint", "way"), [
    ("cuda>=13.0", "install a newer NVIDIA driver (one with CUDA >=13.0)"),
    ("driver>=560", "install NVIDIA driver >=560"),
    ("arch>=10.0", "run it on a host whose GPU and driver meet it"),
    ("brand=geforce", "run it on a host whose GPU and driver meet it"),
])  # fmt: skip
def test_an_unmet_requirement_names_the_way_out(inv: Inventory, constraint: str, way: str) -> None:
    with pytest.raises(RequirementError) as err:
        check(inv, (constraint,), select(inv, "0").devices)
    assert str(err.value).endswith(f"; {way}, or set NVIDIA_DISABLE_REQUIRE=true to start it without the check")


def test_first_term_that_holds_decides(inv: Inventory) -> None:
    """dsl.c parses a factor only when it reaches it: an unknown key after a term that holds is never read, one
    that is reached is an invalid requirement, never skipped."""
    devices = select(inv, "0").devices
    check(inv, ("cuda>=11.6 foo=bar",), devices)
    with pytest.raises(RequestError, match="invalid requirement 'foo=bar'"):
        check(inv, ("cuda>=13.0 foo=bar",), devices)
    with pytest.raises(RequestError, match="unknown key 'foo'"):
        check(inv, ("foo=45",), devices)
    outcome = evaluate(inv, "cuda>=13.0 brand=tesla,driver>=550 brand=nvidia,driver>=550", inv.gpus[0])
    assert outcome.held and outcome.term == 2 and outcome.deciding_term == "brand=nvidia,driver>=550"


def test_requirement_on_mig_device_uses_parent_arch(inv: Inventory) -> None:
    check(inv, ("arch>=9.0",), select(inv, "2:0").devices)
    with pytest.raises(RequirementError, match="on GPU 2"):
        check(inv, ("arch>=9.1",), select(inv, "2:0").devices)


@pytest.mark.parametrize("constraint", ["cuda>=12.0", "cuda<99", "arch>=10.0 cuda>=11.0,cuda>=12.0"])
def test_requirement_on_unknown_cuda_version_fails_never_passes(inv: Inventory, constraint: str) -> None:
    """Procfs discovery with no answer from libcuda leaves the CUDA version unknown: the start is refused."""
    inv.cuda_version = ""
    with pytest.raises(RequirementError, match=r"cannot check requirement .*cuda version is unknown"):
        check(inv, (constraint,), select(inv, "0").devices)
    check(inv, ("driver>=550 arch>=9.0",), select(inv, "0").devices)  # what is known is still checked
