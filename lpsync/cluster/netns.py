"""The ``ip`` and ``tc`` commands the emulated cluster is made of, one function each.

Every call is a subprocess with a timeout; failures raise ClusterError with the
command and its stderr, so a half-done step is never silent.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

from lpsync.errors import ClusterError

_TIMEOUT = 20.0  # seconds for one ip/tc command; they take milliseconds


def run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT, check=False)
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]!r} is not installed (iproute2 provides ip and tc)") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(argv)} did not finish in {_TIMEOUT:.0f} s") from None
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.returncode}")
    return done


def ip(*args: str, ns: str | None = None) -> None:
    run(["ip", *(("-n", ns) if ns else ()), *args])


def tc(*args: str, ns: str) -> None:
    run(["tc", "-n", ns, *args])


def require_root() -> None:
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool!r} is not installed (iproute2 provides ip and tc)")
    if os.geteuid() != 0:
        raise ClusterError("network namespaces need root (or CAP_NET_ADMIN): run as root")


def namespaces() -> list[str]:
    done = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def add_namespace(name: str) -> None:
    ip("netns", "add", name)
    ip("link", "set", "lo", "up", ns=name)


def delete_namespace(name: str) -> None:
    run(["ip", "netns", "del", name], check=False)


def namespace_pids(name: str) -> list[int]:
    done = run(["ip", "netns", "pids", name], check=False)
    return [int(pid) for pid in done.stdout.split() if pid.isdigit()]


def netem_missing_reason() -> str | None:
    """None when this kernel has netem, else why not; decided without creating anything
    where the kernel's config is readable, else by a probe in a throwaway namespace."""
    config = Path("/proc/config.gz")
    if config.exists():
        try:
            text = gzip.decompress(config.read_bytes()).decode(errors="replace")
        except OSError:
            text = ""
        if "CONFIG_NET_SCH_NETEM=y" in text:
            return None
        if "CONFIG_NET_SCH_NETEM=m" in text:
            release = os.uname().release
            if list(Path("/lib/modules", release).rglob("sch_netem.ko*")):
                return None
            return f"netem is a module this system does not ship (no sch_netem in /lib/modules/{release})"
        if text:
            return "this kernel is built without netem (CONFIG_NET_SCH_NETEM is not set)"
    probe = f"lpsync-netem-probe-{os.getpid()}"
    add_namespace(probe)
    try:
        done = run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False
        )
    finally:
        delete_namespace(probe)
    if done.returncode != 0:
        return f"tc cannot add a netem qdisc here: {done.stderr.strip()}"
    return None
