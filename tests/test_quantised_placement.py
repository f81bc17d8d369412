"""Where quantised weights are dequantised, per platform, on the simulated devices (tests/fake_cuda.py,
tests/fake_mps.py) running the real layerwise DiT loader: GGUF blocks move as their quantised bytes and are decoded
on the device with no trip through the host (a census of the copies and of gguf's NumPy decoder); fp8 payloads, which
MPS cannot hold, are dequantised on the host and moved in the compute dtype. Every output is bitwise the resident
CPU model's (whose GGUF values are gguf's own: tests/test_gguf_dequant.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("comfy_kitchen")

import h3_core  # noqa: E402
from fake_cuda import FakeCuda  # noqa: E402
from fake_mps import FakeMps, FakeMpsError  # noqa: E402
from h3_core.checkpoints import placement  # noqa: E402
from h3_core.runtime.host_store import HostTensor  # noqa: E402
from h3_core.runtime.platform import Platform  # noqa: E402
from h3_fixtures import packed_inputs  # noqa: E402
from quant_fixtures import QCFG, bf16_state, save_comfy_quantised, save_gguf  # noqa: E402


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(QCFG, seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantised")
    state = bf16_state()
    return {"Q4_K": save_gguf(state, "Q4_K", folder / "q4k.gguf"),
            "Q8_0": save_gguf(state, "Q8_0", folder / "q8.gguf"),
            "float8_e4m3fn": save_comfy_quantised(state, "float8_e4m3fn", folder / "fp8.safetensors")[0],
            "nvfp4": save_comfy_quantised(state, "nvfp4", folder / "nvfp4.safetensors")[0]}


def on_platform(monkeypatch, platform):
    """load_dit's layerwise managers built on `platform` (a simulated device whose tensors are on the CPU)."""
    real = placement.layerwise_manager
    monkeypatch.setattr(placement, "layerwise_manager", lambda device, **kw: real(device, platform=platform, **kw))


def census(monkeypatch, fake):
    """Bytes of every host-to-device copy, and every call of gguf's NumPy decoder (a trip through the host)."""
    import gguf

    copies, numpy_decodes = [], []
    copy = fake.copy_to_device

    def counted(dst, src, non_blocking=False):
        copies.append(src.numel() * src.element_size())
        return copy(dst, src, non_blocking)

    monkeypatch.setattr(fake, "copy_to_device", counted)
    dequantize = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a, **k: numpy_decodes.append(1) or dequantize(*a, **k))
    return copies, numpy_decodes


def block_copies(model, copies: list[int], passes: int = 2) -> tuple[int, int]:
    """(bytes of one streamed block as moved, as dequantised), after checking that every pass copied every streamed
    block at that size (the copies also hold the AdaLN units and the phase weights)."""
    store, units = model.block_residency.store, model.block_residency.streamed
    sizes = {store.buffer_bytes(u) for u in units}
    assert len(sizes) == 1, sizes  # the blocks are alike
    moved = sizes.pop()
    assert copies.count(moved) >= passes * len(units), (moved, sorted(set(copies)))
    return moved, store.unit_bytes(units[0])


def run_twice(model, inputs, context):
    with torch.no_grad(), context:
        return [model(**inputs) for _ in range(2)]


@pytest.mark.parametrize("fmt", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("kind", ["cuda", "mps"])
def test_gguf_blocks_move_quantised_and_decode_on_the_device(monkeypatch, files, inputs, fmt, kind):
    with torch.no_grad():
        expected = h3_core.load_dit(files[fmt])(**inputs)
    fake = FakeCuda() if kind == "cuda" else FakeMps()
    on_platform(monkeypatch, fake.platform())
    model = h3_core.load_dit(files[fmt], residency="layerwise")
    try:
        assert model.block_residency.backend.platform.device_type == kind
        copies, numpy_decodes = census(monkeypatch, fake)
        outputs = run_twice(model, inputs, fake.watch() if kind == "cuda" else fake.active(device_only=True))
        moved, dequantised = block_copies(model, copies)
        # each block moved as its quantised payloads: Q8_0 is 8.5 bits a weight against bf16's 16 (Q4_K 4.5); the
        # biases and norms are bf16 in both
        assert moved < 0.6 * dequantised, (moved, dequantised)
        assert not numpy_decodes
    finally:
        model.block_residency.close()
        model.adaln_residency.close()
    if kind == "cuda":
        fake.assert_no_races()
    for output in outputs:
        for got, want in zip(output, expected):
            assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "nvfp4"])
def test_fp8_payloads_are_dequantised_on_the_host_for_mps(monkeypatch, files, inputs, fmt):
    with torch.no_grad():
        expected = h3_core.load_dit(files[fmt])(**inputs)
    fake = FakeMps()
    on_platform(monkeypatch, fake.platform())
    model = h3_core.load_dit(files[fmt], residency="layerwise")
    try:
        copies, _ = census(monkeypatch, fake)
        outputs = run_twice(model, inputs, fake.active(device_only=True))  # an fp8 tensor on the fake MPS raises
        moved, dequantised = block_copies(model, copies)
        assert moved >= dequantised  # moved in the compute dtype (bf16), laid out on 256-byte boundaries
    finally:
        model.block_residency.close()
        model.adaln_residency.close()
    for output in outputs:
        for got, want in zip(output, expected):
            assert torch.equal(got, want)


def test_without_host_placement_the_fake_mps_refuses_fp8(monkeypatch, files, inputs):
    """The control: recipes kept as stored (payloads moved to the device) fail on the fake MPS as on a real one."""
    monkeypatch.setattr(HostTensor, "placed_for", lambda self, platform: self)
    fake = FakeMps()
    on_platform(monkeypatch, fake.platform())
    model = h3_core.load_dit(files["float8_e4m3fn"], residency="layerwise")
    try:
        with pytest.raises(FakeMpsError, match="MPS has no torch.float8_e4m3fn"):
            run_twice(model, inputs, fake.active(device_only=True))
    finally:
        model.block_residency.close()
        model.adaln_residency.close()


def _recipe(*dtypes, host_only=False):
    def decode(*payloads):
        return torch.zeros(2, 2)

    decode.host_only = host_only
    return HostTensor(tuple(torch.zeros(2, 2, dtype=d) for d in dtypes), torch.bfloat16, (2, 2), decode=decode)


def test_placement_per_platform():
    """fp8 payloads (and NVFP4's fp8 block scales beside its uint8 codes) are decoded on the host on MPS, on the
    device on CUDA and the CPU; integer payloads (int8 layers, GGUF blocks) on every device; gguf's NumPy-only
    types on the host everywhere."""
    cases = {"fp8": _recipe(torch.float8_e4m3fn, torch.float32), "e5m2": _recipe(torch.float8_e5m2),
             "nvfp4": _recipe(torch.uint8, torch.float8_e4m3fn, torch.float32), "int8": _recipe(torch.int8,
                                                                                                torch.float32),
             "gguf": _recipe(torch.uint8), "gguf_grid": _recipe(torch.uint8, host_only=True),
             "plain": HostTensor((torch.zeros(2, 2),), torch.bfloat16, (2, 2))}
    on_host = {kind: {name for name, r in cases.items() if r.placed_for(Platform(kind)).decode_on_host}
               for kind in ("cpu", "cuda", "mps")}
    assert on_host == {"cpu": {"gguf_grid"}, "cuda": {"gguf_grid"}, "mps": {"fp8", "e5m2", "nvfp4", "gguf_grid"}}
    assert not cases["plain"].placed_for(Platform("mps")).moves_payloads
    placed = cases["fp8"].placed_for(Platform("mps"))
    assert placed.decode_on_host and not placed.moves_payloads and placed.nbytes == 8
