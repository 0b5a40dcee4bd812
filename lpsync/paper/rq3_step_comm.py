"""RQ3: how much of the communication bottleneck of BSP-SGD does lpsync remove?

One training step's gradient synchronization of five real networks (alexnet, vgg16,
resnet50, bert-base, gpt2; the shapes of lpsync.bench.models), replayed through lpsync
and through gloo (``lpsync bench --model NAME --compare gloo``): every parameter tensor
as its own allreduce, and DDP's 25 MiB buckets. On the emulated cluster with --cluster,
through a local daemon with --quick. The share of a step is measured where a real step
runs: the digits training of RQ4 (collectives in flight against the step time).
"""

from __future__ import annotations

from dataclasses import dataclass

from lpsync.cluster import parse_rate
from lpsync.errors import LpsyncError
from lpsync.paper import figures, measure
from lpsync.paper.context import Figure, Run, Section, progress

MIXES = ("ddp-buckets", "per-tensor")
LOCAL_PROCS = 2  # the local replay: two ranks, as `lpsync bench --model` defaults to


@dataclass(frozen=True)
class StepComm:
    model: str
    mix: str
    messages: int
    nbytes: int
    lpsync: float  # seconds per step, median of the slowest rank
    gloo: float
    ran: str  # the algorithms lpsync's daemons ran, counted per message


def run(ctx: Run) -> Section:
    o = ctx.options
    section = Section(
        "RQ3",
        "Communication time per training step",
        "How much of BSP-SGD's communication bottleneck does LP remove?",
    )
    results: list[StepComm] = []
    failed: list[str] = []
    for model in o.models:
        try:
            if o.cluster:
                ctx.begin(
                    f"RQ3: replaying {model}'s gradient step on {o.bandwidth_nodes} emulated nodes, lpsync "
                    "and gloo"
                )
                results += _from_cluster(
                    model,
                    measure.model_cluster(model, o.bandwidth_nodes, parse_rate(o.link), o.iters, o.transport),
                )
            else:
                ctx.begin(
                    f"RQ3: replaying {model}'s gradient step through a local daemon ({LOCAL_PROCS} ranks), "
                    "lpsync and gloo"
                )
                results += _from_local(model, measure.model_local(model, LOCAL_PROCS, o.iters))
        except LpsyncError as error:  # one network's failure is reported, the others still measured
            reason = str(error).strip().splitlines()[-1]
            progress(f"RQ3: {model} failed: {reason}")
            failed.append(f"{model}: the replay failed in this run ({reason})")
    ctx.results["step_comm"] = results
    where = (
        ctx.cluster_where(str(o.bandwidth_nodes), o.link)
        if o.cluster
        else f"one lpsync daemon and {LOCAL_PROCS} rank processes on this machine; gloo over loopback TCP"
    )
    if failed:
        section.lines += ["**Not measured:** " + "; ".join(failed) + ".", ""]
    if not results:
        return section
    _table(ctx, section, results)
    _figure(ctx, section, results, where)
    _share(ctx, section)
    return section


def _from_cluster(model: str, points: list) -> list[StepComm]:
    counts = measure_messages(model)
    by = {p.algorithm: p for p in points}
    return [
        StepComm(
            model,
            mix,
            len(counts[mix]),
            by[mix].nbytes,
            by[mix].seconds,
            by[f"gloo {mix}"].seconds,
            by[mix].ran,
        )
        for mix in MIXES
    ]


def _from_local(model: str, report: dict) -> list[StepComm]:
    by = {r["mode"]: r for r in report["results"]}
    return [
        StepComm(
            model,
            mix,
            by[mix]["messages"],
            by[mix]["bytes"],
            by[mix]["lpsync_step_seconds"],
            by[mix]["gloo_step_seconds"],
            ", ".join(f"{a} x{n}" for a, n in sorted(by[mix]["algorithms"].items())),
        )
        for mix in MIXES
    ]


def measure_messages(model: str) -> dict[str, list[int]]:
    from lpsync.bench.model_step import messages

    return messages(model)


def _table(ctx: Run, section: Section, results: list[StepComm]) -> None:
    o = ctx.options
    p = o.bandwidth_nodes
    rate = parse_rate(o.link) / 8
    section.lines += [
        f"One step's gradient allreduces, all in flight at once in DDP's order; time = median of {o.iters} "
        f"steps of the slowest rank, every result checked against the expected sum. "
        + (
            f"The ring bound is 2(P-1)/P · bytes / link rate = {2 * (p - 1) / p:.2f}x the wire time on {p} "
            f"nodes."
            if o.cluster
            else "Local: shared memory for lpsync, loopback TCP for gloo."
        ),
        "",
        "| network | mix | messages | gradients | lpsync s/step | gloo s/step | gloo / lpsync |"
        + (" lpsync x wire |" if o.cluster else "")
        + " lpsync's algorithms |",
        "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if o.cluster else "") + "---|",
    ]
    for r in results:
        wire = f" {r.lpsync / (r.nbytes / rate):.2f} |" if o.cluster else ""
        section.lines.append(
            f"| {r.model} | {r.mix} | {r.messages} | {r.nbytes / 2**20:.1f} MiB | {r.lpsync:.3f} | "
            f"{r.gloo:.3f} | {r.gloo / r.lpsync:.2f} |{wire} {r.ran} |"
        )
    buckets = [r for r in results if r.mix == "ddp-buckets"]
    faster = [r for r in buckets if r.gloo > r.lpsync]
    section.lines += [
        "",
        f"With DDP's buckets lpsync's step communication is faster than gloo's for {len(faster)} of "
        f"{len(buckets)} networks"
        + (
            f" (gloo / lpsync from {min(r.gloo / r.lpsync for r in buckets):.2f} to "
            f"{max(r.gloo / r.lpsync for r in buckets):.2f})."
            if buckets
            else "."
        ),
        "",
    ]
    slower = [r for r in buckets if r.gloo < 0.95 * r.lpsync]
    if slower and o.cluster:
        section.disagreements.append(
            "RQ3: lpsync's gradient step is slower than gloo's for "
            + ", ".join(f"{r.model} ({r.lpsync / r.gloo:.2f}x)" for r in slower)
            + ". Large buckets are allreduces, which the tuner runs as ring on one NIC per node (LP's "
            "allreduce is P/(P-1) behind there, RQ2), so lpsync runs the same algorithm as gloo and its "
            "per-chunk Python steps in the daemons are what is left between them."
        )


def _figure(ctx: Run, section: Section, results: list[StepComm], where: str) -> None:
    import numpy as np

    o = ctx.options
    abs_path, rel = ctx.figure("rq3-step-comm")
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(dict.fromkeys(r.model for r in results))
    x = np.arange(len(names))
    for ax, mix in zip(axes, MIXES, strict=True):
        by = {r.model: r for r in results if r.mix == mix}
        ax.bar(x - 0.2, [by[n].lpsync for n in names], 0.4, label="lpsync", color="tab:blue")
        ax.bar(x + 0.2, [by[n].gloo for n in names], 0.4, label="gloo", color="tab:gray")
        ax.set_xticks(x, [f"{n}\n{by[n].nbytes / 2**20:.0f} MiB" for n in names], fontsize=8)
        ax.set(title=f"{mix}: one step's gradient allreduces", ylabel="communication per step (s)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    figures.save(fig, abs_path)
    section.figures.append(
        Figure(
            rel,
            ctx.caption(
                f"Communication time of one training step (all gradient allreduces in flight, DDP's order) "
                f"for five networks' gradient sizes, lpsync against gloo; median of {o.iters} steps of the "
                f"slowest rank. Left: DDP's 25 MiB buckets; right: one allreduce per parameter tensor.",
                where,
            ),
        )
    )


def _share(ctx: Run, section: Section) -> None:
    """The share of a step that communication takes, where a real step ran (RQ4's job)."""
    demo = ctx.results.get("demo")
    section.lines.append("**The share of a step.**")
    if demo is None:
        section.lines += ["(RQ4's training did not run, so no step was measured.)", ""]
        return
    rows = []
    for tag in ("lpsync", "gloo"):
        step = _median([e["step_ms"] for e in demo[tag]["epochs"]])
        comm = _median([e["comm_ms"] for e in demo[tag]["epochs"]])
        rows.append((tag, step, comm))
    single = _median([e["step_ms"] for e in demo["single"]["epochs"]])
    section.lines += [
        f"The replay above is communication alone. Where a whole step runs — RQ4's digits training, "
        f"{demo['lpsync']['world']} trainers, DDP with the collectives timed from each bucket's hand-off "
        f"to its result (they overlap backward) — the medians over epochs are:",
        "",
        "| engine | step (ms) | collectives in flight (ms) | in flight / step |",
        "|---|---:|---:|---:|",
        *[f"| {tag} | {step:.2f} | {comm:.2f} | {comm / step:.0%} |" for tag, step, comm in rows],
        f"| one process, combined batch | {single:.2f} | - | - |",
        "",
        f"lpsync's step is {rows[1][1] / rows[0][1]:.2f}x gloo's speed (gloo step / lpsync step). The five "
        f"networks' compute is not run here (no torchvision or transformers, no GPU), so their share of a "
        f"step is not measured: it is the table's time against the step's compute on the reader's hardware "
        f"(less what DDP overlaps with backward).",
        "",
    ]


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)
