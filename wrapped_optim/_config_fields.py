"""What every configuration class shares: ``ConfigError``, field checks, TOML I/O.

It imports attrs and the standard library only, so every config validates the same way.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import attrs

__all__ = [
    "ConfigError",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int_at_least",
    "check_optional_int_at_least",
    "closest",
    "from_mapping",
    "is_int",
    "is_number",
    "known_keys",
    "read_toml",
    "to_bytes",
    "toml_value",
]

S = TypeVar("S")


class ConfigError(ValueError):
    """A configuration value or combination was rejected.

    The message is ``"<field>: <reason>"``.

    Args:
        field: The dotted path of the offending setting (``"staged.chunk_bytes"``).
        reason: What is wrong and what to do.

    Attributes:
        field: The dotted path of the offending setting.
        reason: What is wrong and what to do.

    Examples:
        >>> from wrapped_optim.config import StagedConfig
        >>> try:
        ...     StagedConfig(chunk_bytes=0)
        ... except ConfigError as error:
        ...     error.field
        'chunk_bytes'
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def under(self, prefix: str) -> ConfigError:
        """Returns the same error with ``prefix.`` put in front of its field path.

        Args:
            prefix: The enclosing section's name.

        Examples:
            >>> ConfigError("chunk_bytes", "must be positive").under("staged").field
            'staged.chunk_bytes'
        """
        return ConfigError(f"{prefix}.{self.field}", self.reason)


# ----------------------------------------------------------------------------------------
# Field helpers
# ----------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def to_bytes(value: Any) -> Any:
    """A size string (``"64MiB"``, ``"1 GB"``, ``"4096"``) as an int; anything else unchanged.

    Anything else is left for the field's validator to reject.

    Examples:
        >>> to_bytes("64MiB"), to_bytes("1 GB"), to_bytes(7), to_bytes("lots")
        (67108864, 1000000000, 7, 'lots')
    """
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is not None:
            unit = (match.group(2) or "B").lower()
            return int(match.group(1)) * _UNITS[unit]
    return value


def check_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: ``value`` is a real bool (``1`` and ``"yes"`` are rejected).

    Examples:
        >>> import attrs
        >>> @attrs.frozen
        ... class Switch:
        ...     on: bool = attrs.field(validator=check_bool)
        >>> Switch(1)
        Traceback (most recent call last):
        ...
        wrapped_optim._config_fields.ConfigError: on: must be true or false, got 1
    """
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be true or false, got {value!r}")


def check_choice(*choices: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """attrs validator factory: the value is one of ``choices``.

    Examples:
        >>> import attrs
        >>> @attrs.frozen
        ... class Mode:
        ...     name: str = attrs.field(validator=check_choice("a", "b"))
        >>> Mode("a").name
        'a'
    """

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise ConfigError(
                attribute.name, f"must be one of {', '.join(map(repr, choices))}; got {value!r}"
            )

    return check


def is_int(value: Any) -> bool:
    """An int that is not a bool.

    Examples:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool.

    Examples:
        >>> is_number(0.5), is_number(False)
        (True, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int_at_least(minimum: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """attrs validator factory: an int (not a bool) of at least ``minimum``.

    Examples:
        >>> import attrs
        >>> @attrs.frozen
        ... class Count:
        ...     n: int = attrs.field(validator=check_int_at_least(1))
        >>> Count(2).n
        2
    """

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not is_int(value) or value < minimum:
            raise ConfigError(attribute.name, f"must be an integer >= {minimum}, got {value!r}")

    return check


def check_optional_int_at_least(minimum: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """attrs validator factory: ``None`` or an int of at least ``minimum``.

    Examples:
        >>> import attrs
        >>> @attrs.frozen
        ... class Limit:
        ...     n: int | None = attrs.field(validator=check_optional_int_at_least(1))
        >>> Limit(None).n is None
        True
    """
    inner = check_int_at_least(minimum)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            inner(instance, attribute, value)

    return check


def check_float(
    *, minimum: float | None = None, maximum: float | None = None, optional: bool = False
) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """attrs validator factory: a finite number within ``[minimum, maximum]`` (or ``None``).

    Examples:
        >>> import attrs
        >>> @attrs.frozen
        ... class Fraction:
        ...     x: float = attrs.field(validator=check_float(minimum=0.0, maximum=1.0))
        >>> Fraction(0.5).x
        0.5
    """

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if not is_number(value) or not math.isfinite(value):
            raise ConfigError(attribute.name, f"must be a finite number, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(attribute.name, f"must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ConfigError(attribute.name, f"must be <= {maximum}, got {value!r}")

    return check


def known_keys(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` as a dict, after rejecting every key that is not an init field of ``cls``.

    Examples:
        >>> from wrapped_optim.config import HybridConfig
        >>> known_keys(HybridConfig, {"on_stale": "raise"}, "hybrid")
        {'on_stale': 'raise'}
    """
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"must be a table/mapping, got {type(data).__name__}")
    names = [a.name for a in attrs.fields(cls) if a.init]
    for key in data:
        if key not in names:
            hint = closest(str(key), names)
            raise ConfigError(
                f"{where}.{key}" if where else str(key),
                f"unknown setting{hint}; {cls.__name__} accepts {', '.join(names)}",
            )
    return dict(data)


def closest(word: str, names: list[str]) -> str:
    """A "did you mean" hint for a misspelt ``word``, or ``""``.

    Examples:
        >>> closest("stagd", ["staged", "hybrid"])
        " (did you mean 'staged'?)"
    """
    import difflib

    match = difflib.get_close_matches(word, names, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def from_mapping(cls: Callable[..., S], data: Mapping[str, Any], where: str) -> S:
    """``cls(**data)``, unknown keys rejected and errors named under ``where``.

    Examples:
        >>> from wrapped_optim.config import HybridConfig
        >>> try:
        ...     from_mapping(HybridConfig, {"on_stale": "never"}, "hybrid")
        ... except ConfigError as error:
        ...     error.field
        'hybrid.on_stale'
    """
    kwargs = known_keys(cast(type, cls), data, where)
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise (error.under(where) if where else error) from None


def read_toml(path: str | Path, table: str | None) -> dict[str, Any]:
    """A TOML document, or its nested ``table`` (dotted path), as a dict.

    Raises:
        ConfigError: the file is not valid TOML (its field is the file's path), or ``table``
            is missing or not a table.

    Examples:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "x.toml"
        >>> _ = path.write_text("[tool.x]\\nlr = 0.1\\n")
        >>> read_toml(path, "tool.x")
        {'lr': 0.1}
    """
    with open(path, "rb") as handle:
        try:
            document = tomllib.load(handle)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(
                os.fspath(path), f"is not valid TOML ({error}); fix the syntax at that place"
            ) from error
    if table is None:
        return document
    node: Any = document
    for part in table.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ConfigError(table, f"no such table in {path}")
        node = node[part]
    if not isinstance(node, Mapping):
        raise ConfigError(table, f"is not a table in {path}")
    return dict(node)


def toml_value(value: Any) -> str:
    """One scalar as TOML text.

    Examples:
        >>> toml_value(True), toml_value(4096), toml_value('say "hi"')
        ('true', '4096', '"say \\\\"hi\\\\""')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} to TOML")
