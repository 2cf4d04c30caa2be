"""``mlx_backend.ngram.radix_sort``: the order of NumPy's stable sort by the high bits, for any data."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mlx_backend.ngram.radix_sort import DIGIT_BITS, radix_sort, radix_sort_threads

VALUES = st.integers(0, 2**63 - 1) | st.integers(0, 40) | st.sampled_from([1 << 62, 2**63 - 1])


@settings(max_examples=300, deadline=None)
@given(x=hnp.arrays(np.int64, st.integers(0, 300), elements=VALUES), lo=st.integers(0, 63),
       digit_bits=st.sampled_from([1, 3, 7, DIGIT_BITS]))
def test_radix_sort_is_a_stable_sort_by_the_high_bits(x, lo, digit_bits):
    expected = x[np.argsort(x >> lo, kind="stable")]
    got = x.copy()
    radix_sort(got, lo, np.full(x.size + 3, -7, np.int64), digit_bits)  # scratch longer than x, holding junk
    np.testing.assert_array_equal(got, expected)


@settings(max_examples=150, deadline=None)
@given(x=hnp.arrays(np.int64, st.integers(0, 300), elements=VALUES), lo=st.integers(0, 63),
       digit_bits=st.sampled_from([1, 3, 7, DIGIT_BITS]), threads=st.integers(1, 3))
def test_radix_sort_threads_sorts_as_radix_sort(x, lo, digit_bits, threads):
    """Each pass split between threads (some slices empty when there are fewer values than threads)."""
    expected = x[np.argsort(x >> lo, kind="stable")]
    got = x.copy()
    radix_sort_threads(got, lo, np.full(x.size + 3, -7, np.int64), threads, digit_bits)
    np.testing.assert_array_equal(got, expected)
