"""The FP8 GEMMs of a lowered (pre-optimisation) StableHLO program, and where their scales come from.

The form the FP8 layers write (gem_jax/model/fp8.py, `scaled_dot`): a dot_general of the FP8 arrays
themselves (at least one e4m3), its result typed bf16 or f32, multiplied after by broadcast(a rank-0
scale) that is the product of the two operands' scales. On the H200 (jax 0.11.2) XLA compiles that to
one `__cublas$lt$matmul$f8` writing the dot's type (docs/fp8.md). The delayed recipe's scales are stored
train state, so each should *be* a jit argument, the layer's own, reaching the product through nothing
but structure that XLA removes (calls, shard_map boundaries, sharding annotations, rank-0 reshapes,
converts).

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
    """One dot operand: `format` its f8 type (None if it is not an FP8 tensor); `scale_arg` the jit argument
    its factor of the scale product the result is multiplied by is (None if computed, or no such product),
    or `scale_op` the op that computes that factor."""

    format: str | None = None
    scale_arg: str | None = None
    scale_op: str | None = None


@dataclasses.dataclass(frozen=True)
class FP8Dot:
    lhs: Operand
    rhs: Operand
    result: str  # element type of the dot's result

    scaled: bool = False  # the result is multiplied by broadcast(scale product)

    @property
    def has_pattern(self) -> bool:
        """Both operands FP8 arrays, one of them e4m3, the result bf16 or f32 and scaled after."""
        formats = (self.lhs.format, self.rhs.format)
        return all(formats) and "f8E4M3FN" in formats and self.result in ("bf16", "f32") and self.scaled

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
        reshapes and converts; else (None, the first op that computes it)."""
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
            if (name == "stablehlo.reshape" and _is_scalar(value)) or name == "stablehlo.convert":
                value = op.operands[0]
                continue
            return None, name

    def format(self, value) -> str | None:
        """The f8 type of `value` if it is an FP8 tensor (up to structure)."""
        values = self.through_structure(value)
        return (
            _element_type(values[0]) if len(values) == 1 and _F8.fullmatch(_element_type(values[0])) else None
        )

    def result_scales(self, dot) -> tuple[Operand, Operand] | None:
        """The origins of the two factors of the scale product `dot`'s result is multiplied by, as
        `scale_*` of (lhs, rhs) operands; None if the result is not multiplied by such a product."""
        result = dot.results[0]
        for use in result.uses:
            op = use.owner
            if _name(op) != "stablehlo.multiply":
                continue
            bcast = self.producer(op.operands[1 - use.operand_number])
            if (
                bcast is None
                or _name(bcast) != "stablehlo.broadcast_in_dim"
                or not _is_scalar(bcast.operands[0])
            ):
                continue
            product = bcast.operands[0]
            while (p := self.producer(product)) is not None and (
                _name(p) == "stablehlo.convert" or (_name(p) == "stablehlo.reshape" and _is_scalar(product))
            ):
                product = p.operands[0]
            if p is None or _name(p) != "stablehlo.multiply":
                return None
            return tuple(Operand(None, *self.scale_origin(f)) for f in p.operands)
        return None

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
            scales = module.result_scales(op)
            lhs_op, rhs_op = (
                dataclasses.replace(scale, format=module.format(v))
                for v, scale in zip((lhs, rhs), scales or (Operand(), Operand()))
            )
            found.append(FP8Dot(lhs_op, rhs_op, _element_type(op.results[0]), scaled=scales is not None))
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
