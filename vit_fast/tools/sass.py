"""Instruction cost of a compiled kernel's tensor-core loop, read from its SASS (CONTRIBUTING.md 3b2, issue 19).

From ``cuobjdump --dump-sass`` of a cubin (the cuobjdump inside the Triton wheel), every loop (a block closed by
a backward branch) holding tensor-core instructions is taken, innermost first: ``HMMA`` on sm_80 (one per warp,
``HMMA.16816`` = 16x8x16) and ``HGMMA`` on sm_90 (one per warpgroup, ``HGMMA.64xNx16``). Per iteration of such a
loop, with ``W`` warps in the block:

- instructions per warp: the loop's static instruction count (each issued once per iteration);
- issue cycles = instructions x W / 4 (four schedulers per SM, one instruction per clock each);
- MMA cycles = the iteration's FLOPs / the dense tensor rate per SM (bf16/fp16: 2,048 FLOP per clock on sm_80,
  4,096 on sm_90; tf32 half of that);
- MUFU cycles = MUFU instructions x 32 lanes x W / 16 (the special-function units take 16 lanes per clock per SM);
- ceiling = MMA / max(MMA, issue, MUFU).

The ceiling is an upper bound on the fraction of tensor peak the loop can reach: latency, memory stalls and
small wgmma tiles only lower it. It separates issue-bound loops from healthy ones; it is not a speed prediction
(Triton's tutorial GEMM reads 100% here and is measured at 53-86% of peak, see sass_reference.py).
A kernel's ceiling is its worst MMA loop's. Straight-line code outside loops (prologue, epilogue) is not counted,
except in a kernel whose tensor-core instructions sit in no loop at all (the short-sequence attention forward
scores every key at once): there the whole function is costed as one pass, prologue and epilogue included.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field

# Dense 16-bit tensor FLOPs per clock per SM (A100: 312 TFLOP/s = 108 SMs x 1.41 GHz x 2,048; H100 SXM:
# 989 TFLOP/s = 132 SMs x 1.83 GHz x 4,096). TF32 runs at half that rate.
MMA_FLOP_PER_CLOCK = {80: 2048, 90: 4096}
SCHEDULERS_PER_SM = 4
MUFU_LANES_PER_CLOCK = 16
WARP = 32

_LINE = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+(.+?)\s*;")
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?(?:BRA|BRX|JMP)\S*\s+(?:`\(([^)]+)\)|(0x[0-9a-fA-F]+))")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_HMMA = re.compile(r"^HMMA\.(\d+)\.(\S+)")
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\.(\S+)")


@dataclass
class Instruction:
    address: int
    text: str  # without the predicate

    @property
    def opcode(self) -> str:
        return self.text.split()[0] if self.text else ""


@dataclass
class Loop:
    start: int  # address of the first instruction (the backward branch's target)
    end: int  # address of the backward branch
    instructions: int = 0  # per warp per iteration
    mma: int = 0  # tensor-core instructions per warp per iteration
    mma_kind: str = ""  # e.g. "HGMMA.64x256x16" or "HMMA.16816"
    mufu: int = 0  # MUFU instructions per warp per iteration
    flops: float = 0.0  # tensor FLOPs per iteration of the whole block
    issue_cycles: float = 0.0
    mma_cycles: float = 0.0
    mufu_cycles: float = 0.0

    @property
    def ceiling(self) -> float:
        bound = max(self.mma_cycles, self.issue_cycles, self.mufu_cycles)
        return self.mma_cycles / bound if bound else 0.0

    @property
    def bound_by(self) -> str:
        bound = max(self.mma_cycles, self.issue_cycles, self.mufu_cycles)
        return "MMA" if bound == self.mma_cycles else ("issue" if bound == self.issue_cycles else "MUFU")

    def describe(self) -> str:
        return (f"{self.instructions} instr/warp vs {self.mma} {self.mma_kind} ({self.mufu} MUFU): "
                f"MMA {self.mma_cycles:.0f}, "
                f"issue {self.issue_cycles:.0f}, MUFU {self.mufu_cycles:.0f} cycles/iter -> {self.ceiling:.0%}")


@dataclass
class SassCost:
    """The instruction cost of one kernel: its MMA loops, worst first."""

    arch: int
    num_warps: int
    loops: list[Loop] = field(default_factory=list)

    @property
    def ceiling(self) -> float | None:
        return min(loop.ceiling for loop in self.loops) if self.loops else None

    @property
    def worst(self) -> Loop | None:
        return min(self.loops, key=lambda loop: loop.ceiling) if self.loops else None

    def to_dict(self) -> dict:
        return dict(arch=self.arch, num_warps=self.num_warps, loops=[asdict(loop) for loop in self.loops])

    @classmethod
    def from_dict(cls, d: dict) -> SassCost:
        return cls(d["arch"], d["num_warps"], [Loop(**loop) for loop in d["loops"]])


def cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def dump_sass(cubin: bytes) -> str:
    """``cuobjdump --dump-sass`` of a cubin, as text."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([cuobjdump(), "--dump-sass", path], capture_output=True, text=True, check=True).stdout


def parse_functions(sass: str) -> dict[str, tuple[list[Instruction], dict[str, int]]]:
    """{function name: (instructions in address order, {label: address})}."""
    functions: dict[str, tuple[list[Instruction], dict[str, int]]] = {}
    current: tuple[list[Instruction], dict[str, int]] | None = None
    pending: list[str] = []
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = functions.setdefault(m.group(1), ([], {}))
            pending = []
            continue
        if current is None:
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _LINE.search(line)
        if m:
            address = int(m.group(1), 16)
            text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())
            if pending:
                current[1].update({label: address for label in pending})
                pending = []
            current[0].append(Instruction(address, text))
    if not functions:
        raise ValueError("no function in the SASS text (expected cuobjdump --dump-sass output)")
    return functions


def find_loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(start, end) address pairs of every backward branch (end = the branch, start = its target)."""
    loops = []
    for ins in instructions:
        m = _BRANCH.match(ins.text)
        if not m:
            continue
        target = labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16)
        if target is not None and target < ins.address:  # `BRA self` (the trap at the end) is no loop
            loops.append((target, ins.address))
    return sorted(set(loops))


def mma_flops(text: str) -> tuple[str, float, float] | None:
    """(kind, FLOPs per executing unit, rate factor) of a tensor-core instruction, else None. The unit is a warp
    for HMMA and a warpgroup for HGMMA; tf32 runs at half the 16-bit rate."""
    m = _HGMMA.match(text)
    if m:
        mm, n, k = (int(g) for g in m.groups()[:3])
        return f"HGMMA.{mm}x{n}x{k}", 2.0 * mm * n * k, 0.5 if "TF32" in m.group(4) else 1.0
    m = _HMMA.match(text)
    if m:
        shape = m.group(1)
        dims = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4), "168": (16, 8, 8)}.get(shape)
        if dims is None:
            return None
        return f"HMMA.{shape}", 2.0 * dims[0] * dims[1] * dims[2], 0.5 if "TF32" in m.group(2) else 1.0
    return None


def analyze(sass: str, arch: int, num_warps: int) -> SassCost:
    """The MMA loops of the (one) kernel in `sass`: innermost loops holding tensor-core instructions."""
    if arch not in MMA_FLOP_PER_CLOCK:
        raise ValueError(f"arch must be one of {sorted(MMA_FLOP_PER_CLOCK)}, got {arch}")
    cost = SassCost(arch, num_warps)
    for instructions, labels in parse_functions(sass).values():
        spans = find_loops(instructions, labels)
        with_mma = []
        for start, end in spans:
            body = [i for i in instructions if start <= i.address <= end]
            if any(mma_flops(i.text) for i in body):
                with_mma.append((start, end, body))
        for start, end, body in with_mma:
            if any(s2 >= start and e2 <= end and (s2, e2) != (start, end) for s2, e2, _ in with_mma):
                continue  # an inner loop holds the MMAs: that one is the main loop
            cost.loops.append(_loop_cost(start, end, body, arch, num_warps))
        if not with_mma and instructions and any(mma_flops(i.text) for i in instructions):  # straight-line MMAs
            cost.loops.append(_loop_cost(instructions[0].address, instructions[-1].address, instructions, arch,
                                         num_warps))
    cost.loops.sort(key=lambda loop: loop.ceiling)
    return cost


def _loop_cost(start: int, end: int, body: list[Instruction], arch: int, num_warps: int) -> Loop:
    loop = Loop(start, end, instructions=len(body))
    kinds = []
    mma_cycles = 0.0
    for ins in body:
        if ins.opcode.startswith("MUFU"):
            loop.mufu += 1
        info = mma_flops(ins.text)
        if info is None:
            continue
        kind, flops, rate = info
        loop.mma += 1
        units = num_warps / 4 if kind.startswith("HGMMA") else num_warps
        loop.flops += flops * units
        mma_cycles += flops * units / (MMA_FLOP_PER_CLOCK[arch] * rate)
        if kind not in kinds:
            kinds.append(kind)
    loop.mma_kind = "+".join(kinds)
    loop.mma_cycles = mma_cycles
    loop.issue_cycles = loop.instructions * num_warps / SCHEDULERS_PER_SM
    loop.mufu_cycles = loop.mufu * WARP * num_warps / MUFU_LANES_PER_CLOCK
    return loop


def analyze_cubin(cubin: bytes, arch: int, num_warps: int) -> SassCost:
    return analyze(dump_sass(cubin), arch, num_warps)
