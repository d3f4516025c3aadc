"""Two fixes to the Triton 3.6 interpreter (TRITON_INTERPRET=1), applied on import when it is on.

The kernels themselves are unchanged; these only let the CPU interpreter run what the GPU compiles.
1. The interpreter holds every scalar as a 1-element array and turns it into an index with
   `int(array)`, which NumPy 2.3+ refuses for arrays with a dimension. Any loop bounded by a loaded
   value (`for tile in range(first, last)`) then fails. We convert through `.item()` instead.
2. `tl.dot` on bfloat16 operands multiplies their raw uint16 storage (the interpreter keeps bf16
   as uint16 and only converts 8-bit floats before `np.matmul`). We convert bf16 to float32 first;
   the products are exact in float32 and accumulate in the dot's float32 accumulator, as on the GPU.
3. Casting float32 to bfloat16 truncates; the GPU (and torch) round to nearest even. We round.
Nothing happens outside the interpreter.
"""

import os
import warnings


def _apply() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_optkit_fixes", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_with_scalar_index

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def as_float32(handle):
        data = (handle.data.astype(np.uint32) << 16).view(np.float32)  # bf16 is float32's top half
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        a = as_float32(a) if a.dtype.scalar == tl.bfloat16 else a
        b = as_float32(b) if b.dtype.scalar == tl.bfloat16 else b
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot_bf16

    cast_impl = builder.cast_impl

    def cast_rounding_to_bf16(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    builder.cast_impl = cast_rounding_to_bf16
    interpreter._optkit_fixes = True


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    try:
        _apply()
    except AttributeError as e:  # another triton version moved the internals these wrap
        warnings.warn(f"optkit: Triton interpreter fixes not applied ({e}); CPU runs may fail", stacklevel=1)
