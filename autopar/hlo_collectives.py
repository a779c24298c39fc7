"""Read the collectives out of compiled HLO text, in the byte conventions of the cost model.

all-reduce and all-to-all: the per-device buffer; all-gather: the gathered result;
reduce-scatter: the full input (result x group size). This is how tests and benchmarks
check that the lowering does what the planner decided.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4, "s16": 2,
                "u16": 2, "s8": 1, "u8": 1, "pred": 1, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(?P<kind>" +
                    "|".join(_KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclass(frozen=True)
class HloCollective:
    kind: str
    nbytes: float
    group_size: int


def _shape_bytes(text: str) -> float:
    total = 0.0
    for dtype, dims in _ARRAY.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        n = 1
        for name in re.findall(r"'([^']+)'", m.group(2)):
            n *= int(sizes.get(name, 1))
        return n
    return 1


def parse_collectives(hlo_text: str) -> list[HloCollective]:
    out = []
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)
        m = _INSTR.search(line)
        if not m:
            continue
        kind = m.group("kind")
        shape = m.group("shape")
        if m.group("start") and shape.startswith("("):
            # async start ops return (operands, results, ...): count the results half
            arrays = _ARRAY.findall(shape)
            shape = " ".join(f"{d}[{s}]" for d, s in arrays[len(arrays) // 2:]) if kind != "all-reduce" else shape
        nbytes = _shape_bytes(shape)
        group = _group_size(line)
        if kind == "reduce-scatter":
            nbytes *= group
        out.append(HloCollective(kind, nbytes, group))
    return out


def bytes_by_kind(hlo_text: str, min_group: int = 2) -> dict[str, float]:
    """Total bytes per collective kind, ignoring trivial groups of one device."""
    total: dict[str, float] = {}
    for c in parse_collectives(hlo_text):
        if c.group_size >= min_group:
            total[c.kind] = total.get(c.kind, 0.0) + c.nbytes
    return total
