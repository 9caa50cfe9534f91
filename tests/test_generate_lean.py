"""`gpuhook generate-cdi` without click (cli/generate.py): the same bytes, messages and exit codes as the click
command for every command line it takes, and click for every command line it does not fully understand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuhook.cli.generate import GENERATE_OPTIONS
from gpuhook.cli.options import parse_lean
from gpuhook.fakedriver import FakeDriver

HOOK = "/usr/local/bin/gpuhook"
# Runs one command line through a chosen path and reports whether click was imported.
PROBE = """
import sys
path, args = sys.argv[1], sys.argv[2:]
if path == "lean":
    from gpuhook.cli import main
else:
    from gpuhook.cli.app import main
code = main(args)
sys.stdout.flush()
sys.stderr.write("click-loaded=%s\\n" % ("click" in sys.modules))
sys.exit(code)
"""


def run(path: str, *args: str) -> tuple[int, str, str, bool]:
    result = subprocess.run([sys.executable, "-c", PROBE, path, *args], capture_output=True, text=True, check=False)
    *err, flag = result.stderr.splitlines()
    return result.returncode, result.stdout, "\n".join(err), flag == "click-loaded=True"


def roots(fake: FakeDriver) -> list[str]:
    return ["--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc"), "--hook-path", HOOK]


@pytest.mark.parametrize("extra,code", [
    ([], 0),
    (["--format", "json"], 0),
    (["--format=json", "--vendor=example.com", "--class", "accel"], 0),
    (["--device-name-strategy", "uuid", "--device-name-strategy", "type-index"], 0),
    (["--cdi-version", "0.6.0", "--discovery", "procfs"], 0),
    (["--mode", "gds"], 1),  # the simulated host has no GDS node: one error line
    (["--inventory-cache", ""], 0),
    (["--cdi-version", "0.3.0"], 1),  # below what the spec needs: one error line
    (["--vendor", "bad vendor"], 1),  # refused by the spec model: one error line
])
def test_lean_path_writes_what_click_writes(fake_driver_mig: FakeDriver, extra: list[str], code: int) -> None:
    args = ["generate-cdi", *roots(fake_driver_mig), *extra]
    lean = run("lean", *args)
    clicked = run("click", *args)
    assert lean[:3] == clicked[:3]
    assert lean[0] == code, lean[2]
    assert clicked[3] and not lean[3]  # the lean path answered, without click


def test_lean_path_writes_the_file_and_the_note_as_click(fake_driver: FakeDriver, tmp_path: Path) -> None:
    outputs = {}
    for path in ("lean", "click"):
        out = tmp_path / path / "nvidia.yml"
        code, stdout, stderr, _ = run(path, "generate-cdi", *roots(fake_driver), "-o", str(out))
        outputs[path] = (code, stdout, stderr.replace(str(out), "OUT"), out.read_bytes(), out.stat().st_mode)
    assert outputs["lean"] == outputs["click"]
    assert "will be ignored" in outputs["lean"][2]


@pytest.mark.parametrize("extra", [
    ["--help"],
    ["--watch", "-o", "x.yaml"],
    ["--poll-interval", "1"],
    ["--format", "toml"],  # a bad choice: click's usage error, exit 2
    ["--output"],  # no value
    ["--output", "-"],  # a value click may read differently
    ["--vendor", "a", "--vendor", "b"],  # repeated single option
    ["--bogus", "1"],
    ["positional"],
    ["-ofile"],
])
def test_anything_else_goes_to_click(extra: list[str]) -> None:
    assert parse_lean(extra, GENERATE_OPTIONS) is None


def test_click_answers_what_the_lean_path_declines(fake_driver: FakeDriver) -> None:
    code, stdout, stderr, loaded = run("lean", "generate-cdi", *roots(fake_driver), "--format", "toml")
    assert code == 2 and loaded and "Invalid value for '--format'" in stderr and stdout == ""
    code, stdout, _, loaded = run("lean", "generate-cdi", "--help")
    assert code == 0 and loaded and "--device-name-strategy" in stdout


def test_defaults_are_the_click_commands() -> None:
    from gpuhook.cli.cdi import generate_cdi

    lean = parse_lean([], GENERATE_OPTIONS)
    assert lean is not None
    lean_names = {opt.dest for opt in GENERATE_OPTIONS if opt.lean}
    assert lean_names == {p.name for p in generate_cdi.params} - {"watch", "poll_interval"}
    assert lean == {p.name: p.default for p in generate_cdi.params if p.name in lean_names}
    assert parse_lean(["-o", "f", "--device-name-strategy=uuid", "--device-name-strategy", "index"],
                      GENERATE_OPTIONS) == {**lean, "output": "f", "strategies": ("uuid", "index")}
