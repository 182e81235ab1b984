"""The base of the config sections (config/sections.py): a dataclass section that is writable until
``resolve()`` freezes it, and the frozen form of its list fields."""
from __future__ import annotations

import copy
import typing
from typing import Any

from ..errors import FrozenConfigError


class Section:
    """Base of the config sections: writable until ``resolve()`` freezes it (state in slots: not a field)."""

    __slots__ = ("_frozen", "_given")  # _given: the values resolve() replaced (what unfrozen() restores)
    _name = "config"

    def __setattr__(self, name: str, value: Any) -> None:
        if name in Section.__slots__:
            return object.__setattr__(self, name, value)
        from .sections import FIELD_SECTION, flag  # (sections.py builds on this module)
        if self.is_resolved:
            where = f"{self._name}.{name}" + (f" ({flag(name)})" if name in FIELD_SECTION else "")
            raise FrozenConfigError(f"cannot set {where}: the config is frozen after resolve(); make a modified "
                                    "copy with cfg.unfrozen() and resolve that, or use dataclasses.replace()")
        if name not in self.__dataclass_fields__:
            home = f" (it is {FIELD_SECTION[name]}.{name})" if name in FIELD_SECTION else ""
            raise AttributeError(f"{type(self).__name__} has no field {name}{home}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.is_resolved:
            raise FrozenConfigError(f"cannot delete {self._name}.{name}: the config is frozen after resolve()")
        object.__delattr__(self, name)

    @property
    def is_resolved(self) -> bool:
        return getattr(self, "_frozen", False)

    def _freeze(self, given: dict) -> None:
        """Freeze (lists too); ``given`` holds the values resolve() replaced (what ``unfrozen()`` restores)."""
        for name in self.__dataclass_fields__:
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, FrozenList(getattr(self, name)))
        self._given = given
        self._frozen = True

    def unfrozen(self):
        """A writable deep copy holding the values as given (before resolve derived any)."""
        out = copy.deepcopy(self)
        out._frozen = False
        given, out._given = getattr(out, "_given", {}), {}
        for name in out.__dataclass_fields__:
            if isinstance(getattr(out, name), FrozenList):
                setattr(out, name, list(getattr(out, name)))
        for name, value in given.items():
            setattr(out, name, value)
        return out


class FrozenList(list):
    """A list field of a resolved config (``--data-path``, ...): equal to the list, but unchangeable."""

    def _refuse(self, *args, **kwargs):
        raise FrozenConfigError("this list belongs to a config frozen after resolve(); change a copy made with "
                                "cfg.unfrozen()")

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self):  # copy and pickle rebuild it whole (they would append item by item)
        return FrozenList, (list(self),)


def flag(name: str) -> str:
    """A field's command-line flag: ``hidden_size`` -> ``--hidden-size``."""
    return "--" + name.replace("_", "-")


def base_type(tp) -> Any:  # Optional[int] -> int
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp
