"""kernels/cpu_watch.py: models/derived.py's check in C++ gives the Python loops' answers."""

import pytest
import torch
from torch import nn

from optkit.kernels import cpu_watch
from optkit.models.derived import Derived, slot, tensors_of

from .broken_build import failed_build_reason

needs_watch = pytest.mark.skipif(bool(cpu_watch.unavailable_reason()), reason=cpu_watch.unavailable_reason() or "runs")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.linear = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0))
        self.extra = None  # a submodule not made yet


def watched(block: Block, *, c_plus_plus: bool, monkeypatch) -> Derived:
    """A Derived over the block's slots, its submodules' and their tensors, checked by the C++ or by
    the Python loops."""
    if not c_plus_plus:
        monkeypatch.setattr(cpu_watch, "_module", lambda: (None, "OPTKIT_CPU_WATCH=0"))
    slots = [slot(block, name) for name in ("norm", "linear", "table", "extra")]
    slots += tensors_of(block.norm) + tensors_of(block.linear)
    derived = Derived("kept", slots)
    monkeypatch.undo()
    assert (derived._watch is not None) == c_plus_plus
    return derived


CHANGES = {
    "nothing": lambda b: None,
    "a weight in place": lambda b: b.linear.weight.add_(1),
    "a buffer in place": lambda b: b.table.add_(1),
    "a weight's .data": lambda b: setattr(b.linear.weight, "data", b.linear.weight.data.clone()),
    "a module replaced": lambda b: setattr(b, "linear", nn.Linear(8, 8)),
    "a buffer replaced": lambda b: setattr(b, "table", torch.zeros(8)),
    "a missing submodule made": lambda b: setattr(b, "extra", nn.ReLU()),
    "a parameter removed": lambda b: delattr(b.norm, "bias"),
}


@needs_watch
@pytest.mark.parametrize("change", list(CHANGES))
def test_the_c_plus_plus_check_sees_what_the_python_loops_see(change, monkeypatch):
    for c_plus_plus in (True, False):
        torch.manual_seed(0)
        block = Block()
        derived = watched(block, c_plus_plus=c_plus_plus, monkeypatch=monkeypatch)
        assert derived.stands()
        with torch.no_grad():
            CHANGES[change](block)
        assert derived.stands() == (change == "nothing"), (change, c_plus_plus)


@pytest.mark.parametrize("c_plus_plus", [True, False])
@pytest.mark.parametrize("where", ["forward hook", "forward pre-hook", "global hook", "none"])
def test_a_hook_on_a_watched_module_is_seen(c_plus_plus, where, monkeypatch):
    if c_plus_plus and cpu_watch.unavailable_reason():
        pytest.skip(cpu_watch.unavailable_reason())
    block = Block()
    derived = watched(block, c_plus_plus=c_plus_plus, monkeypatch=monkeypatch)
    assert not derived.hooked()
    handle = None
    if where == "forward hook":
        handle = block.linear.register_forward_hook(lambda *a: None)
    elif where == "forward pre-hook":
        handle = block.norm.register_forward_pre_hook(lambda *a: None)
    elif where == "global hook":
        handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert derived.hooked() == (where != "none")
    finally:
        if handle is not None:
            handle.remove()
    assert not derived.hooked()


def test_a_failed_build_says_why_and_the_python_loops_check(monkeypatch, tmp_path):
    def build() -> str:
        return cpu_watch.cpp_build.load_module(cpu_watch.SOURCE, "optkit_cpu_watch_broken")[1]

    reason = failed_build_reason(monkeypatch, tmp_path, cpu_watch, build)
    monkeypatch.setattr(cpu_watch, "_module", lambda: (None, reason))
    block = Block()
    derived = Derived("kept", [slot(block, "linear"), *tensors_of(block.linear)])
    assert derived._watch is None and derived.stands()
    with torch.no_grad():
        block.linear.weight.add_(1)
    assert not derived.stands()


def test_a_deep_copy_leaves_the_watch_behind_and_does_not_stand(monkeypatch):
    """A module's deep copy copies what it keeps: the copy's check runs in Python over the copied
    objects, whose tensors lie elsewhere, so it gathers its own weights."""
    import copy

    block = Block()
    derived = watched(block, c_plus_plus=not cpu_watch.unavailable_reason(), monkeypatch=monkeypatch)
    copied = copy.deepcopy(derived)
    assert copied._watch is None and copied.value == "kept" and not copied.stands()
    assert derived.stands()


@needs_watch
def test_a_model_whose_stack_is_watched_is_freed_when_dropped(tmp_path, small_dir):
    """The C++ watch holds references the garbage collector cannot see: none of them may close a cycle
    that keeps a dropped model (and its weights) alive."""
    import gc
    import weakref

    from optkit.models.loader import load_runtime_model
    from tests.kernels.test_cpu_decode import w4_artifact
    from tests.models.paged import chunked_then_decode, run_paged

    model = load_runtime_model(w4_artifact("llama", tmp_path, small_dir))
    run_paged(model, [list(range(3, 20))], chunked_then_decode([17], seed=1, max_chunk=6))
    kept = model.model.layers.__dict__.get("_w4a8_stack")
    assert kept is not None and kept[1]._watch is not None, "the decodes did not take the watched stack"
    dropped, layer = weakref.ref(model), weakref.ref(model.model.layers[1])
    del model, kept
    gc.collect()
    assert dropped() is None and layer() is None
