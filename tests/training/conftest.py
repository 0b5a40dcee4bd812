"""Training through lpsync: real daemons (tests/daemon/harness.py), real trainer processes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
