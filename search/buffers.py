"""Page-aligned numpy buffers, so a kernel is always timed with the same placement of its
inputs and output: the offsets of a matmul's A, B and C modulo 4 KiB changed one kernel's time
from 0.79 to 5.9 ms (cache-set conflicts and 4K aliasing between the arrays' rows)."""
from __future__ import annotations

import numpy as np

PAGE = 4096


def aligned_empty(shape: tuple[int, ...], dtype, align: int = PAGE) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray, align: int = PAGE) -> np.ndarray:
    """A C-contiguous copy of `a` whose data starts on an `align`-byte boundary."""
    out = aligned_empty(a.shape, a.dtype, align)
    out[...] = a
    return out
