"""How long connect() waits for a daemon that does not answer: ``connect_timeout`` or
LPSYNC_CONNECT_TIMEOUT (default 10 s), checked before anything waits."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import lpsync_client


def test_the_environment_sets_how_long_a_missing_daemon_is_waited_for(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LPSYNC_CONNECT_TIMEOUT", "1.5")
    began = time.monotonic()
    with pytest.raises(lpsync_client.UnavailableError) as refused:
        lpsync_client.connect(str(tmp_path / "nobody.sock"), job="j", rank=0, world_size=1)
    waited = time.monotonic() - began
    assert "no lpsync daemon answers" in str(refused.value) and "nobody.sock" in str(refused.value)
    assert 1.4 <= waited < 8, waited  # not the default 10 s
    # The argument wins over the environment.
    began = time.monotonic()
    with pytest.raises(lpsync_client.UnavailableError):
        lpsync_client.connect(str(tmp_path / "x.sock"), job="j", rank=0, world_size=1, connect_timeout=0.3)
    assert time.monotonic() - began < 1.4


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "nan", "inf"])
def test_a_bad_connect_timeout_is_refused_naming_it(raw: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LPSYNC_CONNECT_TIMEOUT", raw)
    began = time.monotonic()
    with pytest.raises(lpsync_client.InvalidArgumentError, match="LPSYNC_CONNECT_TIMEOUT"):
        lpsync_client.connect(str(tmp_path / "nobody.sock"), job="j", rank=0, world_size=1)
    assert time.monotonic() - began < 1.0  # refused before any wait
    monkeypatch.delenv("LPSYNC_CONNECT_TIMEOUT")
    with pytest.raises(lpsync_client.InvalidArgumentError, match="connect_timeout"):
        lpsync_client.connect(str(tmp_path / "x.sock"), job="j", rank=0, world_size=1, connect_timeout=0)
