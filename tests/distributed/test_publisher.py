"""Publishers: record or forward weights, refuse NaN/inf, satisfy PolicyPublisher."""

from __future__ import annotations

import pytest
import torch

from ludic.distributed import ClientPolicyPublisher, InMemoryPublisher, PolicyPublisher


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def sync_weights(self, params, *, version: int) -> str:
        self.calls.append((dict(params), version))
        return f"loaded v{version}"


def test_in_memory_publisher_records_versions_and_a_copy_of_the_weights() -> None:
    seen: list[int] = []
    publisher = InMemoryPublisher(on_publish=lambda state, version: seen.append(version))
    assert isinstance(publisher, PolicyPublisher)
    weight = torch.ones(2)
    publisher.publish({"w": weight}, version=1)
    weight.add_(1.0)  # the trainer keeps updating its tensors in place
    publisher.publish({"w": weight}, version=2)
    weight.add_(1.0)

    assert publisher.versions == [1, 2] == seen and publisher.latest_version == 2
    assert publisher.state_dict["w"].tolist() == [2.0, 2.0]


def test_client_publisher_forwards_weights_and_version_to_sync_weights() -> None:
    client = FakeClient()
    publisher = ClientPolicyPublisher(client)
    assert isinstance(publisher, PolicyPublisher)
    publisher.publish({"w": torch.zeros(1)}, version=7)
    assert [v for _, v in client.calls] == [7]
    assert publisher.last_status == "loaded v7" and publisher.last_version == 7


def test_client_publisher_rejects_a_client_without_sync_weights() -> None:
    with pytest.raises(TypeError, match="sync_weights"):
        ClientPolicyPublisher(object())


@pytest.mark.parametrize("publisher_cls", ["memory", "client"])
def test_publishers_refuse_non_finite_weights_naming_the_tensor(publisher_cls) -> None:
    client = FakeClient()
    publisher = InMemoryPublisher() if publisher_cls == "memory" else ClientPolicyPublisher(client)
    with pytest.raises(ValueError, match="'lm_head.weight' contains NaN"):
        publisher.publish({"lm_head.weight": torch.tensor([float("nan")])}, version=1)
    assert client.calls == []
    if isinstance(publisher, InMemoryPublisher):
        assert publisher.versions == []
