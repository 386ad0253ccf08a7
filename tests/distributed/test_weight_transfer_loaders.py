"""Weight loaders: in-place copies into an nn.Module, and the vLLM loader's dispatch."""

from __future__ import annotations

import pytest
import torch

from ludic.distributed.weight_transfer import ModuleWeightLoader, VLLMWeightLoader


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    return model


def test_module_loader_copies_in_place_converting_dtypes() -> None:
    model = small_model()
    weight = model[0].weight
    pointer = weight.data_ptr()
    new = torch.full((4, 3), 0.5, dtype=torch.bfloat16)
    ModuleWeightLoader(model).load({"0.weight": new, "1.num_batches_tracked": torch.tensor(9)})
    assert model[0].weight is weight and weight.data_ptr() == pointer
    assert torch.equal(weight, torch.full((4, 3), 0.5)) and weight.dtype == torch.float32
    assert int(model[1].num_batches_tracked) == 9


def test_module_loader_checks_every_name_and_shape_before_copying() -> None:
    model = small_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(KeyError, match="not in the module's state_dict"):
        ModuleWeightLoader(model).load({"0.weight": torch.zeros(4, 3), "2.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'0.bias' has shape \(3,\) but the module's is \(4,\)"):
        ModuleWeightLoader(model).load({"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(3)})
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


class FakeModelRunner:
    """Records calls. A stand-in for vLLM's model runner, whose real loading can only run
    inside a vLLM worker process (covered by the vLLM server tests)."""

    def __init__(self, device: str | None) -> None:
        if device is not None:
            self.device = torch.device(device)
        self.calls: list[tuple[str, object]] = []
        runner = self

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.p = torch.nn.Parameter(torch.zeros(1))

            def load_weights(self, weights):
                runner.calls.append(("load_weights", weights))

        self.model = Model()

    def reload_weights(self, *, weights_iterator, is_checkpoint_format):
        self.calls.append(("reload_weights", (list(weights_iterator), is_checkpoint_format)))


def test_vllm_loader_reloads_checkpoint_format_on_cpu() -> None:
    runner = FakeModelRunner("cpu")
    tensors = {"a": torch.ones(1), "b": torch.zeros(2)}
    VLLMWeightLoader(runner).load(tensors)
    [(method, (pairs, checkpoint_format))] = runner.calls
    assert method == "reload_weights" and checkpoint_format is True
    assert [n for n, _ in pairs] == ["a", "b"] and pairs[0][1] is tensors["a"]


def test_vllm_loader_calls_model_load_weights_on_cuda() -> None:
    runner = FakeModelRunner("cuda")
    VLLMWeightLoader(runner).load({"a": torch.ones(1)})
    [(method, weights)] = runner.calls
    assert method == "load_weights" and [n for n, _ in weights] == ["a"]


def test_vllm_loader_finds_the_device_from_the_model_or_is_told() -> None:
    assert VLLMWeightLoader(FakeModelRunner(None)).device == torch.device("cpu")
    assert VLLMWeightLoader(FakeModelRunner(None), device="cuda").device.type == "cuda"
    with pytest.raises(ValueError, match="pass device='cpu' or device='cuda'"):
        VLLMWeightLoader(object())
