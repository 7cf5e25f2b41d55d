"""Compiles the few-rows decode step's Triton kernel (flexdma/perkey/triton_rows.py) for
sm_90 ahead of time, on a machine without a GPU (Triton's bundled ptxas): type and layout errors
that Triton's interpreter lets pass show up here. tests/perkey/test_perkey.py runs it in a process of its
own. Prints one "ok" line a kernel variant."""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flexdma.perkey import triton_rows

TARGET = GPUTarget("cuda", 90, 32)


def build(fn, types, consts, **options):
    sig = {n: types.get(n, "i32") for n in fn.arg_names}
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=TARGET, options=options)
    print("ok", fn.__name__, consts, flush=True)
    return kernel


def strides(names):
    return {n: "i64" for n in names}


if __name__ == "__main__":
    ptr = "*{}".format
    types = dict(
        idx_ptr=ptr("i64"), valid_ptr=ptr("u8"), score_ptr=ptr("fp16"), snew_ptr=ptr("fp32"), elig_ptr=ptr("u8"),
        entry_ptr=ptr("i32"), uidx_ptr=ptr("i64"), uscore_ptr=ptr("fp16"), keep_ptr=ptr("i8"), start="i64",
        **strides("sib sip siw sab sap saw ssb ssp ssw snb snp snt seb sep set_".split()),
    )  # fmt: skip
    build(triton_rows._rows_kernel, types, dict(BW=1024, BE=2048), num_warps=4)
    sys.exit(0)
