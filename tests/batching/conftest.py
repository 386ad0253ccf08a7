"""The ``fakes`` fixture: a fake env, protocol and credit assigner (tests/rollouts/fakes.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tests.rollouts.fakes import make_fakes


@pytest.fixture
def fakes() -> SimpleNamespace:
    return make_fakes()
