"""/proc/self/mountinfo's path fields, read the one way every reader of it here needs (the device cgroup, the
rootfs's own mounts, the ldconfig child's read-only view)."""

from __future__ import annotations

from collections import namedtuple

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path)
if TYPE_CHECKING:
    from collections.abc import Iterator

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


def parse_mountinfo(text: str, points: frozenset[str] | None = None) -> list[Mount]:
    """Every well-formed line (a line without the ` - ` separator is skipped), in order; with `points` (mount
    points as mountinfo writes them, escaped), only the lines of those mount points, the others passed over
    before they are split. Each Mount keeps its line's index either way."""
    mounts = []
    for index, line in enumerate(text.splitlines()):
        if points is not None:
            head = line.split(" ", 5)
            if len(head) > 4 and head[4] not in points:
                continue
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


def points_above(text: str, fstypes: tuple[str, ...]) -> frozenset[str]:
    """The mount points (escaped, as written) of the mounts of `fstypes` in mountinfo `text`, with every folder
    above them: the lines a question about those mounts needs (their parents, and whatever was mounted over them
    or over a folder above them later), found without splitting the other lines. A node with thousands of pod
    mounts: parsing 2,000 tmpfs lines whole took ~4 ms of every start. A "/" is never escaped, so the folders
    above an escaped path are the escaped folders above it."""
    wanted = tuple(f" - {t} " for t in fstypes)
    points = {"/"}
    for line in text.splitlines():
        if any(w in line for w in wanted):
            fields = line.split(" ", 5)
            points.update(ancestor_paths(fields[4] if len(fields) > 4 else "/"))
    return frozenset(points)


def ancestor_paths(path: str) -> Iterator[str]:
    """`path` and every directory above it: /a/b -> /a/b, /a, /."""
    while True:
        yield path
        if path == "/":
            return
        path = path.rsplit("/", 1)[0] or "/"


def read_mounts(path: str = "/proc/self/mountinfo") -> list[Mount]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())
