"""The FP8 GEMMs of a lowered (pre-optimisation) StableHLO program, and where their scales come from.

What XLA needs (xla/service/gpu/transforms/gemm_rewriter.cc: `MatchFp8Param`, `CreateF8CustomCall`):
each dot operand is `convert(f8 -> wider)`, optionally times (or divided by) `broadcast(scale)` with a
rank-0 scale, followed only by ops that commute with dequantisation (bitcast, broadcast, copy,
dynamic-slice, pad, reshape, select with zero, slice, transpose); at least one operand is e4m3; the
result is f32, bf16, f16 or an f8. The source puts no condition on where the scale comes from (any
scalar instruction), but on the H200 (jax 0.11.2) the rewrite was only seen to fire when the scales
were entry parameters of the jitted program (docs/benchmarks.md, "FP8 (H200)"). So we check the
stronger property: every dequantisation scale *is* a jit argument, reaching the multiply through
nothing but structure that XLA removes before the rewriter runs (calls, shard_map boundaries,
sharding annotations, rank-0 reshapes, identity converts).

`fp8_dots(lowered)` lists every dot that reads an FP8 tensor, with, per operand, the format and the
scale's origin: the jit argument's name (its pytree path, e.g. `state.fp8['hstu'][0]['uvqk']['fp8']
['x_scale']`), or the op that computes it (e.g. `stablehlo.select`). It walks the MLIR module with the
bindings jaxlib ships, so it follows values through functions and shard_map regions exactly, where a
text match could only guess.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from jaxlib.mlir import ir

_F8 = re.compile(r"f8E\w+")
_LOC = re.compile(r'loc\("((?:[^"\\]|\\.)*)"')
# Ops that XLA removes or turns into nothing before the GEMM rewriter: the value passes through.
_SHARDING_TARGETS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


@dataclasses.dataclass(frozen=True)
class Operand:
    """One dot operand: `format` the f8 type if it is convert(f8 -> f32) * broadcast(rank-0 f32 scale)
    (None otherwise); `scale_arg` the jit argument the scale is (None if it is computed), or
    `scale_op` the op that computes it."""

    format: str | None = None
    scale_arg: str | None = None
    scale_op: str | None = None


@dataclasses.dataclass(frozen=True)
class FP8Dot:
    lhs: Operand
    rhs: Operand
    result: str  # element type of the dot's result

    @property
    def has_pattern(self) -> bool:
        """Both operands dequantised as cuBLASLt wants, one of them e4m3, result f32."""
        formats = (self.lhs.format, self.rhs.format)
        return all(formats) and "f8E4M3FN" in formats and self.result == "f32"

    @property
    def scales_are_arguments(self) -> bool:
        return self.has_pattern and bool(self.lhs.scale_arg) and bool(self.rhs.scale_arg)


def _walk(op) -> Iterator:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _walk(inner)


def _name(op) -> str:
    return op.operation.name


def _element_type(value) -> str:
    t = str(value.type)  # tensor<4x8xf8E4M3FN>, tensor<f32>
    return t[t.rfind("x") + 1 : -1] if "x" in t[7:] else t[7:-1]


def _is_scalar(value) -> bool:
    return str(value.type).startswith("tensor<") and "x" not in str(value.type)[7:]


class _Module:
    def __init__(self, module: ir.Module):
        self.funcs, self.calls = {}, {}
        for op in module.body.operations:
            if _name(op) == "func.func":
                self.funcs[ir.StringAttr(op.attributes["sym_name"]).value] = op
        self.ops = [inner for func in self.funcs.values() for inner in _walk(func)]
        for op in self.ops:
            if _name(op) == "func.call":
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                self.calls.setdefault(callee, []).append(op)

    def _terminator(self, op):
        return op.regions[0].blocks[0].operations[len(op.regions[0].blocks[0].operations) - 1]

    def through_structure(self, value) -> list:
        """The values `value` is, looking through calls, shard_map regions and sharding annotations
        (several where a function has several call sites)."""
        if isinstance(value, ir.BlockArgument):
            parent = value.owner.owner
            name = _name(parent)
            if name == "func.func":
                func = ir.StringAttr(parent.attributes["sym_name"]).value
                sites = self.calls.get(func, [])
                if not sites:
                    return [value]  # an argument of the entry function
                return [v for call in sites for v in self.through_structure(call.operands[value.arg_number])]
            if name == "sdy.manual_computation":
                return self.through_structure(parent.operands[value.arg_number])
            return [value]
        op = value.owner
        name = _name(op)
        if name == "func.call":
            callee = self.funcs[ir.FlatSymbolRefAttr(op.attributes["callee"]).value]
            return self.through_structure(self._terminator(callee).operands[value.result_number])
        if name == "sdy.manual_computation":
            return self.through_structure(self._terminator(op).operands[value.result_number])
        if name == "sdy.sharding_constraint" or (
            name == "stablehlo.custom_call"
            and ir.StringAttr(op.attributes["call_target_name"]).value in _SHARDING_TARGETS
        ):
            return self.through_structure(op.operands[0])
        return [value]

    def producer(self, value):
        """The op that computes `value` (through structure), or None for an argument or an ambiguous one."""
        values = self.through_structure(value)
        if len(values) != 1 or isinstance(values[0], ir.BlockArgument):
            return None
        return values[0].owner

    def scale_origin(self, value) -> tuple[str | None, str | None]:
        """(argument name, None) if the scalar `value` is a jit argument up to structure, rank-0
        reshapes and identity converts; else (None, the first op that computes it)."""
        while True:
            values = self.through_structure(value)
            if len(values) != 1:
                origins = {self.scale_origin(v) for v in values}
                return origins.pop() if len(origins) == 1 else (None, "several call sites")
            value = values[0]
            if isinstance(value, ir.BlockArgument):
                parent = value.owner.owner
                if _name(parent) == "func.func" and not self.calls.get(
                    ir.StringAttr(parent.attributes["sym_name"]).value
                ):
                    m = _LOC.search(str(value.location))
                    return (m.group(1) if m else f"%arg{value.arg_number}"), None
                return None, f"argument of {_name(parent)}"
            op = value.owner
            name = _name(op)
            same_type = len(op.operands) == 1 and str(op.operands[0].type) == str(value.type)
            if (name == "stablehlo.reshape" and _is_scalar(value)) or (
                name == "stablehlo.convert" and same_type
            ):
                value = op.operands[0]
                continue
            return None, name

    def dequant(self, value) -> Operand:
        op = self.producer(value)
        if op is None or _name(op) != "stablehlo.multiply":
            return Operand()
        a, b = op.operands
        for convert, bcast in ((a, b), (b, a)):
            c, s = self.producer(convert), self.producer(bcast)
            if (
                c is None
                or s is None
                or _name(c) != "stablehlo.convert"
                or _name(s) != "stablehlo.broadcast_in_dim"
            ):
                continue
            source, scale = c.operands[0], s.operands[0]
            if not _F8.fullmatch(_element_type(source)) or _element_type(convert) != "f32":
                continue
            if not _is_scalar(scale) or _element_type(scale) != "f32":
                continue
            arg, computed = self.scale_origin(scale)
            return Operand(_element_type(source), arg, computed)
        return Operand()

    def reads_f8(self, value, depth: int = 8) -> bool:
        """Whether `value` is computed from an FP8 tensor by the ops the rewriter looks through
        (`FindF8SubgraphRecursive`: unary ops, operand 0 of divide, dynamic-slice and pad, either
        operand of multiply, the two values of select): a dot reading it is meant to be FP8."""
        if _F8.fullmatch(_element_type(value)):
            return True
        op = self.producer(value)
        if depth == 0 or op is None:
            return False
        name, operands = _name(op), list(op.operands)
        if len(operands) == 1 or name in ("stablehlo.divide", "stablehlo.dynamic_slice", "stablehlo.pad"):
            candidates = operands[:1]
        elif name == "stablehlo.multiply":
            candidates = operands
        elif name == "stablehlo.select":
            candidates = operands[1:]
        else:
            return False
        return any(self.reads_f8(v, depth - 1) for v in candidates)


def fp8_dots(lowered) -> tuple[list[FP8Dot], int]:
    """The dots of `lowered` (a `jax.stages.Lowered`) that read an FP8 tensor, and the number of dots
    in all."""
    module = _Module(lowered.compiler_ir("stablehlo"))
    found, total = [], 0
    for op in module.ops:
        if _name(op) != "stablehlo.dot_general":
            continue
        total += 1
        lhs, rhs = op.operands
        if module.reads_f8(lhs) or module.reads_f8(rhs):
            found.append(FP8Dot(module.dequant(lhs), module.dequant(rhs), _element_type(op.results[0])))
    return found, total


def summary(dots: list[FP8Dot], total: int) -> dict:
    """Counts for a report: dots in all, dots that read FP8, those in the cuBLASLt pattern, and those
    whose scales are all jit arguments (what the H200 was found to need)."""
    return {
        "dots": total,
        "fp8_dots": len(dots),
        "fp8_pattern": sum(d.has_pattern for d in dots),
        "scales_are_arguments": sum(d.scales_are_arguments for d in dots),
    }
