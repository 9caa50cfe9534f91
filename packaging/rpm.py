"""The RPM for the RHEL family (packaging/build.py calls it; built with rpmbuild, Debian's `rpm` package has it).

Made like the .debs, from the same wheel: gpuhook and its dependencies' wheels (for CPython 3.9 and glibc <= 2.28,
so RHEL 8 with python39 and RHEL 9 alike) installed into /usr/lib/gpuhook, whose python3 is /usr/bin/python3.9,
the one thing the package requires besides glibc; the commands, the hook entry, the systemd units (gpuhook.socket
and gpuhook-cdi-refresh.service enabled on a first install, disabled and stopped on erase), the man pages and
the licence. Nothing is compiled on the host and rpmbuild generates no dependencies of its own (AutoReqProv: no:
it would read the vendored libraries' needs as the package's).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

PYTHON = "3.9"  # RHEL 9's python3; RHEL 8's python39
GLIBC = 28  # the dependencies' wheels: manylinux_2_28 at most (RHEL 8: glibc 2.28)

SCRIPTS = {
    # $1: 1 on a first install, 2 on an upgrade (post); 0 on erase, 1 on an upgrade (preun, postun)
    "post": """/usr/bin/python{python} -m compileall -q {prefix}/lib/python{python}/site-packages >/dev/null 2>&1 || :
if [ "$1" -eq 1 ] && command -v systemctl >/dev/null 2>&1; then
    systemctl enable {enabled} >/dev/null 2>&1 || :
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -eq 1 ]; then
        systemctl start {enabled} >/dev/null 2>&1 || :
    else
        systemctl try-restart gpuhook.service >/dev/null 2>&1 || :
    fi
fi
""",
    "preun": """if [ "$1" -eq 0 ]; then
    if command -v systemctl >/dev/null 2>&1; then
        systemctl disable --now {units} >/dev/null 2>&1 || :
    fi
    find {prefix} -depth -type d -name __pycache__ -exec rm -rf {{}} + 2>/dev/null || :
fi
""",
    "postun": """if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -eq 0 ]; then
    # what gpuhook made at run time at its default paths (never /etc/gpuhook, nor runtime configs)
    rm -rf /run/gpuhook
    rm -f /var/log/gpuhook.log
fi
""",
}


def spec(version: str, stage: Path, build: Any) -> str:
    files = sorted("/" + str(p.relative_to(stage)) for p in _top_entries(stage))
    scripts = {name: text.format(python=PYTHON, prefix=build.PREFIX, enabled=" ".join(build.ENABLED_UNITS),
                                 units=" ".join(build.UNITS)) for name, text in SCRIPTS.items()}
    return f"""Name: gpuhook
Version: {version}
Release: 1
Summary: NVIDIA GPUs in containers: OCI prestart hook, CDI generator, runtime shim
License: Apache-2.0
BuildArch: x86_64
AutoReqProv: no
Requires: /usr/bin/python{PYTHON}
Requires: glibc >= 2.17
%global debug_package %{{nil}}
%global __os_install_post %{{nil}}
%global _build_id_links none

%description
gpuhook in its own environment under {build.PREFIX} (Python {PYTHON}, its dependencies
vendored); gpuhook, gpuhook-hook and gpuhook-runtime in /usr/bin; gpuhook.socket and
gpuhook-cdi-refresh.service enabled. Configure a runtime with
`gpuhook runtime configure --runtime RUNTIME`.

%install
cp -a {stage}/. %{{buildroot}}/

%post
{scripts["post"]}
%preun
{scripts["preun"]}
%postun
{scripts["postun"]}
%files
{chr(10).join(files)}
"""


def _top_entries(stage: Path) -> list[Path]:
    """What %files lists: gpuhook's own folders whole, every file elsewhere by name (never /usr or /usr/bin)."""
    own = {"usr/lib/gpuhook", "usr/share/doc/gpuhook", "usr/share/licenses/gpuhook"}
    out = [stage / d for d in sorted(own) if (stage / d).exists()]
    for path in sorted(stage.rglob("*")):
        rel = str(path.relative_to(stage))
        if any(rel == d or rel.startswith(d + "/") for d in own) or (path.is_dir() and not path.is_symlink()):
            continue
        out.append(path)
    return out


def build_rpm(wheel: Path, out: Path, work: Path, build: Any) -> Path:
    version, _ = build.wheel_metadata(wheel)
    stage = work / "rpm-stage"
    deps = build.dependency_wheels(wheel, PYTHON, GLIBC, work / "wheels-rpm")
    site = build.install_wheels([wheel, *deps], stage, PYTHON)
    build.stage_host_files(stage, site)
    licenses = stage / "usr/share/licenses/gpuhook"
    licenses.mkdir(parents=True)
    shutil.copyfile(build.REPO / "LICENSE", licenses / "LICENSE")
    top = work / "rpmbuild"
    (top / "SPECS").mkdir(parents=True)
    spec_file = top / "SPECS" / "gpuhook.spec"
    spec_file.write_text(spec(version, stage, build))
    name_format = "%%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm"
    subprocess.run(["rpmbuild", "-bb", "--quiet", "--target", "x86_64", "--define", f"_topdir {top}",
                    "--define", f"_rpmdir {out}", "--define", f"_build_name_fmt {name_format}", str(spec_file)],
                   check=True, stdout=subprocess.DEVNULL)
    return out / f"gpuhook-{version}-1.x86_64.rpm"
