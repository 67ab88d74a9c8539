"""Reading a compiled program's scheduled HLO (`compiled.as_text()`) for what the ring cares about: in
which order a loop body starts its transfers, runs its kernel and waits for the transfers, how much
VMEM each kernel asked for and uses, and how many bytes each kind of collective moves."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator

RING_OPS = ("collective-permute-start", "collective-permute-done", "conditional")
KERNEL_TARGETS = ("tpu_custom_call",)  # Mosaic kernels


class Op(str):
    """One ring-relevant instruction of a loop body: its kind (the string itself), its `name`, and for a
    collective-permute-done the name of the start it completes (`completes`)."""

    name: str
    completes: str | None


def _op(kind: str, line: str) -> Op:
    op = Op(kind)
    op.name = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) =", line).group(1)
    completes = re.search(r"collective-permute-done\(%?([\w.\-]+)", line) if kind == "collective-permute-done" else None
    op.completes = completes.group(1) if completes else None
    return op


def loop_bodies(hlo: str) -> list[list[Op]]:
    """For each while loop of the module, in the order the loops appear, the ring-relevant instructions
    of its body in scheduled order: "collective-permute-start", "collective-permute-done",
    "conditional" (a step's skippable kernel) and "kernel" (a Mosaic custom call)."""
    computations = {}
    for block in re.split(r"\n(?=\S.*\{\n)", hlo):
        name = re.match(r"%?(\S+)", block.split("\n", 1)[0])
        ops = []
        for line in block.split("\n")[1:]:
            kind = next((op for op in RING_OPS if f" {op}(" in line), None)
            if kind is None and any(target in line for target in KERNEL_TARGETS):
                kind = "kernel"
            if kind is not None:
                ops.append(_op(kind, line))
        computations[name.group(1) if name else ""] = ops
    bodies = re.findall(r"\swhile\(.*?body=%?([\w.\-]+)", hlo)
    return [computations[body] for body in bodies if body in computations]


def overlap_problem(body: list[Op]) -> str | None:
    """Why the transfers of a loop body (from `loop_bodies`) do not all overlap its compute -- some
    collective-permute with no kernel (or branch) scheduled between its start and its completion -- or
    None."""
    compute = [i for i, op in enumerate(body) if op in ("conditional", "kernel")]
    starts = {op.name: i for i, op in enumerate(body) if op == "collective-permute-start"}
    dones = [(i, op.completes) for i, op in enumerate(body) if op == "collective-permute-done"]
    if not compute or not dones:
        return f"no {'kernel' if not compute else 'transfer'} in the loop body"
    # a transfer started in an earlier iteration (the loop rotated) is in flight from the body's start
    bare = [name for i, name in dones if not any(starts.get(name, -1) < c < i for c in compute)]
    if bare:
        return f"{len(bare)} of {len(dones)} transfers overlap no kernel: {', '.join(bare)}"
    return None


def kernel_vmem(hlo: str) -> dict[str, tuple[int, int]]:
    """Per Mosaic kernel of the module (by instruction name), the scoped VMEM it was given and the
    VMEM it uses, in bytes. Its backend config says where its scoped region starts and how long it is
    (`scoped_memory_configs`: offset, size) and how far into VMEM its use reaches
    (`used_scoped_memory_configs`, from offset 0); where XLA keeps VMEM of its own below the region
    (v5p: 4 MiB), the kernel's use is the reach less the region's offset."""
    kernels = {}
    for line in hlo.split("\n"):
        if "tpu_custom_call" not in line:
            continue
        name = re.match(r"\s*(?:ROOT\s+)?%?(\S+) =", line)
        region = re.search(r'"scoped_memory_configs":\[\{[^]]*?"offset":"(\d+)","size":"(\d+)"', line)
        reach = re.search(r'"used_scoped_memory_configs":\[\{[^]]*?"offset":"(\d+)","size":"(\d+)"', line)
        if name and region and reach:
            offset, size = int(region.group(1)), int(region.group(2))
            kernels[name.group(1)] = (size, int(reach.group(1)) + int(reach.group(2)) - offset)
    return kernels


COLLECTIVE_KINDS = ("collective-permute", "all-to-all", "all-gather", "reduce-scatter")
_ELEMENT_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16,
                 "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "token": 0}
_INSTRUCTION = re.compile(r"\s+(?:ROOT\s+)?%?[\w.\-]+ = (?P<type>.*?) (?P<op>[\w\-]+)\(")
_NAME = r"%?([\w.\-]+)"


def _type_bytes(text: str) -> int:
    """Bytes of an HLO type: an array such as `bf16[1,256,2,64]{3,2,1,0}`, or a tuple of them (summed)."""
    total = 0
    for element, dims in re.findall(r"\b(\w+)\[([\d,<=]*)\]", text):
        bits = 8 if element.startswith("f8") else _ELEMENT_BITS.get(element)
        if bits is None:
            raise ValueError(f"unknown HLO element type {element!r} in {text[:80]!r}")
        size = 1
        for dim in filter(None, dims.replace("<=", "").split(",")):
            size *= int(dim)
        total += -(-size * bits // 8)
    return total


def _callees(line: str, op: str) -> list[tuple[str, int]]:
    """The computations an instruction runs, each with how many times per execution of the instruction:
    a while body its known trip count (1 if unknown), anything else it calls once (an async-done or
    -update names the computation its async-start already ran; a loop condition holds no collective)."""
    if op in ("async-done", "async-update"):
        return []
    body = re.search(r"\bbody=" + _NAME, line)
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    called = [(body.group(1), int(trips.group(1)) if trips else 1)] if body else []
    called += [(name, 1) for name in re.findall(r"\b(?:calls|to_apply|true_computation|false_computation)=" + _NAME,
                                                 line)]
    branches = re.search(r"\bbranch_computations=\{([^}]*)\}", line)
    return called + [(name, 1) for name in re.findall(_NAME, branches.group(1))] if branches else called


_LINE = re.compile(r"\s+(?:ROOT\s+)?%?([\w.\-]+) = .*? ([\w\-]+)\((.*?)\)")


def _computations(text: str) -> dict[str, dict[str, tuple[str, list[str], str]]]:
    """Per computation of an HLO module's text, its instructions by name: (opcode, operand names, line);
    the root also under the key "ROOT"."""
    computations: dict[str, dict[str, tuple[str, list[str], str]]] = {}
    for line in text.split("\n"):
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            body = computations.setdefault(re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", line).group(1), {})
        elif (match := _LINE.match(line)) and computations:
            operands = re.findall(r"%([\w.\-]+)", match.group(3))
            body[match.group(1)] = (match.group(2), operands, line)
            if line.lstrip().startswith("ROOT"):
                body["ROOT"] = body[match.group(1)]
    return computations


def _through_copies(body: dict, name: str) -> str:
    """The instruction of `body` that `name` copies or bitcasts, through any number of them."""
    while name in body and body[name][0] in ("copy", "bitcast"):
        name = body[name][1][0]
    return name


def _constant(body: dict, name: str) -> int | None:
    """The integer `name` holds in `body`, followed through copies and bitcasts; None if not a constant."""
    name = _through_copies(body, name)
    found = re.search(r"constant\((-?\d+)\)", body[name][2]) if name in body and body[name][0] == "constant" else None
    return int(found.group(1)) if found else None


def _element(body: dict, name: str) -> int | None:
    """The tuple index of a `get-tuple-element` of the computation's parameter (through copies), else None."""
    name = _through_copies(body, name)
    op, operands, line = body.get(name, ("", [], ""))
    if op != "get-tuple-element" or body.get(operands[0], ("",))[0] != "parameter":
        return None
    return int(re.search(r"\bindex=(\d+)", line).group(1))


def _trip_count(computations: dict, caller: dict, operands: list[str], line: str) -> int | None:
    """The trips of the while loop `line` (in `caller`, on the init tuple `operands[0]`) when it counts
    `i = start; i < bound; i += step` with constants, else None."""
    cond, body = (computations.get(re.search(key + r"=%?([\w.\-]+)", line).group(1), {})
                  for key in ("condition", "body"))
    compare, compared, compare_line = cond.get("ROOT", ("", [], ""))
    init = caller.get(operands[0]) if operands else None
    if compare != "compare" or len(compared) != 2 or "direction=LT" not in compare_line or init is None:
        return None
    index, bound = _element(cond, compared[0]), _constant(cond, compared[1])
    if index is None or bound is None or init[0] != "tuple" or body.get("ROOT", ("",))[0] != "tuple":
        return None
    start = _constant(caller, init[1][index])
    add, added = body.get(_through_copies(body, body["ROOT"][1][index]), ("", []))[:2]
    step = _constant(body, added[1]) if add == "add" and _element(body, added[0]) == index else None
    if start is None or step is None or step <= 0:
        return None
    return max(0, math.ceil((bound - start) / step))


_ALL_COLLECTIVES = tuple(op for kind in (*COLLECTIVE_KINDS, "all-reduce") for op in (kind, kind + "-start"))


def _carrier(computations: dict, ops: tuple[str, ...]) -> Callable[[str, str], bool]:
    """`carries(op, line)`: whether an instruction of `computations` is one of `ops`, or runs one through
    the computations it calls (a loop, a call, a conditional)."""
    holding: dict[str, bool] = {}

    def holds(name: str) -> bool:
        if name not in holding:
            holding[name] = False  # a computation does not call itself
            holding[name] = any(carries(op, line) for op, _, line in computations.get(name, {}).values())
        return holding[name]

    def carries(op: str, line: str) -> bool:
        return op in ops or any(holds(callee) for callee, _ in _callees(line, op))

    return carries


def with_trip_counts(text: str) -> str:
    """`text` with the trip count of every while loop that lacks one and runs a collective written into
    its backend config, where `collective_bytes` reads it: the TPU compiler keeps its own config there,
    without `known_trip_count`, so every loop would count once. A loop `for i = c; i < n; i += s` has
    ceil((n - c) / s) trips, read from its condition, the init tuple and its body; `ValueError` for a loop
    of another shape that runs a collective, rather than a wrong count (a loop without one, such as the
    scan kernel's over the tiles it visits, counts nothing whatever its trips)."""
    computations = _computations(text)
    runs_collective = _carrier(computations, _ALL_COLLECTIVES)
    lines = text.split("\n")
    for caller in computations.values():
        for op, operands, line in [entry for key, entry in caller.items() if key != "ROOT"]:
            if op != "while" or "known_trip_count" in line or not runs_collective(op, line):
                continue
            trips = _trip_count(computations, caller, operands, line)
            if trips is None:
                raise ValueError(f"cannot read the trip count of this loop: {line.strip()[:200]}")
            count = f'"known_trip_count":{{"n":"{trips}"}}'
            annotated = (line.replace("backend_config={", "backend_config={" + count + ",", 1)
                         if "backend_config={" in line else f"{line}, backend_config={{{count}}}")
            lines[lines.index(line)] = annotated
    return "\n".join(lines)


def _executions(hlo: str) -> Iterator[tuple[dict, re.Match, int]]:
    """Each instruction of a compiled module (`compiled.as_text()`) that runs, with how many times: the
    module's computations by name (as `_computations` reads them), the instruction's match of
    `_INSTRUCTION`, and its executions. An instruction in a while body runs the loop's `known_trip_count`
    times (read from the loop itself where the compiler does not write it: `with_trip_counts`), nested
    loops multiply; each branch of a conditional counts once, as if it ran (an upper bound)."""
    text = with_trip_counts(hlo)
    entry = re.search(r"^ENTRY\s+" + _NAME, text, re.MULTILINE)
    if entry is None:
        raise ValueError("hlo is not an HLO module's text: it has no ENTRY computation")
    bodies = _computations(text)
    runs = dict.fromkeys(bodies, 0)
    runs[entry.group(1)] = 1
    for comp in reversed(list(bodies)):  # callers print after their callees: walk from ENTRY down
        lines = [line for key, (_, _, line) in bodies[comp].items() if key != "ROOT"] if runs[comp] else []
        for match in filter(None, map(_INSTRUCTION.match, lines)):
            yield bodies, match, runs[comp]
            for callee, times in _callees(match.string, match.group("op")):
                if callee in runs:
                    runs[callee] += runs[comp] * times


def collective_bytes(hlo: str, kinds: tuple[str, ...] = COLLECTIVE_KINDS) -> dict[str, int]:
    """Bytes each device's collectives produce in a compiled module (`compiled.as_text()`), per kind of
    `COLLECTIVE_KINDS`: for every execution of a collective instruction (`_executions`), the size of its
    result on one device -- an all-gather's gathered buffer, an all-to-all's exchanged tensor, a
    collective-permute's received shard, a reduce-scatter's scattered piece -- summed over tuple results.
    An async pair counts once, by its `-done` (a generic `async-start` by the collective in the
    computation it calls). `kinds` may add "all-reduce" (its result: the whole reduced buffer).
    `tuner.models.strategy_model` reports the same quantity, and from it the bytes each device puts on its
    links."""
    counts = dict.fromkeys(kinds, 0)
    for _, match, runs in _executions(hlo):
        kind = match.group("op").removesuffix("-done")
        if kind in counts:
            counts[kind] += runs * _type_bytes(match.group("type"))
    return counts


MOVES = ("copy", "slice", "concatenate")  # the kinds of `moved_bytes`
_MOVING = {"parameter", "constant", "bitcast", "reshape", "transpose", "copy", "tuple", "get-tuple-element",
           "slice", "dynamic-slice", "concatenate"}


def _moves(bodies: dict, match: re.Match) -> str | None:
    """The kind of `MOVES` of an instruction that only moves data, or None: a copy, or a fusion of nothing
    but slices, concatenations, copies and relayouts (what XLA:GPU wraps a slice fed to a custom call in,
    `wrapped_slice`), and the scalar arithmetic of a dynamic slice's offsets."""
    op = match.group("op")
    if op in ("copy", "copy-done"):
        return "copy"
    called = re.search(r"\bcalls=" + _NAME, match.string) if op == "fusion" else None
    fused = bodies.get(called.group(1), {}) if called else {}
    ops = {entry[0] for key, entry in fused.items() if key != "ROOT" and not _scalar(entry[2])}
    if not ops or not ops <= _MOVING:
        return None
    return "concatenate" if "concatenate" in ops else "slice" if ops & {"slice", "dynamic-slice"} else "copy"


def _scalar(line: str) -> bool:
    """Whether an instruction's result is a scalar (an offset's arithmetic, in a fused dynamic slice)."""
    match = _INSTRUCTION.match(line)
    return match is not None and re.fullmatch(r"\w+\[\]", match.group("type").strip()) is not None


def moved_bytes(hlo: str) -> dict[str, int]:
    """Bytes each device writes in a compiled module (`compiled.as_text()`) with kernels that compute
    nothing, per kind of `MOVES`: copies (`copy`, an async copy by its `-done`, a fusion of relayouts),
    slices (a fusion of slices, such as the copy XLA:GPU makes of a slice it feeds to cuDNN) and
    concatenations; the result size of each execution (`_executions`). A dynamic-update-slice writes in
    place, and is not counted."""
    counts = dict.fromkeys(MOVES, 0)
    for bodies, match, runs in _executions(hlo):
        kind = _moves(bodies, match)
        if kind is not None:
            counts[kind] += runs * _type_bytes(match.group("type"))
    return counts


def gathers(hlo: str) -> list[tuple[str, int]]:
    """Every all-gather of a compiled module (`compiled.as_text()`): its result type on one device and
    that type's bytes, largest first. An async pair counts once, by its `-done`."""
    found = []
    for match in filter(None, map(_INSTRUCTION.match, hlo.split("\n"))):
        if match.group("op") in ("all-gather", "all-gather-done"):
            found.append((match.group("type"), _type_bytes(match.group("type"))))
    return sorted(found, key=lambda pair: -pair[1])


def unordered_collectives(hlo: str, kind: str = "collective-permute") -> list[tuple[str, str]]:
    """Pairs of instructions that may have a `kind` collective in flight at the same time: in one
    computation, two that are such a collective or run one (a loop, a call, a conditional), with no data
    path from either to the other. jax 0.10.2 gives every collective the same channel id, and XLA:CPU
    then joins two collectives of one kind in flight at once into one rendezvous: it aborts, hangs or
    corrupts its heap (benchmarks/cpu_ring/README.md). An empty list means the module cannot do that. `hlo` is a
    compiled module's text (`compiled.as_text()`: scheduled, each operand defined before its use)."""
    computations = _computations(hlo)
    carries = _carrier(computations, (kind, kind + "-start"))
    pairs = []
    for body in computations.values():
        names = [name for name in body if name != "ROOT"]
        carriers = [name for name in names if carries(body[name][0], body[name][2])]
        before: dict[str, set[str]] = {}
        for name in names:  # HLO text defines every operand before its use
            before[name] = set().union(*({op} | before.get(op, set()) for op in body[name][1] if op in body))
        pairs += [(a, b) for i, a in enumerate(carriers) for b in carriers[i + 1:]
                  if a not in before[b] and b not in before[a]]
    return pairs


__all__ = ["COLLECTIVE_KINDS", "MOVES", "collective_bytes", "gathers", "kernel_vmem", "loop_bodies", "moved_bytes",
           "overlap_problem", "unordered_collectives", "with_trip_counts"]
