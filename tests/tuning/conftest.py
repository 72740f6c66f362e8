import pytest
from tuning_fakes import FakeClock, FakeRunner


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake_runner(fake_clock: FakeClock) -> FakeRunner:
    return FakeRunner(clock=fake_clock)
