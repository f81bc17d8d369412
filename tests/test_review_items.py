"""Code-review items of issue 14: `H3DiT.close()`, the MPS chunk caps, the reclaim order, options that were
silently dropped (`return_dict`, unknown device types) and errors that were swallowed (cudart statuses)."""

from __future__ import annotations

import pytest
import torch
from h3_fixtures import packed_inputs
from offload_fixtures import SMALL, random_state, same_outputs, save_native
from safetensors.torch import save_file

import h3_core
from h3_core.runtime import AllResident


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_native(random_state(SMALL, seed=11), SMALL, tmp_path_factory.mktemp("review") / "native")


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(SMALL, seed=5)


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)


# ---- H3DiT.close() -------------------------------------------------------------------------------------------------


def test_close_leaves_a_layerwise_transformer_usable_and_resident(checkpoint, inputs):
    reference = forward(h3_core.load_dit(checkpoint), inputs)
    model = h3_core.load_dit(checkpoint, residency="layerwise")
    forward(model, inputs)
    model.close()
    assert isinstance(model.block_residency, AllResident) and isinstance(model.adaln_residency, AllResident)
    assert all(p.numel() > 1 for p in model.parameters())  # no placeholder is left bound
    assert same_outputs(forward(model, inputs), reference)
    model.close()  # idempotent
    assert same_outputs(forward(model, inputs), reference)


def test_close_keeps_the_loras_of_the_streamed_weights(checkpoint, inputs, tmp_path):
    g = torch.Generator().manual_seed(3)
    inner, hidden, ffn = SMALL.inner_dim, SMALL.hidden_size, SMALL.ffn_dim
    lora = {"blocks.1.attn.qkv_proj.lora_A.weight": torch.randn(2, hidden, generator=g),
            "blocks.1.attn.qkv_proj.lora_B.weight": torch.randn(3 * inner, 2, generator=g) * 0.3,
            "blocks.2.mlp.fc1.lora_A.weight": torch.randn(2, hidden, generator=g),
            "blocks.2.mlp.fc1.lora_B.weight": torch.randn(2 * ffn, 2, generator=g) * 0.3}
    path = tmp_path / "lora.safetensors"
    save_file(lora, str(path))
    with_lora = forward(h3_core.load_dit(checkpoint, loras=[(path, 0.7)]), inputs)
    assert not torch.equal(with_lora[0], forward(h3_core.load_dit(checkpoint), inputs)[0])
    model = h3_core.load_dit(checkpoint, residency="layerwise", loras=[(path, 0.7)])
    model.close()
    assert same_outputs(forward(model, inputs), with_lora)


# ---- the MPS chunk caps bind every chunk size ------------------------------------------------------------------------

from h3_core.models.dit_config import H3DiTConfig  # noqa: E402
from h3_core.runtime import Platform  # noqa: E402
from h3_core.runtime.chunking import ChunkingPolicy, ChunkSizeClamped  # noqa: E402

H3 = H3DiTConfig()  # the released shapes
MPS = Platform("mps").chunking  # the MPS record, on any machine
GiB = 1 << 30


def mps_plan(rows, config=H3, **policy):
    return ChunkingPolicy(backend=MPS, **policy).plan(rows, config, batch=1, dtype=torch.bfloat16, device="cpu")


def score_bytes(query_rows, key_rows, config=H3):
    return config.num_attention_heads * query_rows * key_rows * 2  # MPS materialises [heads, q, k] in bf16


def test_an_explicit_chunk_size_is_clamped_to_the_mps_caps_with_a_warning():
    with pytest.warns(ChunkSizeClamped, match="chunk_size 8192 is above what mps allows for 48768 packed rows; "
                                              "using 768 rows per chunk"):
        chunks = mps_plan(48_768, chunk_size=8192)
    assert chunks.size == chunks.query_size == 768 and score_bytes(768, 48_768) <= 4 * GiB
    # Above 12,288 rows at most 2048 query rows, even where the 4 GiB buffer limit would allow more.
    narrow = H3DiTConfig(num_attention_heads=8, attention_head_dim=128, hidden_size=1024, time_embed_hidden_dim=1024)
    with pytest.warns(ChunkSizeClamped):
        assert mps_plan(12_400, narrow, chunk_size=4096).size == 2048
    # Sizes within the caps are kept as asked (no warning); the caps are MPS's, not CUDA's.
    assert mps_plan(48_768, chunk_size=512).size == 512
    cuda = ChunkingPolicy(chunk_size=8192, backend=Platform("cuda").chunking)
    assert cuda.plan(48_768, H3, batch=1, dtype=torch.bfloat16, device="cpu").size == 8192


def test_no_default_or_budget_derived_size_exceeds_the_mps_buffer_cap():
    # Two million rows: a 4 GiB score buffer holds 19 query rows, below the 64-row floor of budget-derived sizes.
    rows = 2_000_000
    for policy in ({}, {"memory_budget": 1}, {"memory_budget": 64 * GiB}):
        size = mps_plan(rows, **policy).size
        assert size is not None and score_bytes(size, rows) <= 4 * GiB, policy


def test_node_chunk_size_widgets_are_capped(tmp_path):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    pack = comfy_double.load_pack()
    for node_id in ("H3StreamLoader", "H3StreamSampler"):
        widget, = [i for i in pack[node_id].GET_SCHEMA().inputs if i.id == "chunk_size"]
        assert widget.max == 1 << 16, node_id


# ---- reclaim: synchronise before emptying the cache ------------------------------------------------------------------

import dataclasses  # noqa: E402

from h3_core.runtime import platform as platform_module  # noqa: E402


@pytest.fixture
def recorded_device_ops(monkeypatch):
    """What the CPU's and MPS's device operations are asked to do, in order (the ops classes, recording)."""
    calls = []

    def recording(base):
        class Recording(base):
            def synchronize(self):
                calls.append("synchronize")

            def empty_cache(self):
                calls.append("empty_cache")

        return Recording

    for kind in ("cpu", "mps"):
        facts = platform_module._FACTS[kind]
        monkeypatch.setitem(platform_module._FACTS, kind, dataclasses.replace(facts, ops=recording(facts.ops)))
    return calls


def test_reclaim_synchronises_before_it_empties_the_cache(recorded_device_ops):
    from h3_core.runtime.chunking import EveryNChunks
    from h3_core.runtime.offload_backends import SynchronousBackend

    Platform("mps").reclaim()
    assert recorded_device_ops == ["synchronize", "empty_cache"]
    recorded_device_ops.clear()
    hook = EveryNChunks(2, Platform("mps").reclaim_action(lambda: recorded_device_ops.append("host empty")))
    for _ in range(4):
        hook()
    assert recorded_device_ops == ["synchronize", "host empty"] * 2
    recorded_device_ops.clear()
    SynchronousBackend("mps", reclaim_every=1).reclaim()
    assert recorded_device_ops == ["synchronize", "empty_cache"]


def test_the_sampler_nodes_reclaim_hook_synchronises_first(recorded_device_ops, tmp_path, monkeypatch):
    import sys

    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    pack = comfy_double.load_pack()
    from comfy_double.executor import run_node

    runtime = sys.modules[comfy_double.PACK_MODULE + ".nodes.comfy_runtime"]
    soft_empty = runtime.soft_empty_cache
    monkeypatch.setattr(runtime, "soft_empty_cache", lambda: (recorded_device_ops.append("soft_empty_cache"),
                                                              soft_empty()))
    loader = dict(source="tiny test model (embedded)", partition="FL2VA", transformer_residency="RESIDENT",
                  text_encoder_residency="RESIDENT", video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT",
                  prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu",
                  mps_reclaim_every=1)
    handle, = run_node(pack["H3StreamLoader"], "1", **loader)
    cond, = run_node(pack["H3StreamTextEncode"], "2", h3_model=handle, prompt="a fox", width=96, height=64)
    recorded_device_ops.clear()
    run_node(pack["H3StreamSampler"], "3", h3_model=handle, h3_cond=cond, width=96, height=64, seconds=1.0, frames=5,
             steps=2, seed=7, video_shift=12.0, audio_shift=3.0, chunk_size=16)
    reclaims = recorded_device_ops[:-1]  # the last one: the node's own call after the phase
    assert len(reclaims) >= 4 and reclaims == ["synchronize", "soft_empty_cache"] * (len(reclaims) // 2)


# ---- return_dict, unknown device types ------------------------------------------------------------------------------


def test_return_dict_gives_diffusers_output_fields(tmp_path):
    from h3_fixtures import TINY, reference_model, rel_l2, save_diffusers

    reference = reference_model(TINY, seed=2)
    inputs_ = packed_inputs(TINY, seed=4)
    with torch.no_grad():
        expected = reference(**inputs_)  # diffusers' default: return_dict=True
    model = h3_core.load_dit(save_diffusers(reference, tmp_path / "transformer"))
    with torch.no_grad():
        out = model(**inputs_, return_dict=True)
        plain = model(**inputs_)
    assert type(plain) is tuple and len(plain) == 2
    assert rel_l2(out.sample, expected.sample) <= 1e-5 and rel_l2(out.audio_sample, expected.audio_sample) <= 1e-5
    assert torch.equal(out.sample, plain[0]) and torch.equal(out.audio_sample, plain[1])


@pytest.mark.parametrize("device", ["xpu", "meta", "hpu:0"])
def test_an_unsupported_device_type_is_refused_with_the_supported_ones(device, tiny):
    from h3_core.pipeline import H3Pipeline
    from h3_core.runtime.platform import PlatformError
    from h3_core.sources import resolve_model

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
    from h3_core.errors import H3Error
    from h3_core.pipeline import H3Pipeline
    from h3_core.sources import resolve_model

    sources = resolve_model(tiny)
    with pytest.raises(H3Error, match=r"^device 'cuda': (this PyTorch build has no CUDA support|PyTorch has CUDA)"):
        H3Pipeline(sources, device="cuda")
    with pytest.raises(H3Error, match=r"^device 'cuda:7': "):
        H3Pipeline(sources, device="cuda:7")
    with pytest.raises(H3Error, match=r"^device 'gpu please' is not a device; use cpu, cuda, cuda:N or mps\.$"):
        H3Pipeline(sources, device="gpu please")


# ---- cudart statuses are reported, never swallowed ---------------------------------------------------------------

import gc  # noqa: E402

from h3_core.runtime import host_store  # noqa: E402
from h3_core.runtime.host_store import CudaHostPinner, HostTensor, PinBudget, PinnedSlab, PinWarning  # noqa: E402

CUDA_ERRORS = {1: "invalid argument", 2: "out of memory"}


class FakeCudart:
    """The two calls of `torch.cuda.cudart()` the pinner makes, answering with fixed statuses (0 = success)."""

    def __init__(self, register_status=0, unregister_status=0):
        self.register_status, self.unregister_status = register_status, unregister_status
        self.registered = []

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.registered.append(nbytes)
        return self.register_status

    def cudaHostUnregister(self, pointer):
        return self.unregister_status

    def cudaGetErrorString(self, status):
        return CUDA_ERRORS[status]


def slab_recipes(units=3):
    return [{"w": HostTensor.held(torch.full((1024,), float(i)))} for i in range(units)]


@pytest.fixture
def fake_cudart(monkeypatch):
    def install(**statuses):
        fake = FakeCudart(**statuses)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        return fake

    return install


def test_a_refused_page_lock_whose_error_cannot_be_reset_warns_once_and_stops_pinning(fake_cudart, monkeypatch):
    cudart = fake_cudart(register_status=2)
    monkeypatch.setattr(host_store, "_loaded_cudart_libraries", lambda: [])  # e.g. a platform without /proc
    budget = PinBudget(1 << 30)
    with pytest.warns(PinWarning) as caught:
        store = PinnedSlab(slab_recipes(), budget=budget, pinner=CudaHostPinner())
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        "cudaHostRegister refused to page-lock a 4,096-byte host buffer (status 2: out of memory) and the CUDA "
        "runtime's last error could not be reset here")
    assert len(cudart.registered) == 1 and store.pinned_bytes == 0 and budget.used_bytes == 0


def test_a_refused_page_lock_resets_the_last_error_in_the_loaded_runtime(fake_cudart, monkeypatch, recwarn):
    fake_cudart(register_status=2)
    resets = []

    class Library:
        def __init__(self, path):
            self.path = path

        def cudaGetLastError(self):
            resets.append(self.path)

    monkeypatch.setattr(host_store, "_loaded_cudart_libraries", lambda: ["/loaded/libcudart.so.12"])
    monkeypatch.setattr("ctypes.CDLL", Library)
    store = PinnedSlab(slab_recipes(), budget=PinBudget(1 << 30), pinner=CudaHostPinner())
    assert resets == ["/loaded/libcudart.so.12"] * 3 and store.pinned_bytes == 0  # each refusal reset, none pinned
    assert not [w for w in recwarn if issubclass(w.category, PinWarning)]


def test_a_failed_unpin_is_reported_and_stays_counted_as_locked(fake_cudart, monkeypatch):
    fake_cudart(unregister_status=1)
    monkeypatch.setattr(host_store, "_loaded_cudart_libraries", lambda: [])
    budget = PinBudget(1 << 30)
    store = PinnedSlab(slab_recipes(2), budget=budget, pinner=CudaHostPinner())
    assert store.pinned_bytes == budget.used_bytes == 2 * 4096
    with pytest.warns(PinWarning, match=r"cudaHostUnregister failed for a 4,096-byte host buffer \(status 1: "
                                        r"invalid argument\); its pages stay page-locked until the process exits"):
        store.close()
    assert budget.used_bytes == 2 * 4096 and store.pinned_bytes == 0


def test_a_dropped_store_whose_unpin_raises_warns_instead_of_swallowing_it():
    class BrokenPinner:
        def register(self, buffer):
            return True

        def unregister(self, buffer):
            raise RuntimeError("CUDA driver shutting down")

    store = PinnedSlab(slab_recipes(1), budget=PinBudget(1 << 30), pinner=BrokenPinner())
    with pytest.warns(PinWarning, match="could not unpin its slabs: RuntimeError\\('CUDA driver shutting down'\\)"):
        del store
        gc.collect()
