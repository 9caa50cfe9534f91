"""The licence and the documents that ship: LICENSE (Apache-2.0) and the wheel's licence metadata, the .deb's
copyright file and the man pages packaging/manpages.py makes from the commands' own help (packaging/build.py
puts both in the .deb; tests/test_packaging.py finds them installed)."""

from __future__ import annotations

import gzip
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest

from gpuhook.cli.app import cli
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.hook.prestart import USAGE

REPO = Path(__file__).resolve().parents[1]


def _module(name: str) -> ModuleType:
    sys.path.insert(0, str(REPO / "packaging"))
    try:
        spec = importlib.util.spec_from_file_location(f"gpuhook_packaging_{name}", REPO / "packaging" / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "packaging"))


def _commands(group: click.Group, path: str) -> list[tuple[str, click.Command]]:
    ctx = click.Context(group, info_name=path)
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        if not command.hidden:
            out.append((f"{path} {name}", command))
            if isinstance(command, click.Group):
                out += _commands(command, f"{path} {name}")
    return out


def test_license_is_apache_2_and_the_wheel_says_so() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_man_pages_hold_every_commands_help() -> None:
    pages = _module("manpages").pages()
    assert sorted(pages) == ["gpuhook-hook.1", "gpuhook-runtime.1", "gpuhook.1"]
    page = pages["gpuhook.1"]
    commands = _commands(cli, "gpuhook")
    assert len(commands) > 20
    for path, command in commands:
        assert f'.SS "{path}"\n' in page, path
        first = (command.help or "").strip().split("\n")[0].split(".")[0]
        assert " ".join(first.split()[:3]) in " ".join(page.split()), path  # its help text, not a summary of it
    assert USAGE in pages["gpuhook-hook.1"]
    assert "Invoked exactly like runc" in pages["gpuhook-runtime.1"]


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff renders the pages")
def test_man_pages_render_without_warnings(tmp_path: Path) -> None:
    for page in _module("manpages").write(tmp_path):
        rendered = subprocess.run(["groff", "-man", "-Tutf8", "-ww", str(page)], capture_output=True, text=True)
        assert rendered.returncode == 0 and rendered.stderr == "", (page.name, rendered.stderr)
        assert page.name.removesuffix(".1").upper() in rendered.stdout


def test_the_deb_stages_copyright_and_gzipped_man_pages(tmp_path: Path) -> None:
    build = _module("build")
    build.stage_docs(tmp_path)
    copyright_text = (tmp_path / "usr/share/doc/gpuhook/copyright").read_text()
    assert copyright_text.startswith("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/")
    assert "License: Apache-2.0" in copyright_text and "/usr/share/common-licenses/Apache-2.0" in copyright_text
    man1 = tmp_path / "usr/share/man/man1"
    assert sorted(p.name for p in man1.iterdir()) == ["gpuhook-hook.1.gz", "gpuhook-runtime.1.gz", "gpuhook.1.gz"]
    first = (man1 / "gpuhook.1.gz").read_bytes()
    assert gzip.decompress(first).startswith(b".TH GPUHOOK 1")
    build.stage_docs(tmp_path / "again")
    assert (tmp_path / "again/usr/share/man/man1/gpuhook.1.gz").read_bytes() == first  # reproducible


def test_the_packaged_units_carry_no_source_install_steps(tmp_path: Path) -> None:
    """The units' source-install comments (copy them, adjust ExecStart) are dropped from the packaged copies,
    whose ExecStart is the package's /usr/bin/gpuhook; the CDI refresh is among the units postinst enables."""
    build = _module("build")
    stage = tmp_path / "stage"
    site = stage / "usr/lib/gpuhook/lib/python3/site-packages"
    (site / "gpuhook/_native").mkdir(parents=True)
    (site / "gpuhook/_native/gpuhook-entry").write_bytes(b"\x7fELF")
    build.stage_host_files(stage, site)
    for unit in build.UNITS:
        text = (stage / "usr/lib/systemd/system" / unit).read_text()
        assert "Source install" not in text and "Adjust" not in text and "/usr/local/bin" not in text, unit
    assert "gpuhook-cdi-refresh.service" in build.ENABLED_UNITS
    postinst = build.MAINTAINER_SCRIPTS["postinst"].format(python="3.11", prefix=build.PREFIX,
                                                           enabled=" ".join(build.ENABLED_UNITS), units="")
    assert "for unit in gpuhook.socket gpuhook-cdi-refresh.service; do" in postinst
