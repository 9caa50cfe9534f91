"""`Record`: the base of gpuhook's value types, a dataclass without the cost of `dataclasses` at start-up.

Why not `dataclasses`: the hook runs at every container start, and measured on Python 3.11 (bench/imports.py,
2 CPUs) `import dataclasses` costs about 8 ms (it loads inspect, ast, dis and tokenize) and every decorated
class about 0.5 ms more, because the decorator exec()s generated source for `__init__`, `__repr__`, `__eq__`,
`__hash__` and the frozen `__setattr__`. The hook's path defines about twenty model types: some 20 ms of a
40 ms budget, before any work. A Record subclass is set up by `__init_subclass__` from its annotations in
microseconds, and behaves as `@dataclass(frozen=True)` (or `frozen=False`) for everything gpuhook uses:

- fields are the annotated names in order (a `ClassVar` is not one); a plain class value is the default;
  `field(default_factory=list)` makes a fresh default per instance; `field(..., compare=False)` leaves a field
  out of `==` and `hash`; a field without a default after one with a default is a TypeError at class creation;
- `__init__(*args, **kwargs)` with the same errors for a missing, unexpected or doubled argument, then
  `__post_init__()` if the class has one;
- `==` between instances of the same class compares the fields; a frozen record hashes them and refuses
  assignment and deletion (`FrozenInstanceError`, as dataclasses), a mutable one is unhashable;
- `repr` is `Name(field=value, ...)`; `as_dict` (recursive, as `dataclasses.asdict`) and `replace`; the field
  names, in order, are `__match_args__`.

Type checkers see the generated `__init__` through PEP 681's `dataclass_transform`, applied only while type
checking so that `typing` stays off the hook's path.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar, dataclass_transform, overload

    _T = TypeVar("_T")
    _R = TypeVar("_R", bound="Record")


class FrozenInstanceError(AttributeError):
    """Assignment to a field of a frozen record (the name and base `dataclasses` give it)."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


class Field:
    """What `field()` returns: a default or a default factory, and whether the field takes part in `==`."""

    __slots__ = ("default", "default_factory", "compare")

    def __init__(self, default: Any = MISSING, default_factory: Callable[[], Any] | None = None,
                 compare: bool = True) -> None:
        if default is not MISSING and default_factory is not None:
            raise ValueError("field() takes a default or a default_factory, not both")
        self.default = default
        self.default_factory = default_factory
        self.compare = compare


if TYPE_CHECKING:
    @overload
    def field(*, default: _T, compare: bool = True) -> _T: ...
    @overload
    def field(*, default_factory: Callable[[], _T], compare: bool = True) -> _T: ...


def field(*, default: Any = MISSING, default_factory: Callable[[], Any] | None = None, compare: bool = True) -> Any:
    """A field's default when a plain class value will not do: a mutable one (`default_factory=list`), or a field
    left out of `==` and `hash` (`compare=False`)."""
    return Field(default, default_factory, compare)


def _is_classvar(annotation: object) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar"))


if not TYPE_CHECKING:
    def dataclass_transform(**_: object) -> Callable[[_T], _T]:
        """Checkers only: at run time the decorator changes nothing."""
        return lambda cls: cls


@dataclass_transform(field_specifiers=(field, Field))
class Record:
    """Subclass with `class Name(Record):` (frozen) or `class Name(Record, frozen=False):` (mutable)."""

    _fields: tuple[str, ...] = ()  # every field, in order (inherited ones first)
    _field_set: frozenset[str] = frozenset()
    _compared: tuple[str, ...] = ()  # the fields `==` and `hash` look at
    _defaults: dict[str, Field] = {}  # noqa: RUF012 - replaced per subclass, never mutated
    _frozen: bool = True

    def __init_subclass__(cls, frozen: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = list(cls._fields)
        defaults = dict(cls._defaults)
        compared = set(cls._compared)
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            if _is_classvar(annotation):
                continue
            value = cls.__dict__.get(name, MISSING)
            spec = value if isinstance(value, Field) else Field(default=value)
            has_default = spec.default is not MISSING or spec.default_factory is not None
            if not has_default and defaults and name not in defaults:
                raise TypeError(f"non-default argument {name!r} follows default argument")
            if name not in names:
                names.append(name)
            if has_default:
                defaults[name] = spec
            else:
                defaults.pop(name, None)
            (compared.add if spec.compare else compared.discard)(name)
            if isinstance(value, Field):  # as dataclasses: the class attribute is the plain default, or none
                if spec.default is MISSING:
                    delattr(cls, name)
                else:
                    setattr(cls, name, spec.default)
        cls._fields = tuple(names)
        cls._field_set = frozenset(names)
        cls._compared = tuple(n for n in names if n in compared)
        cls._defaults = defaults
        cls._frozen = frozen
        cls.__match_args__ = cls._fields
        if not frozen:  # compared by value and mutable: unhashable, as dataclasses make it (`__hash__ = None`)
            type.__setattr__(cls, "__hash__", None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        names = cls._fields
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes {len(names)} positional arguments but {len(args)} were given")
        values = dict(zip(names, args))  # fewer arguments than fields: the rest from defaults
        for key in kwargs:
            if key in values:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {key!r}")
            if key not in cls._field_set:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {key!r}")
        values.update(kwargs)
        if len(values) < len(names):
            for name in names:
                if name not in values:
                    spec = cls._defaults.get(name)
                    if spec is None:
                        raise TypeError(f"{cls.__name__}() missing required argument: {name!r}")
                    values[name] = spec.default_factory() if spec.default_factory is not None else spec.default
        self.__dict__.update(values)  # not through __setattr__, which a frozen record refuses
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__qualname__}({inner})"

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._compared)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        object.__delattr__(self, name)


def replace(record: _R, **changes: Any) -> _R:
    """A copy of `record` with `changes` (through `__init__`, so `__post_init__` runs again)."""
    values = {name: getattr(record, name) for name in record._fields}
    values.update(changes)
    return type(record)(**values)


def as_dict(record: Record) -> dict[str, Any]:
    """The fields as a dict, records, lists, tuples and dicts inside converted recursively (`dataclasses.asdict`)."""
    return {name: _plain(getattr(record, name)) for name in record._fields}


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return as_dict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value
