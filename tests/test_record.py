"""model/record.py: a Record behaves as the dataclass it replaces, for everything gpuhook's types use.

Each behaviour is checked against `dataclasses` itself on the same class body, so the two cannot drift apart
silently; and the reason Record exists (no `dataclasses`/`inspect` on the hook's path) is checked in a fresh
interpreter.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
from typing import Any, ClassVar

import pytest

from gpuhook.model.record import FrozenInstanceError, Record, as_dict, field, replace


class Node(Record):
    path: str
    major: int
    mode: int = 0o666
    tags: tuple[str, ...] = ()
    salt: str = field(default="x", compare=False)
    LIMIT: ClassVar[int] = 3


class Box(Record, frozen=False):
    name: str
    nodes: list[Node] = field(default_factory=list)
    extra: dict[str, Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = "unnamed"


@dataclasses.dataclass(frozen=True)
class DNode:
    path: str
    major: int
    mode: int = 0o666
    tags: tuple[str, ...] = ()
    salt: str = dataclasses.field(default="x", compare=False)
    LIMIT: ClassVar[int] = 3


def _error(make: Any) -> str:
    with pytest.raises(TypeError) as info:
        make()
    return str(info.value).split("() ", 1)[1]  # without the class name: Node vs DNode


def test_fields_defaults_and_classvars() -> None:
    names = tuple(f.name for f in dataclasses.fields(DNode))
    assert Node.__match_args__ == names == getattr(DNode, "__match_args__", names)  # dataclasses: 3.10+
    n = Node("/dev/nvidia0", 195)
    assert (n.mode, n.tags, n.salt, n.LIMIT) == (0o666, (), "x", 3)
    assert Node.mode == DNode.mode == 0o666 and Node.salt == "x"  # class attributes keep the plain default


@pytest.mark.parametrize("args,kwargs,words", [
    ((), {}, "missing"),
    (("/a",), {}, "missing"),
    (("/a", 1, 2, (), "s", 9), {}, "positional arguments"),
    (("/a",), {"path": "/b", "major": 1}, "multiple values for argument 'path'"),
    (("/a", 1), {"bogus": 1}, "unexpected keyword argument 'bogus'"),
])
def test_constructor_errors_match_dataclasses(args: tuple[Any, ...], kwargs: dict[str, Any], words: str) -> None:
    assert words in _error(lambda: DNode(*args, **kwargs))
    assert words in _error(lambda: Node(*args, **kwargs))


def test_equality_hash_and_repr() -> None:
    a, b = Node("/a", 1, salt="one"), Node("/a", 1, salt="two")
    assert a == b and hash(a) == hash(b)  # compare=False leaves salt out, as in dataclasses
    assert DNode("/a", 1, salt="one") == DNode("/a", 1, salt="two")
    assert a != Node("/a", 2) and a != DNode("/a", 1)  # another class is never equal
    assert repr(a).replace("Node(", "") == repr(DNode("/a", 1, salt="one")).replace("DNode(", "")
    assert len({a, b, Node("/b", 1)}) == 2


def test_frozen_refuses_assignment_and_deletion() -> None:
    n = Node("/a", 1)
    with pytest.raises(FrozenInstanceError):
        n.major = 2  # type: ignore[misc] # what is tested is the refusal itself
    with pytest.raises(AttributeError):
        del n.path
    assert issubclass(FrozenInstanceError, AttributeError) and n.major == 1


def test_mutable_record_is_unhashable_and_gets_fresh_defaults() -> None:
    one, two = Box("a"), Box("b")
    one.nodes.append(Node("/a", 1))
    assert two.nodes == [] and one.extra is not two.extra
    one.name = "renamed"
    assert one.name == "renamed"
    assert Box.__hash__ is None
    with pytest.raises(TypeError):
        hash(one)


def test_post_init_runs_on_init_and_replace() -> None:
    assert Box("").name == "unnamed"
    assert replace(Box("x"), name="").name == "unnamed"


def test_replace_and_as_dict_match_dataclasses() -> None:
    box = Box("b", [Node("/a", 1, tags=("t",))], {"k": Node("/c", 3)})
    assert as_dict(box) == {"name": "b", "nodes": [{"path": "/a", "major": 1, "mode": 0o666, "tags": ("t",),
                                                     "salt": "x"}],
                            "extra": {"k": {"path": "/c", "major": 3, "mode": 0o666, "tags": (), "salt": "x"}}}
    assert as_dict(Node("/a", 1)) == dataclasses.asdict(DNode("/a", 1))
    moved = replace(Node("/a", 1), path="/b")
    assert moved == Node("/b", 1)
    with pytest.raises(TypeError):
        replace(Node("/a", 1), bogus=1)


def test_copy_and_pickle_round_trip() -> None:
    n = Node("/a", 1, tags=("x",))
    assert copy.copy(n) == n and copy.deepcopy(n) == n
    assert pickle.loads(pickle.dumps(n)) == n
    box = Box("b", [n])
    assert pickle.loads(pickle.dumps(box)) == box


def test_field_order_is_checked_at_class_creation() -> None:
    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):
        class Bad(Record):
            a: int = 1
            b: int
    with pytest.raises(ValueError):
        field(default=1, default_factory=list)


def test_hook_path_model_loads_without_dataclasses() -> None:
    """The point of Record: the hook's planning path imports neither dataclasses nor inspect."""
    code = ("import sys; sys.path[:0] = sys.argv[1:]; import gpuhook.hook.plan, gpuhook.inject.apply, "
            "gpuhook.inject.devcgroup, gpuhook.model.request, gpuhook.model.requirements; "
            "print(sorted(m for m in ('dataclasses', 'inspect', 'typing') if m in sys.modules))")
    import gpuhook

    here = os.path.dirname(os.path.dirname(os.path.abspath(gpuhook.__file__)))  # the gpuhook this session imported
    out = subprocess.run([sys.executable, "-IS", "-c", code, here, *sys.path], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
