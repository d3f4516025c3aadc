"""The planning math of repair (pipeline/repair.py runs the loop): which layers to raise, in what
order, how many of them, and how many fewer once a candidate passes. Pure functions of the
attribution, the manifest and the gate's measurements; nothing here reads or writes an artifact.

The per-layer estimate. Attribution (gate/attribution.py) gives, for each quantized linear l, the
estimated drop of the mean KLD on its own calibration set with l in full precision, `drop_l`, and on
each rung r of the ladder above its own (quant/ladder.py: more bits or a finer group), `drop_l(r)`.
Linears that vLLM fuses (q/k/v, gate/up: `fused_units`) share one rung (in a GGUF file, where
nothing fuses them, each linear is a unit of its own), and the drops of a unit are
taken to add up: drop_u(r) = Σ_{l ∈ u} drop_l(r). The drops of different units add up as well, so a
set of moves is predicted to leave

  KLD_gate ≈ KLD_source − rescale · Σ gain                                          (`predicted_kld`)

on the gate's set, where `rescale` maps nats on the attribution set to nats on the gate's
(`gate_rescale`: the ratio of the two KLDs measured on the same artifact; `refit_rescale`: the ratio
that explains what the gate measured after a plan's moves).

The price of a move. A unit's bytes on a rung are `layer_bytes` summed over its linears (full
precision at the base checkpoint's dtype). Its levels are the rungs ordered by bytes, each kept if
it costs more bytes than where the unit is now, its group divides the input width, the attribution
priced it, and it drops more than the level before it. Of those only the upper concave hull of
drop against extra bytes is kept: a level whose step from the one below pays no more per byte than
the step past it is skipped, so going up the hull each step pays less per byte than the one before.
A move is one step of that hull: `gain` = Δdrop, `extra_bytes` = Δbytes. A heap over the units
holds each unit's next step, keyed by gain per byte; popping one pushes that unit's next. As the
ratios fall along each hull, the moves come out in global order of gain per byte with each unit's
steps in ladder order.

The secant step. Once a prefix of `high` moves passes (KLD b) and one of `low` moves failed (KLD a),
the gate's KLD is interpolated between the two in the cumulative estimated gain C_k of the first k
moves (regula falsi, `secant_prefix`):

  KLD(k) ≈ a − (a − b) · (C_k − C_low) / (C_high − C_low)

and the shortest k strictly between `low` and `high` with KLD(k) under the aim is gated next. Both
ends are the gate's own measurements, so the estimate's overall scale cancels: only its shares of
the gain between the two prefixes matter.
"""

import heapq
from dataclasses import dataclass
from typing import NamedTuple

from optkit.errors import OptkitError
from optkit.gate.attribution import Attribution
from optkit.gate.evaluate import GateResult
from optkit.gate.options import GateOptions
from optkit.quant.formats.mixed import fused_units
from optkit.quant.ladder import Rung, layer_bytes, nominal_bits
from optkit.quant.mixed_artifact import artifact_scheme, layer_rungs

MARGIN = 0.9  # aim this far under the target: the prediction is an estimate
# with reattribute, when even every move of a plan is not predicted to reach the target (far below
# the start: small-moe from 2 bits at KLD 0.0001), aim that plan at this share of the KLD it starts
# from and attribute again there, rather than take every move (every layer in full precision)
WAYPOINT = 0.25
SHRINK_AIM = 0.97  # closer once a passing artifact brackets the answer (interpolated, not extrapolated)


@dataclass
class Move:
    unit: list[str]
    rung: Rung
    gain: float  # estimated KLD drop on the attribution set, nats
    extra_bytes: int


class Level(NamedTuple):
    """A rung of one unit's hull, counted from where the unit is now."""

    rung: Rung | None  # None: where the unit is now
    drop: float  # estimated KLD drop, nats
    extra_bytes: int


def plan_moves(
    attribution: Attribution, manifest: dict, itemsize: dict[str, int], rungs: list[Rung], *, alone: bool = False
) -> list[Move]:
    """Every move worth making, best estimated KLD drop per extra byte first (module doc).
    `itemsize`: bytes per element of each base tensor (`weight_itemsizes`), for full precision.
    `alone`: each linear is a unit of its own (a GGUF file's tensors, which nothing fuses)."""
    scheme = artifact_scheme(manifest)
    shapes = {layer["name"]: layer["shape"] for layer in manifest["layers"]}
    on = layer_rungs(manifest)

    def unit_bytes(unit: list[str], rung: Rung | None) -> int:  # None: where each layer is now
        return sum(
            layer_bytes(shapes[n], on[n] if rung is None else rung, scheme, itemsize.get(f"{n}.weight", 2))
            for n in unit
        )

    by_name = {layer.name: layer for layer in attribution.layers}
    resolved = sorted({r.resolve(scheme) for r in rungs}, key=lambda r: nominal_bits(r, scheme))
    heap, hulls = [], []
    names = [layer.name for layer in attribution.layers]
    for unit in [[name] for name in names] if alone else fused_units(names):
        now = unit_bytes(unit, None)
        levels = [Level(None, 0.0, 0)]
        for rung in sorted(resolved, key=lambda r: unit_bytes(unit, r)):
            extra = unit_bytes(unit, rung) - now
            if extra <= 0 or not rung.fits(shapes[unit[0]][1]):
                continue
            if rung.full:
                drop = sum(by_name[n].estimate for n in unit)
            elif all(rung.label in by_name[n].moves for n in unit):
                drop = sum(by_name[n].moves[rung.label] for n in unit)
            else:
                continue  # not priced (a rung the attribution was not asked about)
            if drop <= levels[-1].drop:
                continue  # more bytes for no more drop
            level = Level(rung, drop, extra)
            # upper concave hull: the last level's step pays no more per byte than the step past
            # it, so go straight past it (and check the one below again)
            while len(levels) > 1 and _drop_per_byte(levels[-2], levels[-1]) <= _drop_per_byte(levels[-1], level):
                levels.pop()
            levels.append(level)
        hulls.append((unit, levels))
        _push_step(heap, len(hulls) - 1, 1, levels)
    moves = []
    while heap:
        _, index, step = heapq.heappop(heap)
        unit, levels = hulls[index]
        below, above = levels[step - 1], levels[step]
        moves.append(Move(unit, above.rung, above.drop - below.drop, above.extra_bytes - below.extra_bytes))
        _push_step(heap, index, step + 1, levels)  # the unit's next step is eligible once this one is taken
    return moves


def _drop_per_byte(low: Level, high: Level) -> float:
    return (high.drop - low.drop) / max(high.extra_bytes - low.extra_bytes, 1)


def _push_step(heap: list, index: int, step: int, levels: list[Level]) -> None:
    """Offer unit `index`'s step from `levels[step - 1]` to `levels[step]`, if it has one that drops."""
    if step < len(levels) and levels[step].drop - levels[step - 1].drop > 0:
        # heapq pops the smallest: keyed by minus the ratio; ties go to the unit planned first
        heapq.heappush(heap, (-_drop_per_byte(levels[step - 1], levels[step]), index, step))


def target_kld(gate: GateOptions, result: GateResult) -> float:
    """The KLD to aim for: `max_kld`, or `max_ppl_increase` turned into KLD at the measured ratio."""
    targets = []
    if gate.max_kld is not None:
        targets.append(gate.max_kld)
    m = result.metrics
    if gate.max_ppl_increase is not None and m["ppl_increase_pct"] > 0:
        targets.append(m["kld_mean"] * gate.max_ppl_increase / m["ppl_increase_pct"])
    if not targets:
        raise OptkitError("repair aims at a KLD or perplexity threshold: set gate.max_kld or gate.max_ppl_increase")
    return min(targets)


def gate_rescale(gate_kld: float, attribution_kld: float) -> float:
    """Nats on the attribution set -> nats on the gate's set, from one artifact measured on both."""
    return gate_kld / max(attribution_kld, 1e-12)


def refit_rescale(rescale: float, source_kld: float, measured_kld: float, taken: list[Move]) -> float:
    """The rescaling that explains the gate's KLD after `taken` (`rescale` if they gain nothing)."""
    gained = sum(m.gain for m in taken)
    if gained > 0:
        return max((source_kld - measured_kld) / gained, 1e-3)
    return rescale


def predicted_kld(kld: float, rescale: float, moves: list[Move]) -> float:
    return kld - rescale * sum(m.gain for m in moves)


def aim_kld(target: float, kld: float, rescale: float, moves: list[Move], reattribute: bool) -> float:
    """The KLD a plan's prefix aims at: `MARGIN` under the target, or, with `reattribute`, when not
    even every move of the plan is predicted to get there, `WAYPOINT` of the KLD it starts from."""
    if reattribute and predicted_kld(kld, rescale, moves) > MARGIN * target:
        return WAYPOINT * kld  # out of this estimate's reach: go part of the way, attribute there
    return MARGIN * target


def extend_prefix(
    taken: list[Move], moves: list[Move], kld: float, rescale: float, aim: float, room: float
) -> tuple[list[Move], bool]:
    """`taken` plus the next moves in order until the predicted KLD is under `aim`, within `room`
    extra bytes; whether a move was passed over for the budget. A unit passed over takes no later
    move (its next level builds on the one passed over)."""
    chosen, passed_over = list(taken), set()
    for move in moves:
        if predicted_kld(kld, rescale, chosen) <= aim:
            break
        if move in chosen or tuple(move.unit) in passed_over:
            continue
        if sum(m.extra_bytes for m in chosen) + move.extra_bytes > room:
            passed_over.add(tuple(move.unit))
            continue
        chosen.append(move)
    return chosen, bool(passed_over)


def secant_prefix(moves: list[Move], low: int, low_kld: float, high: int, high_kld: float, aim: float) -> int:
    """The shortest prefix of `moves` strictly between `low` (failed, `low_kld`) and `high` (passed,
    `high_kld`) whose KLD, interpolated linearly in the cumulative estimated drop between the two
    measured prefixes, is under `aim` (module doc): regula falsi on the gate's own measurements,
    which brackets the answer faster than bisecting the number of moves."""
    cumulative = [0.0]  # cumulative[k]: the estimated drop of the first k moves
    for move in moves[:high]:
        cumulative.append(cumulative[-1] + move.gain)
    span = cumulative[high] - cumulative[low]
    for k in range(low + 1, high):
        if span <= 0:  # the estimate cannot tell the prefixes apart: bisect
            return (low + high) // 2
        if low_kld - (low_kld - high_kld) * (cumulative[k] - cumulative[low]) / span <= aim:
            return k
    return high - 1  # none is predicted under the aim: the longest one short of `high`


def raised_rungs(moves: list[Move]) -> dict[str, Rung]:
    """Each layer on the rung of its unit's last move (a unit's moves are taken in ladder order)."""
    return {name: move.rung for move in moves for name in move.unit}
