"""Tiered routing's rules: which tier a request starts at and where its prompt escalates it. Pure.

A rule's regex comes from a routing config, which may come from someone else, and runs on every
prompt: it is compiled by the `regex` engine and every rule's search on one prompt shares a budget
of MATCH_BUDGET_S (optkit/untrusted_regex.py). A pattern that backtracks on a probe text is
refused when the config is loaded (routing/config.py); one that still runs past the budget on a
prompt does not match it (the rules after it neither), and the server's log says so: routing
never holds a request for longer than the budget.
"""

import logging

from optkit.routing import LOGGER
from optkit.routing.config import TiersOptions
from optkit.untrusted_regex import RegexBudget, RegexTimeout, compile_untrusted

MATCH_BUDGET_S = 0.1  # every rule's search on one prompt, together

log = logging.getLogger(LOGGER)


class TierPolicy:
    """Tiers run cheap -> big (`order`). A request starts at the tier its `model` names, or the
    default one; the rules its prompt matches escalate it (each to its `to`, or to the tier after
    the start), and it lands on the biggest of those. A tier named in the header is kept as is."""

    def __init__(self, options: TiersOptions, names: list[str]):
        self.order = list(options.order if options.order is not None else names)
        self.default = options.default or self.order[0]
        self.header = options.header
        self.rules = [
            (rule, compile_untrusted(rule.regex, f"tiers rule {rule.label!r}") if rule.regex else None)
            for rule in options.rules
        ]

    def escalate(self, tier: str, num_prompt_tokens: int, text: str) -> tuple[str, str | None]:
        """The tier after the rules, and the label of the rule that chose it (None: none matched)."""
        start = self.order.index(tier)
        best, label = start, None
        budget = RegexBudget(MATCH_BUDGET_S, "tiers")
        for rule, pattern in self.rules:
            if rule.min_prompt_tokens is not None and num_prompt_tokens < rule.min_prompt_tokens:
                continue
            if pattern is not None and not self._search(budget, rule.label, pattern, text):
                continue
            target = self.order.index(rule.to) if rule.to is not None else min(start + 1, len(self.order) - 1)
            if target > best:
                best, label = target, rule.label
        return self.order[best], label

    @staticmethod
    def _search(budget: RegexBudget, label: str, pattern, text: str) -> bool:
        try:
            return budget.search(pattern, text)
        except RegexTimeout:
            log.warning(
                "tier rule %r: its regex ran past %g s on a prompt of %d characters: treated as no match",
                label, MATCH_BUDGET_S, len(text),
            )  # fmt: skip
            return False
