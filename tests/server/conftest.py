"""Fixtures of the HTTP tests: the reference tokenizer and a fake engine that uses it."""

import pytest

from tests.server.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def tokenizer():
    from optkit.modeldir import load_tokenizer

    return load_tokenizer("small")


@pytest.fixture
def engine(tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)
