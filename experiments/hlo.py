"""Collectives in a compiled program's HLO text: how many of each kind and the bytes of their operands.

`collective_bytes(compiled.as_text())` -> {"all-reduce": {"count": n, "bytes": b}, ...} for every kind
in `KINDS` (zeros where absent). Async pairs (`all-gather-start` / `-done`) count once, at the start;
`ragged-all-to-all` counts as all-to-all. Operand bytes are per device (the SPMD program of one
device). A collective inside a loop body is counted once: this is the program's static traffic, not
multiplied by trip counts (our train step has no loops around collectives).
"""

from __future__ import annotations

import math
import re

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_ALIASES = {"ragged-all-to-all": "all-to-all"}

# Bytes per element of HLO primitive types (sub-byte types round up: s4/u4 pack two per byte).
_ITEMSIZE = {
    "pred": 1,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_NAME = re.compile(r"%([\w.\-]+)")


def type_bytes(hlo_type: str) -> int:
    """Bytes of an HLO type string: an array `f32[16,8]{1,0}` or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(hlo_type):
        size = _ITEMSIZE.get(dtype)
        if size is None:
            size = 1 if dtype.startswith("f8") or dtype.startswith("f4") else 0
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return int(math.ceil(total))


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group that opens at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _instructions(hlo_text: str):
    """(name, type, opcode, operand text) of each instruction line."""
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        rest = line[m.end() :]
        if rest.startswith("("):  # tuple type
            end = _balanced(rest, 0)
            hlo_type, rest = rest[:end], rest[end:].lstrip()
        else:
            hlo_type, _, rest = rest.partition(" ")
        opcode, paren, tail = rest.partition("(")
        if not paren:
            continue
        operands = tail[: _balanced("(" + tail, 0) - 2]
        yield m.group(1), hlo_type, opcode.strip(), operands


def collective_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """Count and operand bytes per collective kind in compiled HLO text (see the module docstring)."""
    types: dict[str, str] = {}
    found = []
    for name, hlo_type, opcode, operands in _instructions(hlo_text):
        types[name] = hlo_type
        kind = _ALIASES.get(opcode, opcode)
        if kind.endswith("-start"):
            kind = kind[: -len("-start")]
        if kind in KINDS:
            found.append((kind, operands))
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for kind, operands in found:
        out[kind]["count"] += 1
        # Operands print as `%name` (shapes looked up from their definitions) or `f32[8]{0} %name`.
        names = _NAME.findall(operands)
        if names and all(n in types for n in names):
            out[kind]["bytes"] += sum(type_bytes(types[n]) for n in names)
        else:
            out[kind]["bytes"] += type_bytes(operands)
    return out
