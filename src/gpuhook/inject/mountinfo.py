"""/proc/self/mountinfo's path fields, read the one way every reader of it here needs (the device cgroup, the
rootfs's own mounts, the ldconfig child's read-only view)."""

from __future__ import annotations

from collections import namedtuple

# One mountinfo line: index (line number), mount_id, parent_id, root, mountpoint, fstype, super_options (a tuple).
# A namedtuple: no dataclasses or typing on the hook's path.
Mount = namedtuple("Mount", ["index", "mount_id", "parent_id", "root", "mountpoint", "fstype", "super_options"])


def mountinfo_path(field: str) -> str:
    """A mountinfo path field: the kernel writes space, tab, newline and backslash as \\ooo."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """Every well-formed line (a line without the ` - ` separator is skipped), in order."""
    mounts = []
    for index, line in enumerate(text.splitlines()):
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            mount_id, parent_id = int(fields[0]), int(fields[1])
        except ValueError:
            continue
        fstype = fields[sep + 1] if len(fields) > sep + 1 else ""
        super_options = tuple(fields[sep + 3].split(",")) if len(fields) > sep + 3 else ()
        mounts.append(Mount(index, mount_id, parent_id, mountinfo_path(fields[3]), mountinfo_path(fields[4]), fstype,
                            super_options))  # fmt: skip
    return mounts


def read_mounts(path: str = "/proc/self/mountinfo") -> list[Mount]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())
