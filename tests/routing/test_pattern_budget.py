"""Tier rules' regexes come from a routing config and run on every prompt: one that backtracks for
ever is refused when the config is loaded, and one that gets past that check still cannot hold a
request past the routing budget (routing/tiers.py, optkit/untrusted_regex.py)."""

import logging
import threading
import time

import pytest

from optkit.errors import OptkitError
from optkit.routing.config import TierRule, TiersOptions, serve_options
from optkit.routing.tiers import MATCH_BUDGET_S, TierPolicy

BACKTRACKS = r"((.|..)+)+[!?]"  # exponential on any text without "!" or "?"


def tiered(*rules: dict) -> dict:
    return {
        "models": {"s": {"path": "draft"}, "l": {"path": "small"}},
        "route": "tiered",
        "tiers": {"rules": list(rules)},
    }


def escalate_within(policy: TierPolicy, text: str, seconds: float) -> tuple[tuple[str, str | None], float]:
    """policy.escalate on a daemon thread: a match that never ends fails the test instead of hanging it."""
    result = {}

    def run():
        started = time.monotonic()
        result["tier"] = policy.escalate("s", 10, text)
        result["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"routing a {len(text)}-character prompt took over {seconds} s"
    return result["tier"], result["took"]


def test_a_backtracking_rule_is_refused_when_the_config_loads():
    started = time.monotonic()
    with pytest.raises(OptkitError) as e:
        serve_options(tiered({"name": "evil", "regex": BACKTRACKS, "to": "l"}))
    assert time.monotonic() - started < 5
    message = str(e.value)
    assert "tiers.rules.0.regex" in message and "((.|..)+)+" in message and "\n" not in message


@pytest.mark.parametrize("regex, fragment", [("(", "does not compile"), ("a" * 5000, "over 4096")])
def test_a_broken_or_huge_rule_is_refused_in_one_line(regex, fragment):
    with pytest.raises(OptkitError, match=fragment) as e:
        serve_options(tiered({"regex": regex}))
    assert len(str(e.value)) < 500


def test_a_pattern_past_the_budget_on_a_prompt_does_not_match_and_is_logged(caplog):
    # as if it had passed the load-time probes: built without validation
    evil = TierRule.model_construct(name="evil", min_prompt_tokens=None, regex=BACKTRACKS, to="l")
    fine = TierRule(name="fine", regex=r"(?i)\bprove\b", to="l")
    policy = TierPolicy(
        TiersOptions.model_construct(order=None, default=None, rules=[evil, fine], header="x"), ["s", "l"]
    )
    with caplog.at_level(logging.WARNING):
        tier, took = escalate_within(policy, "please prove " + "ab" * 40, seconds=10)
    assert tier == ("s", None)  # neither matched: the evil rule spent the prompt's budget
    assert took < MATCH_BUDGET_S + 0.5
    assert any("'evil'" in r.getMessage() and "no match" in r.getMessage() for r in caplog.records)


def test_good_rules_still_route():
    options = serve_options(tiered({"name": "proof", "regex": r"(?i)\bprove\b", "to": "l"}))
    policy = TierPolicy(options.tiers, ["s", "l"])
    assert escalate_within(policy, "Prove that 2 + 2 = 4", seconds=5)[0] == ("l", "proof")
    assert escalate_within(policy, "hello " * 100_000, seconds=5)[0] == ("s", None)  # a long prompt, in budget
