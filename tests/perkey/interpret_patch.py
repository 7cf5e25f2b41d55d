"""Triton's interpreter with flexdma's NumPy fix: imported first by the interpreter scripts
(tests/perkey/interpret_*.py), which tests/perkey/test_perkey.py runs each in a process of its own. The interpreter
is chosen by TRITON_INTERPRET=1 before triton is imported."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import triton.runtime.interpreter as interpreter

# Triton's interpreter (3.6) turns a scalar into int with int(array) on a one-element array, which
# NumPy 2.4 refuses ("only 0-dimensional arrays"): loops with runtime bounds need the element itself.
_patch = getattr(interpreter, "_patch_lang_tensor", None)


def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if _patch is not None:
    interpreter._patch_lang_tensor = _patch_lang_tensor
