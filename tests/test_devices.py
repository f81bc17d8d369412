"""Devices: a device type h3_core has no rules for, and a device this machine lacks, are each one error naming the
device, raised before anything loads."""

from __future__ import annotations

import pytest
import torch

from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.runtime import Platform
from h3_core.runtime.platform import PlatformError
from h3_core.sources import resolve_model


@pytest.mark.parametrize("device", ["xpu", "meta", "hpu:0"])
def test_an_unsupported_device_type_is_refused_with_the_supported_ones(device, tiny):
    kind = device.split(":")[0]
    message = (f"device '{kind}' is not supported: h3_core runs on cpu, cuda, mps (it has no chunk limits, copy or "
               f"reclaim rules for '{kind}'). Choose one of those.")
    with pytest.raises(PlatformError) as error:
        H3Pipeline(resolve_model(tiny), device=device)
    assert str(error.value) == message
    with pytest.raises(PlatformError, match="is not supported"):
        Platform.for_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_device_the_machine_lacks_is_one_message_before_anything_loads(tiny):
    """The Python API says what the CLI and the loader node say: `cuda` on a machine without it, a GPU index that
    does not exist, a device string that is no device."""
    sources = resolve_model(tiny)
    with pytest.raises(H3Error, match=r"^device 'cuda': (this PyTorch build has no CUDA support|PyTorch has CUDA)"):
        H3Pipeline(sources, device="cuda")
    with pytest.raises(H3Error, match=r"^device 'cuda:7': "):
        H3Pipeline(sources, device="cuda:7")
    with pytest.raises(H3Error, match=r"^device 'gpu please' is not a device; use cpu, cuda, cuda:N or mps\.$"):
        H3Pipeline(sources, device="gpu please")
