import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.multiprocessing.reductions import StorageWeakRef

from optkit.errors import OptkitError
from optkit.safetensors_stream import LazyTensor, lazy_tensors_in, write_safetensors


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "b.qweight": torch.randint(-(2**31), 2**31 - 1, (3, 9), generator=generator, dtype=torch.int32),
        "c.bias": torch.randn(3, generator=generator, dtype=torch.float64),
        "d.zero": torch.randint(-8, 7, (5,), generator=generator, dtype=torch.int8),
        "e.mask": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(1.5),
        "g.empty": torch.empty(0, 4),
        "h.half": torch.randn(2, 3, generator=generator).half(),
    }


def test_written_file_reads_back_exactly_with_safetensors(tmp_path):
    tensors = mixed_tensors()
    write_safetensors(tmp_path / "m.safetensors", tensors, metadata={"format": "pt"})
    loaded = load_file(tmp_path / "m.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_every_tensor_starts_at_a_multiple_of_its_element_size(tmp_path):
    write_safetensors(tmp_path / "m.safetensors", mixed_tensors())
    data = (tmp_path / "m.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = json.loads(data[8 : 8 + length])
    ends = sorted(entry["data_offsets"] for entry in header.values())
    assert ends[0][0] == 0 and ends[-1][1] == len(data) - 8 - length
    sizes = {"F64": 8, "I32": 4, "F32": 4, "BF16": 2, "F16": 2, "I8": 1, "BOOL": 1}
    for entry in header.values():
        assert entry["data_offsets"][0] % sizes[entry["dtype"]] == 0


def test_lazy_tensors_are_loaded_one_at_a_time(tmp_path):
    """Before each tensor is read, every tensor read before it has been let go."""
    save_file(mixed_tensors(), tmp_path / "source.safetensors")
    sources = lazy_tensors_in(tmp_path / "source.safetensors")
    loaded: list[StorageWeakRef] = []  # tracks the memory itself, whatever views the writer makes
    alive_at_load: list[int] = []

    def counted(spec: LazyTensor) -> LazyTensor:
        def load():
            alive_at_load.append(sum(not ref.expired() for ref in loaded))
            tensor = spec.load()
            loaded.append(StorageWeakRef(tensor.untyped_storage()))
            return tensor

        return LazyTensor(spec.dtype, spec.shape, load)

    write_safetensors(tmp_path / "copy.safetensors", {n: counted(s) for n, s in sources.items()})
    assert alive_at_load == [0] * len(sources)
    copy = load_file(tmp_path / "copy.safetensors")
    for name, tensor in load_file(tmp_path / "source.safetensors").items():
        assert torch.equal(copy[name], tensor)


def test_a_tensor_that_differs_from_its_announcement_is_refused(tmp_path):
    wrong = LazyTensor(torch.float32, (2, 2), lambda: torch.zeros(2, 3))
    with pytest.raises(ValueError, match="announced"):
        write_safetensors(tmp_path / "m.safetensors", {"w": wrong})


def test_the_same_bytes_as_safetensors_save_file(tmp_path):
    tensors = mixed_tensors()
    write_safetensors(tmp_path / "streamed.safetensors", tensors, metadata={"format": "pt"})
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_a_dtype_it_cannot_copy_is_a_clear_error(tmp_path):
    save_file({"w": torch.zeros(2, 2).to(torch.float8_e5m2)}, tmp_path / "fp8.safetensors")
    with pytest.raises(OptkitError, match="tensor w is F8_E5M2"):
        lazy_tensors_in(tmp_path / "fp8.safetensors")
