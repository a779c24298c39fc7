"""Page-aligned measurement buffers (search.buffers): every input and output a kernel is timed
with starts on a 4 KiB boundary whatever was allocated before, so the arrays' relative placement
(which moved one W1 kernel from 0.79 to 5.9 ms) is the same in every run."""
import numpy as np
import pytest

from search import Task, build
from search.buffers import PAGE, aligned_copy, aligned_empty


@pytest.mark.parametrize("shape,dtype", [((512, 512), np.float32), ((3, 5, 7), np.float64), ((1,), np.int32), ((0, 4), np.float32)])
def test_aligned_empty_starts_on_a_page_whatever_came_before(shape, dtype):
    junk = [np.empty(n, np.uint8) for n in (17, 4099, 70001, 300003)]  # move malloc's next address
    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    if a.size:
        assert a.ctypes.data % PAGE == 0
    del junk


def test_aligned_copy_keeps_values_and_owns_its_memory():
    src = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # not contiguous
    c = aligned_copy(src)
    np.testing.assert_array_equal(c, src)
    assert c.ctypes.data % PAGE == 0 and c.flags.c_contiguous
    c[0, 0] = -1
    assert src[0, 0] == 0


def test_kernel_allocates_its_output_page_aligned():
    task = Task.matmul(8, 16, 4)
    ins = task.random_inputs(0)
    out = build(task, [])(*(ins[n] for n, _ in task.input_shapes))
    assert out.ctypes.data % PAGE == 0
    np.testing.assert_allclose(out, ins["A"] @ ins["B"], rtol=1e-5)
