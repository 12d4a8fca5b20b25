"""What ptxas makes of the Hopper jagged attention kernels (registers, stack frame, spills, warnings such as
wgmma serialisation), per kernel and bias variant. Compiles only, no timing.

  python3 scripts/device/kernel_sass.py VARIANT KERNEL > LOG 2>&1   (one compile; ptxas's report in LOG;
                                                                    SASS=1: the SASS too)
  python3 scripts/device/kernel_sass.py summary LOG ...              (a table of the reports)
  python3 scripts/device/kernel_sass.py opcodes LOG ...              (SASS=1 logs: the instructions that test
                                                                    the bias's suspects, counted per kernel)

VARIANT: "nobias", "bias", or "bias-" followed by KernelOptions.bias_probe names joined by "+" (e.g.
"bias-time_bucket"); KERNEL: fwd, dkv or dq. The shape is u1k's (H=4, D=128, SiLU, lengths in [0.9N, N),
N=1024; B=64 compiles the same kernels). MOSAIC_GPU_DUMP_PTXAS, set here before jax is imported, makes
Mosaic GPU print ptxas's report (it also prints the kernel's MLIR: the logs are large, grep them on the device).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys

# Mosaic GPU reads its dump switches when it compiles; they are set before jax is first imported all the same,
# so that nothing compiled at import time escapes them.
COMPILING = len(sys.argv) > 1 and sys.argv[1] not in ("summary", "opcodes")
if COMPILING:
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import bias_attribution as attr  # noqa: E402  (after the dump switches above)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import lib  # noqa: E402

from experiments.benchmarks import shapes  # noqa: E402
from pallas_kernels.jagged_attention import gpu_layout, gpu_sm90, gpu_sm90_backward  # noqa: E402


def _nvdisasm_beside_ptxas() -> None:
    """With SASS=1: Mosaic GPU runs nvdisasm from the CUDA root jax found (jax._src.lib.cuda_path, often a pip
    package that has ptxas but no nvdisasm; its dump then says "nvdisasm invocation failed"). Link the system's
    nvdisasm there, and ask for the SASS dump."""
    root = pathlib.Path(lib.cuda_path or "/usr/local/cuda")
    found = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
    target = root / "bin" / "nvdisasm"
    if not target.exists() and pathlib.Path(found).exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(found)
    print(f"cuda root {root}: nvdisasm {'present' if target.exists() else 'MISSING'}", flush=True)
    os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"


def compile_one(variant: str, kernel: str) -> None:
    if os.environ.get("SASS"):
        _nvdisasm_beside_ptxas()
    shape = shapes.JaggedShape(batch=64, max_seq_len=1024, heads=4, head_dim=128)
    bias = variant != "nobias"
    probe = tuple(variant.split("-", 1)[1].split("+")) if "-" in variant else ()
    lengths, q, k, v, do, off, ts, pos, tim = attr._inputs(shape, np.random.default_rng(0))
    params = attr._params(shape, bias, probe)
    inputs = gpu_layout.to_kernel_layout(
        q, k, v, off, None, *((ts, pos, tim) if bias else (None,) * 3), params
    )
    if kernel == "fwd":
        jax.jit(lambda x: gpu_sm90.forward(x, params)[0]).lower(inputs).compile()
        return
    residuals = jax.eval_shape(lambda x: gpu_layout.forward(x, params)[1], inputs)
    keep = (1, 2) if kernel == "dkv" else (0, 6, 7)
    f = jax.jit(lambda res, do: [gpu_sm90_backward.backward_mosaic_gpu(res, do, params)[i] for i in keep])
    f.lower(residuals, do).compile()


REPORT = re.compile(
    r"(Used \d+ registers[^\n]*|\d+ bytes stack frame[^\n]*|ptxas[^\n]*(?:warning|Performance)[^\n]*)"
)


def summary(logs: list[str]) -> None:
    print("| kernel, variant | ptxas's report |")
    print("| --- | --- |")
    for log in logs:
        text = pathlib.Path(log).read_text(errors="replace")
        lines = list(dict.fromkeys(m.group(1).strip()[:160] for m in REPORT.finditer(text)))
        print(f"| {pathlib.Path(log).stem} | {'; '.join(lines)} |")


# A SASS line: /*0a40*/ [@[!]P0 ]OPCODE.MODIFIERS operands ;
SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9]*)((?:\.[A-Z0-9_]+)*)")
# What each suspect of the bias's cost looks like in SASS (static counts: how often the code says it, not how
# often it runs; the main loop's share shows in which kernel and variant the counts move)
OPCODE_CLASSES = {
    "spill (LDL/STL)": ("LDL", "STL"),
    "shared atomic (ATOMS)": ("ATOMS",),
    "compare-and-swap": ("ATOMS.CAS", "ATOMS.CAST", "ATOM.CAS"),
    "shared load/store": ("LDS", "STS"),
    "branch": ("BRA", "BSSY", "BSYNC", "WARPSYNC"),
    "float -> int": ("F2I", "F2IP"),
    "MUFU (log2, exp2)": ("MUFU",),
    "wgmma (HGMMA)": ("HGMMA",),
    "wgmma wait": ("WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE"),
}


def _matches(opcode: str, name: str) -> bool:
    """Whether `opcode` (with its modifiers) is `name` or one of its forms (ATOMS.CAS: ATOMS.CAST.SPIN too)."""
    return opcode == name or opcode.startswith(name + ".") or ("." in name and opcode.startswith(name))


def opcode_counts(text: str) -> dict[str, int]:
    """Counts of OPCODE_CLASSES (and "all") over the SASS lines of `text`."""
    counts = dict.fromkeys(OPCODE_CLASSES, 0) | {"all": 0}
    for m in SASS_LINE.finditer(text):
        opcode = m.group(1) + m.group(2)
        counts["all"] += 1
        for name, forms in OPCODE_CLASSES.items():
            counts[name] += any(_matches(opcode, form) for form in forms)
    return counts


def opcodes(logs: list[str]) -> None:
    print("| kernel, variant | " + " | ".join([*OPCODE_CLASSES, "all"]) + " |")
    print("| --- |" + " ---: |" * (len(OPCODE_CLASSES) + 1))
    for log in logs:
        counts = opcode_counts(pathlib.Path(log).read_text(errors="replace"))
        print(f"| {pathlib.Path(log).stem} | " + " | ".join(str(n) for n in counts.values()) + " |")


if __name__ == "__main__":
    if sys.argv[1] == "summary":
        summary(sys.argv[2:])
    elif sys.argv[1] == "opcodes":
        opcodes(sys.argv[2:])
    else:
        compile_one(*sys.argv[1:3])
