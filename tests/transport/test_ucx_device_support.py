"""The peer plane's device path (lpsync/transport/ucx/device_support.py), decided from what
UCX reports with ``ucx_info -d`` faked: a CPU-only node (this machine's own output), a GPU
node with cuda_copy/cuda_ipc, a GPU node with mlx5 RDMA registering cuda memory, garbage,
and a ucx_info that is missing, hangs or fails."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from lpsync.errors import InvalidArgumentError
from lpsync.transport import backends
from lpsync.transport.ucx import device_support as ds
from lpsync.transport.ucx.device_support import DEVICE, HOST, STAGED, UcxCapabilities

CAPTURED = Path(__file__).parent / "ucx_info"
CPU_NODE = (CAPTURED / "cpu_node.txt").read_text()  # ucx_info -d of the libucx wheel here
GPU_NODE = (CAPTURED / "gpu_node.txt").read_text()  # + cuda_cpy and cuda_ipc memory domains
GPU_IB_NODE = (CAPTURED / "gpu_ib_node.txt").read_text()  # + gdr_copy, mlx5_0 with cuda memory
GARBAGE = "Segmentation fault\n\x00\x7f binary noise: : :\nTransport:\n# Device: x\n"


def reported(text: str) -> Callable[[], UcxCapabilities]:
    return lambda: ds.parse_ucx_info(text)


def never() -> UcxCapabilities:
    raise AssertionError("UCX's capabilities were asked for where they cannot change the answer")


def no_peermem() -> str:
    return ""


def peermem() -> str:
    return "nvidia_peermem"


# -- parsing ---------------------------------------------------------------------------------


def test_a_cpu_node_lists_host_transports_only() -> None:
    found = ds.parse_ucx_info(CPU_NODE)
    assert not found.error
    assert {"tcp", "self", "posix", "sysv"} <= found.names()
    assert not found.names() & {"cuda_copy", "cuda_ipc", "gdr_copy"}
    tcp = [t.device for t in found.transports if t.name == "tcp"]
    assert "lo" in tcp  # one entry per device
    assert all("cuda" not in t.memory_types for t in found.transports)


def test_a_gpu_node_lists_cuda_transports_and_their_memory_types() -> None:
    found = ds.parse_ucx_info(GPU_NODE)
    copy = next(t for t in found.transports if t.name == "cuda_copy")
    assert (copy.device, copy.memory_domain, copy.component) == ("cuda", "cuda_cpy", "cuda_cpy")
    assert copy.memory_types == ("host", "cuda", "cuda-managed")
    assert {"cuda_copy", "cuda_ipc", "tcp"} <= found.names()


def test_rdma_transports_carry_their_memory_domains_memory_types() -> None:
    found = ds.parse_ucx_info(GPU_IB_NODE)
    rc = next(t for t in found.transports if t.name == "rc_mlx5")
    assert (rc.device, rc.memory_domain, rc.component) == ("mlx5_0:1", "mlx5_0", "ib")
    assert rc.memory_types == ("host", "cuda")
    # the connection manager after it owns no transports: nothing is mis-attributed to it
    assert {t.name for t in found.transports if t.memory_domain == "mlx5_0"} == {
        "dc_mlx5",
        "rc_verbs",
        "rc_mlx5",
        "ud_verbs",
        "ud_mlx5",
    }


@pytest.mark.parametrize("text", [GARBAGE, "", "\n\n", "#\n# Memory domain: x\n#   memory types: cuda\n"])
def test_unreadable_output_reports_no_transports_and_says_so(text: str) -> None:
    found = ds.parse_ucx_info(text)
    assert found.transports == ()
    assert found.error == "ucx_info -d listed no transports"


# -- UCX_TLS ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "transport", "allowed"),
    [
        ("", "cuda_copy", True),  # unset: all
        ("all", "cuda_ipc", True),
        ("tcp", "cuda_copy", False),  # the daemon's default
        ("tcp,cuda_copy", "cuda_copy", True),
        ("tcp,cuda_copy", "cuda_ipc", False),
        ("tcp,cuda", "cuda_ipc", True),  # alias
        ("^cuda", "cuda_copy", False),
        ("^cuda_ipc", "cuda_copy", True),
        ("^tcp", "cuda_copy", True),
        ("rc,cuda_copy", "rc_mlx5", True),
        ("rc,cuda_copy", "dc_mlx5", False),
        ("rc_x", "ud_mlx5", False),  # ud_mlx5 is only auxiliary (wireup) under rc_x
        ("ib", "dc_mlx5", True),
        (" tcp , cuda_copy ", "cuda_copy", True),
    ],
)
def test_ucx_tls_as_ucx_reads_it(tls: str, transport: str, allowed: bool) -> None:
    assert ds.tls_allows(tls, transport) is allowed


def test_the_daemons_ucx_tls_wins_over_the_environments() -> None:
    assert ds.effective_tls("tcp", {"UCX_TLS": "all"}) == "tcp"
    assert ds.effective_tls("", {"UCX_TLS": "rc,cuda_copy"}) == "rc,cuda_copy"
    assert ds.effective_tls("", {}) == ""


# -- the decision ----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
@pytest.mark.parametrize("memory", ["cpu", ""])
def test_no_devices_is_the_host_path(transport: str, memory: str) -> None:
    decided = ds.decide(transport, memory, "", never, no_peermem)
    assert decided.path == HOST
    assert "no devices" in decided.reason


def test_the_tcp_backend_stages() -> None:
    decided = ds.decide("tcp", "cuda", "", never, no_peermem)
    assert (decided.path, decided.transports) == (STAGED, ())
    assert decided.reason.startswith("the tcp peer transport sends host memory only")


def test_the_default_ucx_tls_stages_and_says_it_excludes_cuda() -> None:
    decided = ds.decide("ucx", "cuda", "tcp", never, no_peermem)
    assert decided.path == STAGED
    assert decided.reason.startswith("UCX_TLS=tcp excludes UCX's cuda transports")
    assert ds.decide("ucx", "cuda", "^cuda", never, no_peermem).path == STAGED


def test_emulated_devices_stage_whatever_ucx_offers() -> None:
    for transport, tls in (("ucx", ""), ("tcp", "tcp")):
        decided = ds.decide(transport, "emulated", tls, never, peermem)
        assert decided.path == STAGED
        assert decided.reason.startswith("emulated devices are host memory UCX cannot address")


def test_a_cpu_only_ucx_stages() -> None:
    decided = ds.decide("ucx", "cuda", "", reported(CPU_NODE), no_peermem)
    assert decided.path == STAGED
    assert "UCX reports no cuda_copy or cuda_ipc transport" in decided.reason


def test_cuda_copy_and_cuda_ipc_give_the_device_path() -> None:
    decided = ds.decide("ucx", "cuda", "", reported(GPU_NODE), peermem)
    assert decided.path == DEVICE
    assert decided.transports == ("cuda_copy", "cuda_ipc")
    assert not decided.gpudirect_rdma
    assert decided.reason.startswith("UCX reports cuda_copy, cuda_ipc, allowed by UCX_TLS unset")
    assert "no GPUDirect RDMA transport" in decided.reason


def test_only_the_cuda_transports_ucx_tls_allows_count() -> None:
    decided = ds.decide("ucx", "cuda", "tcp,cuda_copy", reported(GPU_NODE), no_peermem)
    assert (decided.path, decided.transports) == (DEVICE, ("cuda_copy",))
    assert "allowed by UCX_TLS=tcp,cuda_copy" in decided.reason


def test_gpudirect_rdma_is_named_with_peermem_loaded() -> None:
    decided = ds.decide("ucx", "cuda", "", reported(GPU_IB_NODE), peermem)
    assert decided.path == DEVICE
    assert decided.gpudirect_rdma
    assert decided.transports == (
        "cuda_copy",
        "cuda_ipc",
        "dc_mlx5",
        "rc_mlx5",
        "rc_verbs",
        "ud_mlx5",
        "ud_verbs",
    )
    assert "GPUDirect RDMA: dc_mlx5, rc_mlx5" in decided.reason
    assert "nvidia_peermem is loaded" in decided.reason
    # UCX_TLS narrows the RDMA transports as it does the cuda ones
    narrowed = ds.decide("ucx", "cuda", "rc_x,cuda_copy", reported(GPU_IB_NODE), peermem)
    assert narrowed.transports == ("cuda_copy", "rc_mlx5")
    assert narrowed.gpudirect_rdma


def test_without_peermem_the_rdma_transports_are_named_but_not_counted() -> None:
    decided = ds.decide("ucx", "cuda", "", reported(GPU_IB_NODE), no_peermem)
    assert decided.path == DEVICE  # GPUDirect RDMA is informational: cuda_copy decides
    assert not decided.gpudirect_rdma
    assert decided.transports == ("cuda_copy", "cuda_ipc")
    assert "no GPUDirect RDMA" in decided.reason
    assert "neither nvidia_peermem nor nv_peer_mem is loaded" in decided.reason


def test_garbage_from_ucx_info_stages() -> None:
    decided = ds.decide("ucx", "cuda", "", reported(GARBAGE), peermem)
    assert decided.path == STAGED
    assert "UCX's capabilities could not be read (ucx_info -d listed no transports)" in decided.reason


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="auto"):
        ds.decide("auto", "cuda", "", never, no_peermem)


def test_the_backends_entry_point_resolves_the_daemons_ucx_tls() -> None:
    decided = backends.device_path("ucx", "cuda", "tcp")
    assert decided.path == STAGED and "UCX_TLS=tcp" in decided.reason  # never runs ucx_info
    assert backends.device_path("tcp", "emulated", "").path == STAGED


# -- what the daemon asks for (--peer-device-path) -------------------------------------------


def test_staged_is_granted_even_where_ucx_could_send_device_memory() -> None:
    chosen = ds.choose("staged", "ucx", "cuda", "", reported(GPU_NODE), peermem)
    assert chosen.path == STAGED and "asked for (--peer-device-path staged)" in chosen.reason
    # Without devices there is nothing to stage: still the host path.
    assert ds.choose("staged", "tcp", "cpu", "tcp", never, no_peermem).path == HOST


def test_device_is_granted_where_auto_would_choose_it() -> None:
    chosen = ds.choose("device", "ucx", "cuda", "", reported(GPU_NODE), peermem)
    assert chosen == ds.decide("ucx", "cuda", "", reported(GPU_NODE), peermem)
    assert chosen.path == DEVICE


def test_device_on_emulated_devices_is_granted_on_either_transport() -> None:
    for transport in ("ucx", "tcp"):
        chosen = ds.choose("device", transport, "emulated", "tcp", never, no_peermem)
        assert chosen.path == DEVICE and "emulated device memory is host memory" in chosen.reason


@pytest.mark.parametrize(
    ("transport", "memory", "tls", "why"),
    [
        ("ucx", "cuda", "", "UCX reports no cuda_copy or cuda_ipc transport"),
        ("tcp", "cuda", "tcp", "the tcp peer transport sends host memory only"),
        ("ucx", "cuda", "tcp", "UCX_TLS=tcp excludes UCX's cuda transports"),
        ("tcp", "cpu", "tcp", "the daemon serves no devices"),
    ],
)
def test_device_is_refused_with_autos_reason_where_ucx_cannot(
    transport: str, memory: str, tls: str, why: str
) -> None:
    refused = "--peer-device-path device is not possible here"
    with pytest.raises(InvalidArgumentError, match=refused) as caught:
        ds.choose("device", transport, memory, tls, reported(CPU_NODE), no_peermem)
    assert why in str(caught.value)


def test_auto_is_the_decision_where_that_stages() -> None:
    # Where the decision is device, auto stages until validated: test_cuda_contract_ucx.
    for memory in ("cpu", "emulated"):
        chosen = ds.choose("auto", "ucx", memory, "", reported(GPU_NODE), peermem)
        assert chosen == ds.decide("ucx", memory, "", reported(GPU_NODE), peermem)
    assert ds.choose("auto", "ucx", "cuda", "tcp", never, no_peermem) == ds.decide(
        "ucx", "cuda", "tcp", never, no_peermem
    )


# -- asking UCX ------------------------------------------------------------------------------


def _fake_ucx_info(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "ucx_info"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_a_missing_binary_reads_as_no_cuda_support(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ds, "ucx_info_binary", lambda: None)
    found = ds.probe()
    assert (found.transports, found.error) == ((), "no ucx_info binary (no libucx wheel, none on PATH)")
    decided = ds.decide("ucx", "cuda", "", ds.probe, peermem)
    assert decided.path == STAGED and "no ucx_info binary" in decided.reason


def test_a_binary_that_cannot_run_reads_as_no_cuda_support(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gone = tmp_path / "not-there"
    monkeypatch.setattr(ds, "ucx_info_binary", lambda: (str(gone), dict(os.environ)))
    found = ds.probe()
    assert found.transports == () and found.error.startswith(f"cannot run {gone}")


def test_a_hanging_ucx_info_is_cut_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = _fake_ucx_info(tmp_path, "exec sleep 30")
    monkeypatch.setattr(ds, "ucx_info_binary", lambda: (str(script), dict(os.environ)))
    found = ds.probe(timeout=0.3)
    assert (found.transports, found.error) == ((), "ucx_info -d did not answer within 0.3 s")


def test_a_failing_ucx_info_reads_as_no_cuda_support(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = _fake_ucx_info(tmp_path, "echo 'libucp.so.0: cannot open shared object file' >&2; exit 127")
    monkeypatch.setattr(ds, "ucx_info_binary", lambda: (str(script), dict(os.environ)))
    found = ds.probe()
    assert found.transports == ()
    assert found.error == "ucx_info -d exited with 127: libucp.so.0: cannot open shared object file"


def test_a_faked_gpu_ucx_info_is_read_through_the_probe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "out.txt").write_text(GPU_NODE)
    script = _fake_ucx_info(tmp_path, f"cat '{tmp_path / 'out.txt'}'")
    monkeypatch.setattr(ds, "ucx_info_binary", lambda: (str(script), dict(os.environ)))
    assert ds.decide("ucx", "cuda", "", ds.probe, no_peermem).path == DEVICE


def test_peermem_is_read_from_sys_module(tmp_path: Path) -> None:
    assert ds.peermem_module(tmp_path) == ""
    (tmp_path / "nv_peer_mem").mkdir()
    assert ds.peermem_module(tmp_path) == "nv_peer_mem"
    (tmp_path / "nvidia_peermem").mkdir()
    assert ds.peermem_module(tmp_path) == "nvidia_peermem"


def test_the_wheels_ucx_info_runs_here() -> None:
    """The real probe on this machine: the libucx wheel's ucx_info (its lib/ put on
    LD_LIBRARY_PATH) lists tcp; on a node without a GPU, no cuda transport."""
    if ds.ucx_info_binary() is None:
        pytest.skip("no ucx_info: neither the libucx wheel nor one on PATH")
    found = ds.probe()
    assert not found.error, found.error
    assert "tcp" in found.names()
    if not Path("/dev/nvidiactl").exists():
        assert not found.names() & set(ds.CUDA_TRANSPORTS)
