"""`optkit eval --sequential`: score the windows in a seeded random order, batch by batch, and stop
as soon as the bets of gate/sequential.py decide; then the verdict and checks they give."""

from collections.abc import Callable

import torch

from optkit.gate.decision import Decision
from optkit.gate.metrics import TokenStats, WindowStats
from optkit.gate.sequential import SequentialGate, rules_for
from optkit.gate.thresholds import Thresholds, check


def drawing_order(windows: int, seed: int) -> torch.Tensor:
    """The windows' random order: seeded, so a rerun draws (and stops on) the same windows."""
    return torch.randperm(windows, generator=torch.Generator().manual_seed(seed))


def new_gate(thresholds: Thresholds, alpha: float) -> SequentialGate:
    return SequentialGate(rules_for(thresholds), alpha)


def score_until_decided(
    order: torch.Tensor,
    score_batch: Callable[[torch.Tensor], TokenStats],
    gate: SequentialGate,
    *,
    batch_size: int = 8,
    advance: Callable[[int], None] | None = None,
) -> tuple[TokenStats, torch.Tensor]:
    """score_batch(window indices) -> their TokenStats, batch after batch of `order`, until the
    window thresholds are decided (gate.windows_decided) or the windows run out. Returns the
    TokenStats of the windows scored, in the order drawn, and their indices."""
    stats = TokenStats()
    scored = 0
    for first in range(0, len(order), batch_size):
        index = order[first : first + batch_size]
        part = score_batch(index)
        for name in ("nll_base", "nll_artifact", "kld", "top1_match", "window_tokens"):
            getattr(stats, name).extend(getattr(part, name))
        gate.add_windows(WindowStats.of(part))
        scored += len(index)
        if advance is not None:
            advance(len(index))
        if gate.windows_decided():
            break
    return stats, order[:scored]


def add_answers(gate: SequentialGate, answers: tuple[torch.Tensor, torch.Tensor], seed: int) -> None:
    """The task's (base, artifact) answers per question, in a seeded random order."""
    order = drawing_order(answers[0].numel(), seed + 1)
    gate.add_items(answers[0][order], answers[1][order])


def sequential_decision(gate: SequentialGate, metrics: dict[str, float], thresholds: Thresholds) -> Decision:
    """The bets' verdict: pass once every threshold's pass side crossed, fail once a reject side
    did, else inconclusive (the windows ran out first). A check is ok, crossed or unsure alike."""
    sides = gate.sides()
    checks = []
    for c in check(metrics, thresholds):
        side = sides[c.name]
        state = "crossed" if side["rejected_at"] else "ok" if side["passed_at"] else "unsure"
        checks.append(type(c)(c.name, c.metric, c.value, c.limit, state == "ok", state))
    verdict = gate.verdict(sides) or "inconclusive"
    windows, items = gate.count("windows"), gate.count("items")
    used = f"{windows} windows" + (f" and {items} task questions" if items else "")
    if verdict == "inconclusive":
        unsure = ", ".join(c.name for c in checks if c.state == "unsure")
        refuted = [name for name, side in sides.items() if not side["bound_held"]]
        reason = f"sequential: {used} decide neither way on {unsure}"
        if refuted:
            reason += f" (a window beyond the assumed bound of {', '.join(refuted)} ended its early stop)"
    else:
        reason = f"sequential: decided after {used}"
    return Decision(verdict, "confident", gate.alpha, checks, reason=reason)
