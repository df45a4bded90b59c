"""Reading a compiled program: its copies, collectives and temporary memory, from the optimized HLO and XLA's
memory analysis (deterministic, unlike timings), so a test can hold the decode step to doing its cache updates
in place (``tests/test_step_copies.py``) and a script can count a mesh step's communication
(``scripts/mesh_step_costs.py``)."""
from __future__ import annotations

import dataclasses
import re

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
# an instruction line of HLO text: `%name = f32[1,128,2,48]{3,2,1,0} opcode(...`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z]\w*)\[([\d,]*)\](?:\{[^}]*\})?\s+([\w\-]+)\(")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    dtype: str
    shape: tuple[int, ...]
    opcode: str


def instructions(hlo_text: str) -> list[Instruction]:
    """Every array-valued instruction of an HLO module's text (tuples are skipped)."""
    out = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            shape = tuple(int(x) for x in m.group(3).split(",") if x)
            out.append(Instruction(m.group(1), m.group(2), shape, m.group(4)))
    return out


def unfused(hlo_text: str) -> str:
    """The module's text without its fusions' computations (a ``copy`` inside a fusion is an element op of that
    fusion's loop, not a buffer of its own)."""
    fused = set(re.findall(r"\bcalls=%?([\w.\-]+)", hlo_text))
    blocks = re.split(r"\n(?=\S)", hlo_text)  # a computation starts at an unindented line with its name
    return "\n".join(b for b in blocks if re.match(r"%?[\w.\-]*", b).group().lstrip("%") not in fused)


def copies_of(hlo_text: str, shapes) -> list[Instruction]:
    """The ``copy`` instructions (and async ``copy-start``) outside fusions whose result has one of ``shapes``: a
    buffer of that shape duplicated. A relayout (a transpose to another dim order) has another shape and is not
    counted."""
    shapes = {tuple(s) for s in shapes}
    return [i for i in instructions(unfused(hlo_text)) if i.opcode in ("copy", "copy-start") and i.shape in shapes]


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many instructions of each collective (sync or async start) the module holds."""
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text)) for op in COLLECTIVES}


def memory(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled program: argument, output, alias (donated, updated in place), temp
    and peak bytes (per device)."""
    mem = compiled.memory_analysis()
    peak = getattr(mem, "peak_memory_in_bytes", 0) or (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                                       + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    return {"argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
            "peak_bytes": int(peak)}
