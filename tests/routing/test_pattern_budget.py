"""Tier rules' regexes come from a routing config and run on every prompt: one that backtracks for
ever is refused when the config is loaded, and one that gets past that check still cannot hold a
request past the routing budget (routing/tiers.py, optkit/untrusted_regex.py)."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from optkit.errors import OptkitError
from optkit.routing.config import serve_options
from optkit.routing.tiers import TierPolicy

BACKTRACKS = r"((.|..)+)+[!?]"  # exponential on any text without "!" or "?"
MATCH_BUDGET_S = 0.1  # routing/tiers.py's: every rule on one prompt


def tiered(*rules: dict) -> dict:
    return {
        "models": {"s": {"path": "draft"}, "l": {"path": "small"}},
        "route": "tiered",
        "tiers": {"rules": list(rules)},
    }


def escalate_in_a_child(rules: list[dict], text: str, timeout_s: float = 60) -> tuple[dict, str]:
    """TierPolicy.escalate("s", ...) on `text` in a subprocess (`re` holds the GIL while it backtracks,
    so only a process can be given up on), its rules built without validation as if they had passed
    the load-time probes. Returns {"tier", "label", "took"} and the child's log."""
    code = textwrap.dedent("""
        import json, logging, sys, time
        from optkit.routing.config import TierRule, TiersOptions
        from optkit.routing.tiers import TierPolicy
        logging.basicConfig(level=logging.WARNING)
        rules, text = json.loads(sys.argv[1]), sys.argv[2]
        rules = [TierRule.model_construct(**{"name": None, "min_prompt_tokens": None, "to": None, **r}) for r in rules]
        options = TiersOptions.model_construct(order=None, default=None, rules=rules, header="x")
        policy = TierPolicy(options, ["s", "l"])
        started = time.process_time()  # the regex engine's timeout counts CPU time
        tier, label = policy.escalate("s", 10, text)
        print(json.dumps({"tier": tier, "label": label, "took": time.process_time() - started}))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(rules), text], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


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


def test_a_pattern_past_the_budget_on_a_prompt_does_not_match_and_is_logged():
    rules = [{"name": "evil", "regex": BACKTRACKS, "to": "l"}, {"name": "fine", "regex": r"(?i)\bprove\b", "to": "l"}]
    result, log = escalate_in_a_child(rules, "please prove " + "ab" * 40)
    assert (result["tier"], result["label"]) == ("s", None)  # neither matched: the evil rule spent the budget
    assert result["took"] < MATCH_BUDGET_S + 0.5
    assert "'evil'" in log and "no match" in log


def test_good_rules_still_route():
    options = serve_options(tiered({"name": "proof", "regex": r"(?i)\bprove\b", "to": "l"}))
    policy = TierPolicy(options.tiers, ["s", "l"])
    assert policy.escalate("s", 10, "Prove that 2 + 2 = 4") == ("l", "proof")
    started = time.process_time()
    assert policy.escalate("s", 10, "hello " * 100_000) == ("s", None)  # a long prompt, within the budget
    assert time.process_time() - started < 1
