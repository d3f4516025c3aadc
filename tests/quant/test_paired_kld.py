"""The held-out windows of the paired "no worse" test (paired_kld.py) sample the whole held-out set."""

from tests.quant.paired_kld import NUM_WINDOWS, WINDOW, heldout_windows


def _text_lengths(draft_dir) -> list[int]:
    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import tokenize_stream
    from optkit.modeldir import load_tokenizer

    tokenizer = load_tokenizer(draft_dir)
    return [len(tokenize_stream(tokenizer, [text])) for text in load_text_set("heldout").texts]


def test_heldout_windows_are_disjoint_and_reach_every_long_text(draft_dir):
    """Consecutive windows from the start would sample only the first few texts (the first 48 of 64
    tokens are 4 of the 16), whose windows are alike: each text at least as long as the spacing of
    the windows holds one."""
    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import tokenize_stream
    from optkit.modeldir import load_tokenizer

    windows = heldout_windows(draft_dir)
    stream = tokenize_stream(load_tokenizer(draft_dir), load_text_set("heldout").texts).tolist()
    assert len(windows) == NUM_WINDOWS and all(len(w) == WINDOW for w in windows)
    where = {}  # each run of WINDOW tokens -> where it first starts in the held-out stream
    for i in range(len(stream) - WINDOW, -1, -1):
        where[tuple(stream[i : i + WINDOW])] = i
    starts = sorted(where[tuple(w)] for w in windows)
    assert all(b - a >= WINDOW for a, b in zip(starts, starts[1:], strict=False))  # disjoint
    spacing = len(stream) // NUM_WINDOWS

    ends, text_start = [], 0
    for length in _text_lengths(draft_dir):
        ends.append((text_start, text_start + length))
        text_start += length
    long_texts = [(a, b) for a, b in ends if b - a >= spacing + WINDOW]
    assert len(long_texts) >= 4  # the property below means something
    for a, b in long_texts:
        assert any(a <= s and s + WINDOW <= b for s in starts), f"no window inside the text at tokens {a}-{b}"
