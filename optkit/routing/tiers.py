"""Tiered routing's rules: which tier a request starts at and where its prompt escalates it. Pure."""

import re

from optkit.routing.config import TiersOptions


class TierPolicy:
    """Tiers run cheap -> big (`order`). A request starts at the tier its `model` names, or the
    default one; the rules its prompt matches escalate it (each to its `to`, or to the tier after
    the start), and it lands on the biggest of those. A tier named in the header is kept as is."""

    def __init__(self, options: TiersOptions, names: list[str]):
        self.order = list(options.order if options.order is not None else names)
        self.default = options.default or self.order[0]
        self.header = options.header
        self.rules = [(rule, re.compile(rule.regex) if rule.regex else None) for rule in options.rules]

    def escalate(self, tier: str, num_prompt_tokens: int, text: str) -> tuple[str, str | None]:
        """The tier after the rules, and the label of the rule that chose it (None: none matched)."""
        start = self.order.index(tier)
        best, label = start, None
        for rule, pattern in self.rules:
            if rule.min_prompt_tokens is not None and num_prompt_tokens < rule.min_prompt_tokens:
                continue
            if pattern is not None and pattern.search(text) is None:
                continue
            target = self.order.index(rule.to) if rule.to is not None else min(start + 1, len(self.order) - 1)
            if target > best:
                best, label = target, rule.label
        return self.order[best], label
