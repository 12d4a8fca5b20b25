"""scripts/device/kernel_sass.py's SASS opcode counts, on a hand-written dump (the device makes the real ones)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "device"))  # kernel_sass imports bias_attribution beside it
_spec = importlib.util.spec_from_file_location("kernel_sass", ROOT / "scripts" / "device" / "kernel_sass.py")
kernel_sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_sass)

SASS = """
        /*0090*/                   LDS.U.128 R4, [R2+0x100] ;
        /*00a0*/              @!P0 ATOMS.CAST.SPIN P1, [R3], R4, R5 ;
        /*00b0*/               @P1 BRA 0xa0 ;
        /*00c0*/                   ATOMS.ADD.F32 RZ, [R3], R6 ;
        /*00d0*/                   STL.64 [R1+0x10], R8 ;
        /*00e0*/                   LDL R9, [R1+0x10] ;
        /*00f0*/                   LDSM.16.M88.4 R12, [R2] ;
        /*0100*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0120*/              @UPT MUFU.LG2 R7, R7 ;
        /*0130*/                   F2I.TRUNC.NTZ R8, R7 ;
"""


def test_opcode_counts_sort_the_suspects():
    counts = kernel_sass.opcode_counts("Function : kernel\n" + SASS + "not an instruction line\n")
    assert counts["all"] == 11
    assert counts["spill (LDL/STL)"] == 2
    assert counts["shared atomic (ATOMS)"] == 2  # the CAS loop's and the native add
    assert counts["compare-and-swap"] == 1
    assert counts["shared load/store"] == 1  # LDS, not LDSM (ldmatrix)
    assert counts["branch"] == 1
    assert counts["float -> int"] == 1
    assert counts["MUFU (log2, exp2)"] == 1
    assert counts["wgmma (HGMMA)"] == 1
    assert counts["wgmma wait"] == 1
