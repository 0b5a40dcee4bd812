"""``lpsync bench --model``: the networks' parameter tables against their published
counts, DDP's bucketing, and one real replay through a daemon beside gloo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lpsync.bench import models
from lpsync.cluster import existing
from tests.cluster.test_cluster import needs_netns, prefix

PUBLISHED = {
    "alexnet": (61_100_840, 16),
    "vgg16": (138_357_544, 32),
    "resnet50": (25_557_032, 161),
    "bert-base": (109_482_240, 199),
    "gpt2": (124_439_808, 148),
}


@pytest.mark.parametrize("model", list(models.MODELS))
def test_parameter_counts_match_the_published_models(model: str) -> None:
    total, tensors = PUBLISHED[model]
    sizes = models.sizes(model)
    assert (sum(sizes), len(sizes)) == (total, tensors)
    names = [name for name, _ in models.tensors(model)]
    assert len(set(names)) == len(names)


def test_ddp_buckets_follow_ddp_rules() -> None:
    counts = [100, 2_000_000, 300_000, 50, 7_000_000, 10]  # float32 elements
    buckets = models.ddp_buckets(counts)
    assert sum(buckets) == sum(counts)
    # reverse order; the first bucket closes at 1 MiB, the next at 25 MiB
    assert buckets == [10 + 7_000_000, 50 + 300_000 + 2_000_000 + 100]
    assert models.ddp_buckets([1] * 10, itemsize=4, bucket_bytes=8, first_bytes=4) == [1] + [2] * 4 + [1]


def test_unknown_model_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lpsync.cli", "bench", "--model", "lenet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "expected one of alexnet" in done.stderr, done.stderr


def test_replay_resnet50_beside_gloo() -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "bench",
            "--model",
            "resnet50",
            "--procs",
            "2",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--compare",
            "gloo",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["parameters"] == PUBLISHED["resnet50"][0]
    modes = {r["mode"]: r for r in report["results"]}
    assert modes["per-tensor"]["messages"] == 161 and modes["ddp-buckets"]["messages"] == 5
    for r in modes.values():
        assert r["wrong"] == {"lpsync": 0, "gloo": 0}
        assert r["lpsync_step_seconds"] > 0 and r["gloo_step_seconds"] > 0
        assert sum(r["algorithms"].values()) == r["messages"]
        assert sorted(m["bytes"] for m in r["per_message"]) == sorted(
            4 * n
            for n in (
                models.sizes("resnet50")
                if r["mode"] == "per-tensor"
                else models.ddp_buckets(models.sizes("resnet50"))
            )
        )


def test_replay_across_two_daemons() -> None:
    # resnet50 rather than alexnet: 161 messages from 256 B to 9 MiB pick five algorithms
    # across the daemons (alexnet's 16: two) in half the CPU (10 vs 20 CPU-s: 102 MB, not 244)
    pytest.importorskip("ucxx")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "bench",
            "--model",
            "resnet50",
            "--local-nodes",
            "2",
            "--procs",
            "2",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["nodes"] == 2 and report["procs"] == 2
    modes = {r["mode"]: r for r in report["results"]}
    assert modes["per-tensor"]["messages"] == 161 and modes["ddp-buckets"]["messages"] == 5
    for r in modes.values():
        assert r["wrong"] == {"lpsync": 0}
        assert sum(r["algorithms"].values()) == r["messages"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--local-nodes", "2", "--procs", "3"], "must be a multiple"),
        (["--local-nodes", "2", "--socket", "/nonexistent.sock"], "drop --socket"),
        (["--model", "gpt2", "--local-nodes", "2", "--procs", "3"], "must be a multiple"),
        (["--model", "gpt2", "--bytes", "1MiB"], "--bytes: --model replays"),
        (["--model", "gpt2", "--cluster", "--local-nodes", "2"], "pick one"),
        (["--model", "gpt2", "--cluster", "--nodes", "2"], "--cluster needs --nodes"),
    ],
)
def test_model_flags_are_checked(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lpsync.cli", "bench", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


@needs_netns
def test_replay_on_the_emulated_cluster() -> None:
    pytest.importorskip("ucxx")
    pytest.importorskip("torch")
    name = prefix("bm")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpsync.cli",
            "bench",
            "--cluster",
            "--nodes",
            "2",
            "--link",
            "1gbit",
            "--model",
            "resnet50",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--compare",
            "gloo",
            "--prefix",
            name,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    points = [json.loads(line) for line in done.stdout.splitlines()]
    assert {p["algorithm"] for p in points} == {
        "per-tensor",
        "ddp-buckets",
        "gloo per-tensor",
        "gloo ddp-buckets",
    }
    for p in points:
        assert p["wrong"] == 0 and p["nodes"] == 2, p
        assert p["bytes"] == 4 * PUBLISHED["resnet50"][0]
        # what the daemons ran, counted per message: 161 tensors, 5 buckets
        if not p["algorithm"].startswith("gloo"):
            counts = [int(part.rsplit(" x", 1)[1]) for part in p["ran"].split(", ")]
            assert sum(counts) == (161 if p["algorithm"] == "per-tensor" else 5), p
    assert not existing(name)
