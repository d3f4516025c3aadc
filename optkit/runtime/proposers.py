"""The proposers of speculative decoding (runtime/speculative.py). Each takes (sequence, k) pairs
and returns, per sequence, up to k proposed tokens and their distributions q [n, V] (None: point
masses, or a greedy request), and forgets a sequence on `release` (finished or preempted). A
proposer that reads the target's features declares which in `feature_layers` (EAGLE-1: (-1,), the
LM head's input) and gets them through `observe` after every target step; () or no such attribute:
none are computed for it, at no cost.

- `NgramProposer`: prompt lookup; no model. The tokens that followed the latest earlier occurrence
  of the sequence's last n tokens, in its prompt or its output. A match of n < max_n tokens is
  weak evidence: it proposes only n tokens; a full max_n-token match proposes k. (On a CPU the
  target's cost grows with every token verified, so a long guess on thin evidence is a loss.)
- `DraftModelProposer`: a smaller model with the target's tokenizer (itself possibly quantized),
  run k times per step over its own paged KV cache.
- `EagleProposer` (runtime/eagle_proposer.py): an EAGLE head, one decoder layer over the target's
  own features, with its own paged KV cache.
"""

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from optkit.errors import OptkitError
from optkit.runtime.block_manager import BlockManager
from optkit.runtime.sampler import apply_penalties, exponential_race, is_greedy, sampling_probs
from optkit.runtime.scheduler import ScheduledSequence
from optkit.runtime.sequence import Sequence, SequenceStatus

Proposal = tuple[list[int], torch.Tensor | None]  # token ids d_1..d_n, their q [n, V] or None

NGRAM_MIN, NGRAM_MAX = 1, 4


class Proposer(Protocol):
    """What speculative decoding needs of a proposer (see the module doc)."""

    name: str
    feature_layers: tuple[int, ...]  # the target layers whose features it reads; (): none

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        """Per (sequence, k): up to k proposed token ids and their q [n, V] (None: point masses)."""

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished or preempted): free whatever the proposer holds for it."""


class FeatureProposer(Proposer, Protocol):
    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The target's features [n, H] at positions start..start+n-1 of `seq`, all verified (its
        own tokens): every step's, prefill chunks included, until `release`."""


_DRAFT_SEED_SALT = 0x5DEECE66D  # the draft's generator must not replay the target's random stream


class DraftGenerators:
    """The seeded requests' proposal generators, each seeded apart from the target's stream."""

    def __init__(self, device: torch.device | str):
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def __call__(self, seq: Sequence) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.params.seed ^ _DRAFT_SEED_SALT)
            self._generators[seq.seq_id] = generator
        return generator

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)


def sample_proposals(
    logits: torch.Tensor, contexts: list, seqs: list[Sequence], generators: DraftGenerators
) -> tuple[list[int], torch.Tensor | None]:
    """One proposal per row of logits [N, V], as the sampler would draw it: the penalties count
    `contexts` (the sequence and its proposals so far); q [N, V] is the processed distribution
    (None when every request is greedy)."""
    logits = apply_penalties(logits, contexts)
    params = [seq.params for seq in seqs]
    token_ids = logits.argmax(dim=-1)
    if all(is_greedy(p) for p in params):
        return token_ids.tolist(), None
    q = sampling_probs(logits, params)
    noise = torch.empty_like(q).exponential_()
    for row, seq in enumerate(seqs):
        if seq.params.seed is not None and not is_greedy(seq.params):
            noise[row].exponential_(generator=generators(seq))
    greedy = torch.tensor([is_greedy(p) for p in params], device=logits.device)
    return torch.where(greedy, token_ids, exponential_race(q, noise)).tolist(), q


def _match_end(data: bytes, n: int) -> int | None:
    """Where the latest earlier occurrence of the last n tokens ends (data: the ids as int32)."""
    size = len(data) // 4
    pattern = data[(size - n) * 4 :]
    end = (size - 1) * 4  # the occurrence must end before the last token, so a token follows it
    while (at := data.rfind(pattern, 0, end)) >= 0:
        if at % 4 == 0:
            return at // 4 + n
        end = at + len(pattern) - 1  # misaligned: look further left
    return None


def _continue(token_ids: list[int], first: int, k: int) -> list[int]:
    """x[L + i] = x[first + i] for i < k, where indices past L read the proposals themselves."""
    size = len(token_ids)
    proposals = token_ids[first : first + k]
    while len(proposals) < k:  # the occurrence ends less than k tokens before L
        proposals.append(proposals[first + len(proposals) - size])
    return proposals


class NgramProposer:
    name = "ngram"
    feature_layers = ()

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        return [(self.lookup(seq.token_ids, k), None) for seq, k in items]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the last n tokens, for the
        longest n in [min_n, max_n] that occurs: k of them after a match of max_n tokens, n after a
        shorter match of n (see the module doc); [] when none occurs. The search runs over the ids
        as int32 bytes (bytes.rfind is C); a hit counts only on a token boundary (4 bytes).

        The guess is that the text goes on as it did after the occurrence: x[L + i] = x[first + i]
        (L = len, first = the occurrence's end). Past L that copies the proposals themselves, so a
        loop with a period shorter than the proposals is proposed past its end."""
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            first = _match_end(data, n)
            if first is not None:
                return _continue(token_ids, first, k if n == self.max_n else min(n, k))
        return []

    def release(self, seq: Sequence) -> None:
        pass


@dataclass
class _DraftState:
    """The draft's view of one target sequence: `shadow` holds the draft's block table, the tokens
    it was fed (the real ones, then its own proposals) and how many have KV in its cache."""

    seq: Sequence
    shadow: Sequence
    num_real: int  # shadow.token_ids[:num_real] are the sequence's own tokens


class DraftModelProposer:
    """Proposes d_1..d_k by running the draft k times: first on the tokens it has not seen yet
    (the whole prompt the first time, then the tokens the last step appended), then on each of its
    own proposals. Its KV cache mirrors the target's design: a BlockManager (prefix caching
    included) and a ModelRunner of its own, a shadow Sequence per target sequence.

    Rollback: at the next step, the draft's KV is valid up to the first position where the tokens
    it was fed differ from the sequence's (its rejected proposals); num_computed_tokens drops to
    that and the blocks past it are freed, as the target's are. A sequence that finishes or is
    preempted has all its draft blocks freed (`release`); when the draft's cache is full, the
    sequence gets no proposals that step and its draft KV is freed (recomputed later)."""

    name = "draft"
    feature_layers = ()

    def __init__(self, model, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        from optkit.runtime.model_runner import ModelRunner

        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self._states: dict[int, _DraftState] = {}  # target seq_id -> state
        self._generators = DraftGenerators(self.runner.device)  # seeded requests' draft generators

    @torch.inference_mode()
    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        for state in list(self._states.values()):  # a safety net: `release` should have been called
            if state.seq.status is not SequenceStatus.RUNNING:
                self.release(state.seq)
        active: list[tuple[int, _DraftState, int]] = []  # (item index, state, k)
        for index, (seq, k) in enumerate(items):
            state = self._sync(seq)
            shadow = state.shadow
            # Slots for the unseen tokens and proposals d_1..d_{k-1} (d_k is never fed to the draft).
            if self.block_manager.allocate_slots(shadow, len(shadow) - shadow.num_computed_tokens, k - 1):
                active.append((index, state, k))
            else:
                self.release(seq)
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        for j in range(max((k for _, _, k in active), default=0)):
            batch = [(index, state) for index, state, k in active if k > j]
            shadows = [state.shadow for _, state in batch]
            scheduled = [ScheduledSequence(s, len(s) - s.num_computed_tokens) for s in shadows]
            logits, _ = self.runner.run(scheduled)  # [len(batch), V]: one row per shadow
            for shadow in shadows:
                shadow.num_computed_tokens = len(shadow)
            states = [state for _, state in batch]  # shadows include earlier proposals (penalties)
            tokens, q = sample_proposals(logits, [s.shadow for s in states], [s.seq for s in states], self._generators)
            for row, ((index, _), shadow) in enumerate(zip(batch, shadows, strict=True)):
                shadow.append_token(tokens[row])  # fed to the next pass
                drafts[index].append(tokens[row])
                if q is not None and not is_greedy(shadow.params):
                    probs[index].append(q[row])
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs, strict=True)]

    def _sync(self, seq: Sequence) -> _DraftState:
        """The sequence's draft state, rolled back to the KV the draft computed for its real tokens."""
        state = self._states.get(seq.seq_id)
        if state is None:
            shadow = Sequence(seq.token_ids, seq.params, f"draft-{seq.request_id}")
            shadow.num_prompt_tokens = seq.num_prompt_tokens
            self.block_manager.allocate_cached_prefix(shadow)
            state = self._states[seq.seq_id] = _DraftState(seq, shadow, len(seq))
            return state
        shadow = state.shadow
        valid, limit = state.num_real, min(shadow.num_computed_tokens, len(seq))
        while valid < limit and shadow.token_ids[valid] == seq.token_ids[valid]:
            valid += 1  # an accepted proposal: the draft's KV for it stands
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = min(valid, shadow.num_computed_tokens)
        state.num_real = len(seq)
        self.block_manager.free_surplus(shadow)
        self.block_manager.cache_full_blocks(shadow)
        return state

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(seq.seq_id, None)
        if state is not None:
            self.block_manager.free(state.shadow)
        if seq.is_finished:
            self._generators.forget(seq)


# --speculative KIND[:ARG] -> factory(ARG, target, tokenizer, num_blocks, block_size,
# enable_prefix_caching, dtype, device, target_dir) -> Proposer
ProposerFactory = Callable[..., Proposer]


@dataclass(frozen=True)
class ProposerKind:
    factory: ProposerFactory
    takes_arg: bool  # KIND:ARG (e.g. draft:PATH) or KIND alone
    usage: str  # how --speculative names it, for the error that lists the kinds


PROPOSERS: dict[str, ProposerKind] = {}


def register_proposer(kind: str, factory: ProposerFactory, *, takes_arg: bool = False, usage: str = "") -> None:
    if kind in PROPOSERS:
        raise ValueError(f"proposer {kind!r} is already registered")
    PROPOSERS[kind] = ProposerKind(factory, takes_arg, usage or repr(kind))


def unregister_proposer(kind: str) -> None:
    PROPOSERS.pop(kind, None)


def parse_speculative(value: str) -> tuple[str, str | None]:
    """`--speculative` -> (kind, argument): 'ngram' -> ('ngram', None), 'draft:PATH' -> ('draft', PATH)."""
    kind, _, arg = value.partition(":")
    registered = PROPOSERS.get(kind)
    if registered is not None and registered.takes_arg == bool(arg):
        return kind, arg or None
    kinds = " or ".join(k.usage for k in PROPOSERS.values())
    raise OptkitError(f"unknown --speculative {value!r}: use {kinds}")


def make_proposer(
    spec: str,
    target,
    tokenizer,
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    dtype: torch.dtype,
    device: str,
    target_dir: Path,
) -> Proposer:
    """The proposer `--speculative` names (e.g. 'ngram' or 'draft:PATH'), from `PROPOSERS`."""
    kind, arg = parse_speculative(spec)
    factory = PROPOSERS[kind].factory
    return factory(arg, target, tokenizer, num_blocks, block_size, enable_prefix_caching, dtype, device, target_dir)


def _ngram(path, target, tokenizer, num_blocks, block_size, enable_prefix_caching, dtype, device, target_dir):
    return NgramProposer()


def _draft(path, target, tokenizer, num_blocks, block_size, enable_prefix_caching, dtype, device, target_dir):
    """A draft model with the target's tokenizer; as many KV blocks as the target."""
    from optkit.modeldir import load_tokenizer
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(path, dtype=dtype, device=device)
    name = Path(str(path)).name
    if model.config.vocab_size != target.config.vocab_size:
        raise OptkitError(
            f"--speculative draft:{path}: its vocabulary has {model.config.vocab_size} tokens, the target's "
            f"{target.config.vocab_size}: use a draft model with the target's tokenizer"
        )
    if load_tokenizer(path).get_vocab() != tokenizer.get_vocab():
        raise OptkitError(f"--speculative draft:{path}: {name}'s tokenizer is not the target's: use one that is")
    return DraftModelProposer(model, num_blocks, block_size, enable_prefix_caching)


def _eagle(path, target, tokenizer, num_blocks, block_size, enable_prefix_caching, dtype, device, target_dir):
    """An EAGLE head trained for this very target (its weights' digest), on the target's features."""
    from optkit.runtime.eagle_proposer import EagleProposer

    return EagleProposer.load(Path(str(path)), target, Path(target_dir), num_blocks, block_size, enable_prefix_caching)


register_proposer("ngram", _ngram, usage="'ngram' (prompt lookup)")
register_proposer(
    "draft", _draft, takes_arg=True, usage="'draft:PATH' (a model with the target's tokenizer, e.g. draft:draft)"
)
register_proposer(
    "eagle", _eagle, takes_arg=True, usage="'eagle:DIR' (an EAGLE head trained for the target: optkit speculator train)"
)
