"""The compiled extension and what the build knows, loaded once: the bottom of flexdma's imports.

- `C`: the flexdma._C module (its import registers torch.ops.flexdma.*), None where it did not
  load; `LOAD_ERROR` says why (None when it loaded).
- `BUILD_INFO`: flexdma/_build_info.py (written by setup.py), None where absent.
- `HAVE_TRITON`: triton is installed (the per-key Triton kernels, for the CUDA calls the C++ ones
  do not take); not imported here.
- `DTYPE_CODES`: flexdma::DType's values, as the kernels' support checks take dtypes through `C`;
  `kernels_reason` asks those checks, cached.
- The constants shared with the kernels, read from csrc/flash_dma_constants.h through `C`
  (None without the extension: nothing that reads them can run then).
"""

from __future__ import annotations

import importlib.util

import torch  # first: it loads libc10 / libtorch, which flexdma._C links against

try:
    from . import _build_info as BUILD_INFO
except ImportError:  # pragma: no cover - a source tree setup.py never ran in
    BUILD_INFO = None

try:
    from . import _C as C
except Exception as e:  # pragma: no cover - only without a built extension
    C = None
    LOAD_ERROR = f"the C++ extension flexdma._C did not load ({e})"
    # The usual cause of a wheel or an old build that does not load: another torch release (the
    # extension links against torch's C++ symbols, which change between releases).
    _built_for = getattr(BUILD_INFO, "TORCH_VERSION", None)
    if _built_for is not None and _built_for != torch.__version__:
        LOAD_ERROR += (
            f"; it was built against torch {_built_for} and this is torch {torch.__version__}: "
            "rebuild it against this torch, or install the torch it was built against"
        )
else:
    LOAD_ERROR = None

HAVE_TRITON = importlib.util.find_spec("triton") is not None

# Query rows and keys of one tile of the CUDA kernels (and of one tile_meta bit).
TILE_SIZE = C.TILE_SIZE if C is not None else None
# Key tiles per int32 word of a tile_meta row.
TILES_PER_WORD = C.TILES_PER_WORD if C is not None else None
# Largest batch / head count of a CUDA grid.
MAX_GRID_DIM = C.MAX_GRID_DIM if C is not None else None
# Query rows per CTA of the C++ per-key kernels: the tiles of the lists they read.
PERKEY_TILE_ROWS = C.PERKEY_TILE_ROWS if C is not None else None
# Query rows per tile of the CPU per-key selection's lists.
PERKEY_CPU_TILE_ROWS = C.PERKEY_CPU_TILE_ROWS if C is not None else None
# key_rank of a key no row keeps (int32 max).
NEVER_KEPT = C.NEVER_KEPT if C is not None else None
# log2(e): the kernels keep scores in log2 units.
LOG2E = C.LOG2E if C is not None else None

# flexdma::DType's values (csrc/flash_dma_params.h); a dtype without one is passed as -1.
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def with_cuda() -> bool:
    """The extension loaded and was built with its CUDA kernels."""
    return LOAD_ERROR is None and BUILD_INFO is not None and bool(BUILD_INFO.WITH_CUDA)


_UNSET = object()
_REASONS: dict = {}
# Answers kept at most: the per-key check's key holds the sequence lengths, which a long run of
# varying lengths (generation through the API) would grow without bound.
_MAX_REASONS = 4096


def known_size(n) -> int:
    """A size as the kernels' checks are asked it: 0 where a traced call may leave it symbolic.
    Under dynamo (torch.compile) every size is asked as 0: a dynamic one passes isinstance(n, int)
    there, and kernels_reason (assume_constant_result) takes constants only; under torch.export's
    tracing a SymInt is not an int. The checks read these sizes against the grid's and the index
    types' limits only, and the ops check the real sizes before they launch."""
    return n if isinstance(n, int) and not torch.compiler.is_compiling() else 0


# The checks are C functions of the extension, which dynamo cannot trace: run eagerly while a model
# is traced (the answer depends on these Python values only) and cached by them.
@torch.compiler.assume_constant_result
def kernels_reason(check: str, key: tuple):
    """The CUDA kernels' own support check `check` of `C` ("cuda_unsupported_reason": the dense
    kernels', "perkey_unsupported_reason": the C++ per-key kernels') on `key`, its arguments: why
    the kernels cannot take such a call, None where they can. The ops run the same check again
    before they launch."""
    why = _REASONS.get((check, key), _UNSET)
    if why is _UNSET:
        if len(_REASONS) >= _MAX_REASONS:
            _REASONS.clear()
        why = _REASONS[(check, key)] = getattr(C, check)(*key)
    return why
