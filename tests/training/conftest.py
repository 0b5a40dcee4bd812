"""Training through lpsync: real daemons (tests/daemon/harness.py), real trainer processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("torch")
