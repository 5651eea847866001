import pytest
from pydantic import ValidationError

from services.common.deadlines import TransferDeadline


def test_floor_plus_bytes_at_the_slowest_rate() -> None:
    d = TransferDeadline(floor_s=5.0, min_rate_mb_s=100.0)
    assert d.for_bytes(0) == 5.0
    assert d.for_bytes(-3) == 5.0
    assert d.for_bytes(1_000_000_000) == pytest.approx(15.0)  # 1 GB at 100 MB/s


def test_a_790b_model_gets_hours_not_minutes() -> None:
    assert TransferDeadline().for_bytes(1_580_000_000_000) > 72 * 60  # bf16 790B, 20 MB/s


def test_rejects_nonpositive_settings() -> None:
    with pytest.raises(ValidationError):
        TransferDeadline(floor_s=0)
    with pytest.raises(ValidationError):
        TransferDeadline(min_rate_mb_s=0)
