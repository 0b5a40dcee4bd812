"""RQ5: does LP work for the message sizes real networks send?

Each network's message sizes — its parameter tensors (a hook or Horovod without fusion)
and DDP's buckets — with the algorithm the tuner (lpsync.algorithms.select) picks for
each on P nodes of the report's link, for the gradients' allreduce and the parameters'
broadcast, and the model's gain of that pick over the best baseline (the fastest of
ring, MST and BE for that message). Beside it, what the daemons actually ran in RQ3.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from lpsync.algorithms import LinkModel
from lpsync.algorithms.tuner import predictions, select
from lpsync.bench import models
from lpsync.cluster import parse_rate
from lpsync.paper import figures
from lpsync.paper.context import Figure, Run, Section
from lpsync.types import Collective

ALPHA = 5e-6
OPS = (Collective.ALLREDUCE, Collective.BROADCAST)
BASELINES = ("ring", "mst", "be")


@dataclass(frozen=True)
class Mix:
    model: str
    mix: str  # "parameters" or "ddp-buckets"
    sizes: list[int]  # bytes per message


@dataclass(frozen=True)
class Picks:
    counts: Counter[str]  # algorithm -> messages
    tuner: float  # predicted seconds, every message by the tuner's pick
    baseline: float  # every message by its fastest baseline
    fixed: dict[str, float]  # every message by one algorithm


def mixes(model: str) -> list[Mix]:
    counts = models.sizes(model)
    return [
        Mix(model, "parameters", [4 * n for n in counts]),
        Mix(model, "ddp-buckets", [4 * n for n in models.ddp_buckets(counts)]),
    ]


def picks(op: Collective, sizes: list[int], p: int, link: LinkModel) -> Picks:
    counts: Counter[str] = Counter()
    tuner = baseline = 0.0
    fixed: dict[str, float] = {}
    for n in sizes:
        chosen = select(op, n, p, link)
        counts[chosen.algorithm] += 1
        tuner += chosen.seconds
        predicted = {c.algorithm: c.seconds for c in predictions(op, n, p, link)}
        baseline += min(t for a, t in predicted.items() if a in BASELINES)
        for a, t in predicted.items():
            fixed[a] = fixed.get(a, 0.0) + t
    return Picks(counts, tuner, baseline, fixed)


def run(ctx: Run) -> Section:
    o = ctx.options
    p = o.bandwidth_nodes
    link = LinkModel.from_bandwidth(ALPHA, parse_rate(o.link) / 8)
    section = Section(
        "RQ5", "Real networks' message sizes", "Does LP work for the message sizes real networks send?"
    )
    ctx.begin(f"RQ5: the tuner's pick for every message of {', '.join(o.models)} on {p} nodes at {o.link}")
    all_mixes = [m for model in o.models for m in mixes(model)]
    section.lines += [
        f"The tuner's choice (its cost model: alpha = {ALPHA * 1e6:g} µs, {o.link} per link direction, one "
        f"NIC per node, P = {p}) for every message, and the predicted time of the whole mix by the tuner's "
        f"picks against every message by its fastest baseline (ring, MST or BE — what a library without LP "
        f"could at best do) and against ring alone (NCCL's, gloo's and Horovod's allreduce).",
        "",
        "| network | mix | messages | sizes | allreduce: tuner's picks | gain vs best baseline | gain vs "
        "ring only | broadcast: tuner's picks | gain vs best baseline |",
        "|---|---|---:|---|---|---:|---:|---|---:|",
    ]
    results: dict[tuple[str, str, Collective], Picks] = {}
    for m in all_mixes:
        for op in OPS:
            results[(m.model, m.mix, op)] = picks(op, m.sizes, p, link)
        ar, bc = results[(m.model, m.mix, OPS[0])], results[(m.model, m.mix, OPS[1])]
        section.lines.append(
            f"| {m.model} | {m.mix} | {len(m.sizes)} | {_mib(min(m.sizes))}…{_mib(max(m.sizes))} | "
            f"{_counts(ar.counts)} | {ar.baseline / ar.tuner:.2f}x | {ar.fixed['ring'] / ar.tuner:.2f}x | "
            f"{_counts(bc.counts)} | {bc.baseline / bc.tuner:.2f}x |"
        )
    measured = ctx.results.get("step_comm", [])
    if measured:
        section.lines += [
            "",
            "What the daemons ran for the same messages in RQ3 (their tuner works from the links they "
            "probed and times close candidates on a size's first calls, so it may differ from the model's "
            "pick): " + "; ".join(f"{r.model} {r.mix}: {r.ran}" for r in measured) + ".",
        ]
    o = ctx.options
    ar_gain = [results[(m.model, m.mix, OPS[0])] for m in all_mixes]
    bc_gain = [results[(m.model, m.mix, OPS[1])] for m in all_mixes]
    ar_lo, ar_hi = min(r.baseline / r.tuner for r in ar_gain), max(r.baseline / r.tuner for r in ar_gain)
    bc_lo, bc_hi = min(r.baseline / r.tuner for r in bc_gain), max(r.baseline / r.tuner for r in bc_gain)
    section.lines += [
        "",
        f"- Allreduce: the tuner's gain over the best baseline is {ar_lo:.2f}x-{ar_hi:.2f}x: with one NIC "
        "per node LP's allreduce is P/(P-1) behind ring for large messages (RQ2), so the tuner picks ring "
        "or a latency-lean algorithm, and LP adds nothing to the gradients' allreduce here.",
        f"- Broadcast (parameters): {bc_lo:.2f}x-{bc_hi:.2f}x over the best baseline: LP's nβ against BE's "
        "2(P-1)/P·nβ for every message large enough to fill the pipeline.",
        "",
    ]
    lp_allreduces = sum(r.counts["lp"] for r in ar_gain)
    if max(r.baseline / r.tuner for r in ar_gain) < 1.05:
        section.disagreements.append(
            f"RQ5: for the gradients' allreduce of {', '.join(o.models)} LP gains nothing on a cluster "
            f"with one NIC per node (the tuner picks LP for {lp_allreduces} of "
            f"{sum(len(m.sizes) for m in all_mixes)} messages; gain over the best baseline at most "
            f"{max(r.baseline / r.tuner for r in ar_gain):.2f}x): the paper's allreduce gain needs a link "
            f"per neighbour (GPU chains over NVLink/PCIe), where the model puts LP ahead again."
        )
    _figure(ctx, section, all_mixes, p, link)
    return section


def _mib(n: int) -> str:
    """A message size for people: 256B, 9.0KiB, 30.0MiB."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _counts(counts: Counter[str]) -> str:
    return ", ".join(f"{a} x{n}" for a, n in counts.most_common())


def _figure(ctx: Run, section: Section, all_mixes: list[Mix], p: int, link: LinkModel) -> None:
    o = ctx.options
    abs_path, rel = ctx.figure("rq5-message-mix")
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    labels = []
    seen: set[str] = set()
    for row, m in enumerate(all_mixes):
        labels.append(f"{m.model} {m.mix}")
        for n in sorted(set(m.sizes)):
            a = select(Collective.ALLREDUCE, n, p, link).algorithm
            many = m.sizes.count(n)
            ax.scatter(
                n,
                row,
                s=12 + 6 * many,
                color=figures.colour(a),
                marker="s" if m.mix == "ddp-buckets" else "o",
                label=None if a in seen else f"allreduce by {a.upper()}",
                alpha=0.8,
            )
            seen.add(a)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set(title=f"message sizes and the tuner's allreduce pick (P = {p})", xlabel="message size (bytes)")
    figures.size_axis(ax)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    sizes = [1 << e for e in range(12, 31)]
    for op, style in ((Collective.ALLREDUCE, "-"), (Collective.BROADCAST, "--")):
        gains = []
        for n in sizes:
            predicted = {c.algorithm: c.seconds for c in predictions(op, n, p, link)}
            gains.append(
                min(t for a, t in predicted.items() if a in BASELINES) / select(op, n, p, link).seconds
            )
        ax.plot(sizes, gains, style, marker=".", label=f"{op}")
    ax.axhline(2 * (p - 1) / p, color="gray", linestyle=":", label=f"2(P-1)/P = {2 * (p - 1) / p:.2f}")
    ax.set(
        title="tuner's pick against the best baseline (model)",
        xlabel="message size (bytes)",
        ylabel="predicted gain (x)",
    )
    figures.size_axis(ax)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    figures.save(fig, abs_path)
    section.figures.append(
        Figure(
            rel,
            ctx.caption(
                "Left: every message of each network (circles: parameter tensors; squares: DDP's buckets; "
                "size grows with repeats), coloured by the algorithm the tuner picks for its allreduce. "
                "Right: the model's gain of the tuner's pick over the fastest of ring, MST and BE, against "
                "the message size.",
                f"the tuner's cost model (alpha = {ALPHA * 1e6:g} µs, {o.link} per link direction, one NIC "
                f"per node, P = {p}); no network",
            ),
        )
    )
