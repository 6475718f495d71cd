"""The hand-written DeleteResponse encoding equals the generated class's."""

from cedana_shim.api.containerd.task.v2 import shim_pb2
from cedana_shim.wire import delete_response
from hypothesis import given
from hypothesis import strategies as st


@given(
    pid=st.integers(0, 2**32 - 1),
    status=st.integers(0, 2**32 - 1),
    seconds=st.integers(0, 2**32),  # to 2106; floats hold microseconds that far
    micros=st.integers(0, 999_999),
)
def test_delete_response_matches_generated(
    pid: int, status: int, seconds: int, micros: int
) -> None:
    ours = shim_pb2.DeleteResponse.FromString(delete_response(pid, status, seconds + micros / 1e6))
    assert (ours.pid, ours.exit_status) == (pid, status)
    # A float carries about 15 digits: to the microsecond for any date this century.
    got = ours.exited_at.seconds * 1_000_000 + ours.exited_at.nanos // 1000
    assert abs(got - (seconds * 1_000_000 + micros)) <= 1
    assert 0 <= ours.exited_at.nanos < 1_000_000_000


def test_delete_response_exact_bytes() -> None:
    expected = shim_pb2.DeleteResponse(pid=42, exit_status=137)
    expected.exited_at.seconds = 1700000000
    expected.exited_at.nanos = 500000000
    assert delete_response(42, 137, 1700000000.5) == expected.SerializeToString()
