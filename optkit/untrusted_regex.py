"""Regular expressions that come from a file (a checkpoint's config.json, a routing config), run
under a time budget so that a pattern built to backtrack for ever (ReDoS) cannot hang a load or a
request.

Patterns are compiled by the third-party `regex` engine, which reads the syntax of Python's `re`
(gptqmodel's and vLLM's `dynamic` overrides and compressed-tensors' `re:` targets are written for
`re`), fails fast where `re` backtracks exponentially on most such patterns, and, unlike `re`, can
stop a match part-way (`timeout=`, which counts the CPU time of the match: on a busy machine the
wall-clock time is longer). One `RegexBudget` is the time all the matches of one job may take
together: every layer of one checkpoint, or every rule on one prompt.
"""

import time

import regex

from optkit.errors import OptkitError, shown

MAX_PATTERN_CHARS = 4096
SHOWN_CHARS = 60  # of a pattern, in a message
PROBE_BUDGET_S = 0.2  # a pattern on every probe text, together
# texts that make a backtracking pattern show itself: long runs of one class of character, then a misfit
PROBES = tuple(run * 2000 + end for run in ("a", "0", " ", "a ", "a.", "\n") for end in ("", "!", "\0"))


class RegexTimeout(OptkitError):
    """A match ran past its budget: the pattern is shown, truncated."""


def compile_untrusted(pattern: object, source: str) -> regex.Pattern:
    """`pattern` compiled; OptkitError naming `source` (the file and key it came from) when it is
    not a string, is longer than MAX_PATTERN_CHARS or does not compile."""
    if not isinstance(pattern, str):
        raise OptkitError(f"{source}: a regular expression must be a string, not {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise OptkitError(
            f"{source}: the regular expression {shown(pattern, SHOWN_CHARS)} is {len(pattern)} characters long, "
            f"over {MAX_PATTERN_CHARS}: shorten it"
        )
    try:
        return regex.compile(pattern, flags=regex.VERSION0)  # VERSION0: `re`'s semantics
    except (regex.error, ValueError, OverflowError, RecursionError) as e:
        shown_pattern = shown(pattern, SHOWN_CHARS)
        raise OptkitError(f"{source}: the regular expression {shown_pattern} does not compile ({e}): fix it") from None


class RegexBudget:
    """The seconds every match of one job may take together; a match past them raises RegexTimeout
    naming the pattern and `source`."""

    def __init__(self, seconds: float, source: str):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.source = source

    def match(self, pattern: regex.Pattern, text: str) -> bool:
        return self._run(pattern.match, pattern, text)

    def search(self, pattern: regex.Pattern, text: str) -> bool:
        return self._run(pattern.search, pattern, text)

    def _run(self, method, pattern: regex.Pattern, text: str) -> bool:
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            return method(text, timeout=remaining) is not None
        except TimeoutError:
            raise RegexTimeout(
                f"{self.source}: the regular expression {shown(pattern.pattern, SHOWN_CHARS)} took over "
                f"{self.seconds:g} s to match (it backtracks without end): rewrite it without nested repetition"
            ) from None


def check_untrusted(pattern: object, source: str) -> regex.Pattern:
    """`pattern` compiled, refused (OptkitError naming `source`) when it does not compile or runs past
    PROBE_BUDGET_S on the PROBES: for a pattern that will run on texts no one has seen yet (prompts)."""
    compiled = compile_untrusted(pattern, source)
    budget = RegexBudget(PROBE_BUDGET_S, source)
    for probe in PROBES:
        budget.search(compiled, probe)
    return compiled
