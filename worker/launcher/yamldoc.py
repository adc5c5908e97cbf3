"""A small YAML emitter for manifests (pure): mappings, sequences, strings, integers and
booleans in block style, one document after another.

A string is written plain only when it is a run of letters, digits and ``_./:=-`` that
starts with a letter, ``_``, ``/``, ``-`` and a letter or ``--`` and a letter (an
option: ``--steps``), does not end with ``:`` and is none of YAML 1.1's booleans and
nulls (``yes``, ``off``, ``null``, ...): YAML 1.1 is what Kubernetes' reader (go-yaml) and
PyYAML implement, and there ``on`` is ``true`` and ``0700`` is an octal number.
Every other string is double-quoted, with the characters YAML cannot hold as they are
(controls, line separators, the byte order mark, ``"`` and ``\\``) escaped. The output
is deterministic: mappings keep their insertion order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from shardwire.protocol.errors import InvalidArgument, InvalidType

Value = Mapping[str, "Value"] | Sequence["Value"] | str | int | bool

_PLAIN = re.compile(r"(--?[A-Za-z]|[A-Za-z_/])[A-Za-z0-9_./:=-]*(?<!:)\Z")
_KEYWORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
# Printable, and no line break to a YAML 1.1 reader (NEL, LS and PS are line breaks).
_PRINTABLE = ((0x20, 0x7E), (0xA0, 0x2027), (0x202A, 0xD7FF), (0xE000, 0xFEFE), (0xFF00, 0xFFFD))


def dump_all(documents: Iterable[Mapping[str, Value]], *, comments: Sequence[str] = ()) -> str:
    """The documents as one YAML stream, each after a ``---``, with ``comments`` (one
    line each) at the top."""
    lines = [f"# {_comment(line)}".rstrip() for line in comments]
    for document in documents:
        lines.append("---")
        lines += _block(document, 0)
    return "\n".join(lines) + "\n"


def scalar(value: str | int | bool) -> str:
    """One scalar as YAML reads it back: the same string, integer or boolean."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        raise InvalidType(f"cannot write {type(value).__name__} {value!r} as YAML")
    if _PLAIN.match(value) and value.lower() not in _KEYWORDS:
        return value
    return '"' + "".join(_escaped(ch) for ch in value) + '"'


def _printable(ch: str) -> bool:
    code = ord(ch)
    return any(low <= code <= high for low, high in _PRINTABLE) or code >= 0x10000


def _comment(line: str) -> str:
    """A comment stays one line of printable characters (a script argument may hold a
    line break or a control character): the others are escaped as in quoted strings."""
    return "".join(ch if ch == "\t" or _printable(ch) else _escaped(ch) for ch in line)


def _escaped(ch: str) -> str:
    code = ord(ch)
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    if _printable(ch):
        return ch
    if 0xD800 <= code <= 0xDFFF:
        raise InvalidArgument(f"a lone surrogate (U+{code:04X}) is not text YAML can hold")
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _inline(value: Value) -> str:
    if isinstance(value, Mapping):
        assert not value, "only empty mappings are written inline"
        return "{}"
    if isinstance(value, list | tuple):
        assert not value, "only empty sequences are written inline"
        return "[]"
    return scalar(value)  # type: ignore[arg-type]


def _nested(value: Value) -> bool:
    return isinstance(value, Mapping | list | tuple) and len(value) > 0


def _block(value: Value, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if _nested(item):
                lines.append(f"{pad}{scalar(key)}:")
                lines += _block(item, indent + 2)
            else:
                lines.append(f"{pad}{scalar(key)}: {_inline(item)}")
        return lines
    assert isinstance(value, list | tuple), f"not a mapping or sequence: {value!r}"
    for item in value:
        if isinstance(item, Mapping) and item:
            inner = _block(item, indent + 2)
            lines.append(f"{pad}- {inner[0][indent + 2 :]}")
            lines += inner[1:]
        elif _nested(item):
            lines.append(f"{pad}-")
            lines += _block(item, indent + 2)
        else:
            lines.append(f"{pad}- {_inline(item)}")
    return lines
