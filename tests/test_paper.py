"""``lpsync paper --quick`` end to end on a tiny configuration: the report's structure, a
caption per figure (what, where, when, the command line), and every figure a real PNG."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.installed import skip_unless_installed

skip_unless_installed("matplotlib", "torch", "sklearn")

PNG = b"\x89PNG\r\n\x1a\n"
TINY = [
    "--quick",
    *("--sim-nodes", "2,4", "--sizes", "4KiB,64KiB", "--models", "resnet50"),
    *("--epochs", "1", "--procs", "2", "--iters", "2", "--demo-nodes", "1", "--demo-per-node", "2"),
]


def _paper(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lpsync.cli", "paper", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("paper")
    done = _paper("--out", str(out), *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


def test_the_report_answers_every_research_question(quick) -> None:
    out, _ = quick
    text = (out / "paper.md").read_text()
    headings = re.findall(r"^## (RQ\d): ", text, re.M)
    assert headings == ["RQ1", "RQ2", "RQ3", "RQ4", "RQ5"]
    assert "## Where measurement and the paper disagree" in text
    # RQ1: LP's flatness as a number, from the simulation
    assert re.search(r"LP's flatness, 1 GiB: LP\(P=4\) / LP\(P=2\) = \d\.\d{3}", text)
    # RQ2: the ratio against the model's 2(P-1)/P, measured on the local daemon
    assert re.search(r"\| 64KiB \| broadcast \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| 1\.000 \|", text)
    # RQ3: resnet50's step, lpsync and gloo, both mixes
    for mix in ("ddp-buckets", "per-tensor"):
        assert re.search(rf"\| resnet50 \| {mix} \| \d+ \| 97\.5 MiB \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", text)
    # RQ4: the differences are printed and the result is kept (the demo's verdict)
    assert re.search(
        r"Largest parameter difference, lpsync vs one process: \S+\*\* over [\d,]+ parameters "
        r"\(gloo vs one process: \S+; lpsync vs gloo: \S+;",
        text,
    )
    assert re.search(r"The demo's verdict: (equal to rounding|rounding grown by the training)", text), text
    assert "BSP-SGD's result was not kept" not in text
    # RQ5: the tuner's picks and the gain for both of resnet50's mixes
    for mix in ("parameters", "ddp-buckets"):
        gains = r"\| [\d.]+x \| [\d.]+x \| .+ \| [\d.]+x \|"
        assert re.search(rf"\| resnet50 \| {mix} \| \d+ \| .+ {gains}", text)
    assert re.search(r"\| \*\*total\*\* \| \*\*\d+\*\* \|", text)


def test_every_figure_is_a_png_with_its_caption(quick) -> None:
    out, _ = quick
    text = (out / "paper.md").read_text()
    figures = re.findall(r"^!\[(Figure (\d)\.\d\.) [^\]]*\]\(([^)]+)\)\n\n\*\1\* (.+)$", text, re.M)
    assert {int(section) for _, section, _, _ in figures} == {1, 2, 3, 4, 5}
    assert len(figures) == len(re.findall(r"^!\[", text, re.M))  # no figure without its caption
    for _, _, path, caption in figures:
        png = out / path
        assert png.is_file(), path
        assert png.read_bytes()[: len(PNG)] == PNG, path
        assert png.stat().st_size > 10_000, path  # drawn, not an empty canvas
        assert "Where: " in caption and "When: " in caption, caption
        assert "Command: `lpsync paper " in caption and " --quick " in caption, caption
    assert sorted(p.name for p in (out / "paper").iterdir()) == sorted(Path(p).name for *_, p, _ in figures)


def test_progress_line_per_step_and_the_total(quick) -> None:
    _, done = quick
    steps = re.findall(r"^lpsync paper: \[(\d+)/(\d+)\] ", done.stderr, re.M)
    assert steps and [int(s) for s, _ in steps] == list(range(1, int(steps[0][1]) + 1))
    assert re.search(r"^lpsync paper: total \d+ s$", done.stderr, re.M)
    assert done.stdout.strip().endswith("paper.md")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "lenet"], "--models lenet"),
        (["--sim-nodes", "2"], "--sim-nodes"),
        (["--quick", "--cluster"], "not allowed with"),
    ],
)
def test_bad_arguments_are_refused_early(tmp_path: Path, args: list[str], message: str) -> None:
    done = _paper("--out", str(tmp_path), *args, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "paper.md").exists()
