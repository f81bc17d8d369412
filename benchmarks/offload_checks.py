"""The checks of the asynchronous offload path that a GPU runs first, written once for two devices: a real CUDA device,
and the simulated one of tests/fake_cuda.py (on the CPU: deferred copies, streams and events with vector clocks, a
caching allocator, a race detector over every aten op). CI runs every check's code on the simulated device, so a GPU
run reports only what the GPU does differently. Used by `gpu_first_run.py` and tests/test_residency_cuda.py.

The model is the path `load_dit(residency="layerwise")` takes on CUDA: a synthetic DiT (`synthetic_h3`, reduced
widths, 6 blocks) read from its safetensors files by `StagedReads` into the pinned staging ring, leading blocks packed
into pinned slabs while the pin budget lasts, copied into fixed slots on a copy stream (`AsyncBackend`).

* `Device("cuda")` / `Device("fake")`: where a check runs. `slow_down(model)` puts a sleep kernel before every block on
  CUDA, so the compute stream lags far behind the host and every race window is wide open (the simulated device
  needs none: it defers copies until their stream is waited on, and reports unordered accesses as `races()`).
* Poisoning (`PoisoningBackend`): after `release(i)` the slot is overwritten with NaN bytes on the copy stream behind
  the slot's free event. With the ordering right every output stays equal to resident; the control (`BrokenBackend`,
  its free event recorded on the copy stream, so nothing waits for compute) lets the poison reach the output (CUDA)
  or is a race (simulated).
* `recovery_case`: a read error in the staging reader or an out-of-memory error raised by a copy, mid-pass; the
  next passes must equal resident.
* `steady_state_syncs`: host synchronisations in a steady-state forward and block loop (CUDA: the sync-debug mode's
  warnings; simulated: the host waiting on a stream, an event or a blocking copy from the calling thread).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import torch  # noqa: E402

import h3_core  # noqa: E402
from h3_core.models.dit_config import NUM_MODALITIES  # noqa: E402
from h3_core.runtime.host_store import PinBudget, page_aligned_bytes  # noqa: E402
from h3_core.runtime.layerwise import LayerwiseOffloadManager  # noqa: E402
from h3_core.runtime.offload_backends import AsyncBackend  # noqa: E402
from h3_core.runtime.platform import Platform, device_problem  # noqa: E402
from offload_cuda import TINY_WIDTHS, constrained_budget, streamed_dit  # noqa: E402
from real_scale import model_inputs  # noqa: E402

KINDS = ("cuda", "fake")
CHECK_BLOCKS = 6
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU clock before every block: far longer than a small block's copy
# Rows of a check's forward: 16 text, 2 latent frames of 8x8 (32 video rows after 2x2 patches), 16 audio.
CHECK_ROWS = SimpleNamespace(text_rows=16, frames=2, latent_hw=8, audio_latents=16)


class Device:
    """Where a check runs: `"cuda"`, the real device, or `"fake"`, the simulated CUDA of tests/fake_cuda.py (its
    tensors live on the CPU; the platform keeps CUDA's facts: asynchronous copies, a copy stream, pinned memory)."""

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise ValueError(f"device kind {kind!r}: one of {KINDS}")
        self.kind = kind
        self.simulated = kind == "fake"
        if self.simulated:
            tests = str(ROOT / "tests")
            if tests not in sys.path:
                sys.path.append(tests)
            from fake_cuda import FakeCuda

            self.fake = FakeCuda()
            self.platform = self.fake.platform()
        else:
            problem = device_problem("cuda")
            if problem is not None:
                raise RuntimeError(f"no CUDA device: {problem}")
            self.fake = None
            self.platform = Platform("cuda")
        self.device = self.platform.device
        # The released dtype on the GPU; float32 on the CPU (its bf16 kernels are slow and prove nothing more here).
        self.dtype = torch.float32 if self.simulated else torch.bfloat16

    @staticmethod
    def problem(kind: str) -> str | None:
        """Why `kind` cannot run here (None when it can)."""
        return None if kind == "fake" else device_problem("cuda")

    def name(self) -> str:
        return self.platform.name()

    # ---- models ---------------------------------------------------------------------------------------------

    def resident(self, folder: Path, **load_options) -> h3_core.H3DiT:
        return h3_core.load_dit(folder, device=self.device, **{"dtype": self.dtype, **load_options})

    def layerwise(self, folder: Path, *, pin_budget: PinBudget | None = None, backend_class=AsyncBackend,
                  **load_options) -> h3_core.H3DiT:
        """The layerwise model through `backend_class` with `pin_budget`. On CUDA with neither given, exactly what a
        user gets: `load_dit(residency="layerwise")` (the process's shared pin budget)."""
        load_options = {"dtype": self.dtype, **load_options}
        if not self.simulated and pin_budget is None and backend_class is AsyncBackend:
            model = h3_core.load_dit(folder, device=self.device, residency="layerwise", **load_options)
        else:
            budget = pin_budget if pin_budget is not None else PinBudget.default()
            model = streamed_dit(folder, self.device, pin_budget=budget, backend_class=backend_class,
                                 platform=self.platform if self.simulated else None, **load_options)
        if self.simulated:  # the staging reader's fills are host writes the race detector must see
            for manager in managers_of(model):
                if hasattr(manager.store, "_fill"):
                    self.fake.watch_store(manager.store)
        return model

    # ---- device behaviour -----------------------------------------------------------------------------------

    def watching(self):
        """Compute-stream accesses are recorded (simulated) while this is active."""
        return self.fake.watch() if self.simulated else contextlib.nullcontext()

    def races(self) -> list[str]:
        return list(self.fake.races) if self.simulated else []

    def sleep(self, cycles: int = SLEEP_CYCLES) -> None:
        """Delay the compute stream (CUDA); the simulated device defers copies instead."""
        if not self.simulated:
            torch.cuda._sleep(cycles)

    def slow_down(self, model) -> list:
        """A sleep kernel before every block (CUDA): hooks to remove."""
        if self.simulated:
            return []
        return [block.register_forward_pre_hook(lambda module, args: self.sleep()) for block in model.blocks]

    def page_locked(self, buffer: torch.Tensor) -> bool:
        """Whether `buffer` is page-locked now: the driver's view (CUDA), the simulated page-locker's registrations."""
        if self.simulated:
            return buffer.untyped_storage().data_ptr() in self.fake.pinner.pinned
        return buffer.is_pinned()

    def synchronize(self) -> None:
        self.platform.synchronize()

    @contextlib.contextmanager
    def count_host_syncs(self):
        """Host synchronisations made by this thread while active: `.events` (CUDA: each warning of
        `torch.cuda.set_sync_debug_mode("warn")`; simulated: the host waiting on a stream, an event, the device or a
        blocking copy)."""
        found = SimpleNamespace(events=[])
        if self.simulated:
            import fake_cuda

            thread = threading.current_thread()

            def counted(cls, name):
                original = getattr(cls, name)

                def wrapper(*args, **kwargs):
                    blocking = name != "copy_to_device" or not (args[3] if len(args) > 3 else
                                                               kwargs.get("non_blocking", False))
                    if threading.current_thread() is thread and blocking:
                        where = traceback.extract_stack(limit=4)[0]
                        found.events.append(f"{cls.__name__}.{name} from {where.filename}:{where.lineno}")
                    return original(*args, **kwargs)

                return mock.patch.object(cls, name, wrapper)

            with contextlib.ExitStack() as stack:
                for cls, name in ((fake_cuda.FakeStream, "synchronize"), (fake_cuda.FakeEvent, "synchronize"),
                                  (fake_cuda.FakeCuda, "synchronize"), (fake_cuda.FakeCuda, "copy_to_device")):
                    stack.enter_context(counted(cls, name))
                yield found
            return
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message).lower():
                found.events.append(f"{w.filename}:{w.lineno}: {w.message}")


    @contextlib.contextmanager
    def count_pinned_compute_copies(self):
        """Bytes copied non-blocking on the compute stream from page-locked host memory while active (`.bytes`):
        what a fold that copies its factors from pinned memory without a host wait moves."""
        found = SimpleNamespace(bytes=0)
        if self.simulated:
            fake = self.fake
            cls = type(fake)
            pinned = lambda src: src.untyped_storage().data_ptr() in fake.pinner.pinned  # noqa: E731
            on_compute = lambda: fake.current_stream() is fake.compute  # noqa: E731
        else:
            from h3_core.runtime import platform as platform_module

            cls = platform_module._CudaOps
            pinned = torch.Tensor.is_pinned
            on_compute = lambda: torch.cuda.current_stream() == torch.cuda.default_stream()  # noqa: E731
        original = cls.copy_to_device

        def counted(ops, dst, src, non_blocking=False):
            if non_blocking and on_compute() and pinned(src):
                found.bytes += src.numel() * src.element_size()
            return original(ops, dst, src, non_blocking)

        with mock.patch.object(cls, "copy_to_device", counted):
            yield found


def managers_of(model) -> list[LayerwiseOffloadManager]:
    return [m for m in (model.block_residency, model.adaln_residency) if isinstance(m, LayerwiseOffloadManager)]


# ---- backends that poison released slots --------------------------------------------------------------------------


class PoisoningBackend(AsyncBackend):
    """`AsyncBackend` that overwrites every released slot with NaN bytes (0xFF: NaN in float32 and bfloat16) on the
    copy stream, behind the slot's free event: a block that still read its slot after the release, or a copy into
    a slot that did not wait for the compute that read it, would see NaN."""

    poisoned = 0

    def prepare(self, store, streamed, num_slots) -> None:
        super().prepare(store, streamed, num_slots)
        self._poison = page_aligned_bytes(max(self._slot_nbytes, 1)).fill_(255)
        self._poison_pinned = self._pinner is not None and self._pinner.register(self._poison)

    def unload(self, slot: int) -> None:
        super().unload(slot)
        self._poison_slot(slot)

    def _poison_slot(self, slot: int) -> None:
        with self.platform.on_stream(self.copy_stream):
            self.copy_stream.wait_event(self.free_events[slot])
            self.platform.copy_to_device(self.buffers[slot], self._poison[: self.buffers[slot].numel()],
                                         non_blocking=True)
        self.poisoned += 1

    def close(self) -> None:
        super().close()  # both streams drained: no copy reads the poison any more
        if getattr(self, "_poison_pinned", False):
            self._pinner.unregister(self._poison)
            self._poison_pinned = False


class BrokenBackend(PoisoningBackend):
    """The control: the free event is recorded on the copy stream (the bug the events exist to prevent), so neither
    the poison nor the next copy into the slot waits for the compute that reads it."""

    def unload(self, slot: int) -> None:
        self.free_events[slot].record(self.copy_stream)
        self._free_recorded[slot] = True
        self._poison_slot(slot)


# ---- model, inputs, comparisons ------------------------------------------------------------------------------------


def write_check_model(folder: Path, blocks: int = CHECK_BLOCKS) -> Path:
    """A synthetic DiT at reduced widths (hidden 256, two 128-wide heads) in the native release layout."""
    import synthetic_h3

    folder = Path(folder)
    if not (folder / "config.json").exists():
        synthetic_h3.write_dit(folder, blocks, refiner_blocks=1, config_overrides=TINY_WIDTHS, sync=False)
    return folder


def check_inputs(model, device: Device) -> dict:
    _, inputs = model_inputs(model.config, CHECK_ROWS)
    return {k: v.to(device.device) for k, v in inputs.items()}


def precompute(model, inputs) -> dict:
    """The step-invariant work of a sampling step (`h3_core.denoise` does it once per run)."""
    with torch.no_grad():
        plan = model.adaln_plan([inputs["timestep"]])
        return dict(refined_text=model.refine_text(inputs["encoder_hidden_states"]),
                    modulation=plan.call(inputs["timestep"].cpu()))


def forward(model, inputs, precomputed=None):
    with torch.no_grad():
        return model(**inputs, **(precomputed or {}))


def reference_outputs(folder: Path, device: Device, inputs) -> tuple:
    """The resident model's outputs (its plain forward; a precomputed one gives the same bits)."""
    model = device.resident(folder)
    try:
        return tuple(t.clone() for t in forward(model, inputs))
    finally:
        del model


def difference(outputs, reference) -> dict:
    """The largest absolute difference of every output from the reference, and whether all are finite."""
    finite = all(bool(torch.isfinite(o).all()) for o in outputs)
    largest = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outputs, reference))
    return {"max_abs_difference": largest if finite else float("nan"), "finite": finite}


def staging_buffers_lent_out(store) -> int:
    """Buffers of the staging ring neither free nor being read into: held by a consumer."""
    return len(store._ring) - len(store._free) - len(store._staged)


def block_context(model, inputs, device: Device):
    """What a block call needs beside its input: `(time_act, adaln_index, rope)` and this call's AdaLN tables
    (`AdaLNCall.table(i, device)`: a layerwise model's blocks hold no AdaLN projection, it is streamed apart)."""
    with torch.no_grad():
        time_act = model.embed_time(inputs["timestep"])
        adaln_index = inputs["timestep_indices"] * NUM_MODALITIES + inputs["token_tags"].clamp(min=0)
        rope = model.rope(inputs["position_ids"])
        tables = model.adaln_plan([inputs["timestep"]]).call(inputs["timestep"].cpu())
    rows = inputs["position_ids"].shape[0]
    x = torch.randn(1, rows, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    return x.to(device.device, model.residual_dtype), (time_act, adaln_index, rope), tables


def block_loop(model, x, context, tables):
    """One pass over the blocks as `H3DiT.forward` runs them (acquire, the block with its table, release)."""
    manager = model.block_residency
    with torch.no_grad(), manager.pass_scope():
        for i, block in enumerate(model.blocks):
            manager.acquire(i)
            try:
                x = block(x, *context, table=tables.table(i, x.device))
            finally:
                manager.release(i)
    return x


# ---- the checks ----------------------------------------------------------------------------------------------------


def ordering_case(device: Device, folder: Path, inputs, reference, *, pin_units: int, poisoned: bool,
                  prefetch: int | None = None, passes: int = 3) -> dict:
    """Layerwise outputs against resident with `pin_units` blocks packed beyond the ring (ring only, some, all):
    two sampling steps (precomputed text and AdaLN tables) and a plain forward (the AdaLN projections streamed
    alongside the blocks); `poisoned`: released slots are poisoned and the compute is slowed down (CUDA)."""
    races_before = len(device.races())
    model = None
    try:
        config = h3_core.resolve_dit_checkpoint(folder).config
        budget = constrained_budget(config, device.dtype, pin_units)
        model = device.layerwise(folder, pin_budget=budget, prefetch=prefetch,
                                 backend_class=PoisoningBackend if poisoned else AsyncBackend)
        manager = model.block_residency
        hooks = device.slow_down(model) if poisoned else []
        differences = []
        with device.watching():
            precomputed = precompute(model, inputs)
            for step in range(passes):
                outputs = forward(model, inputs, precomputed if step < passes - 1 else None)
                differences.append(difference(outputs, reference))
        for hook in hooks:
            hook.remove()
        device.synchronize()
        store = manager.store
        result = {
            "pin_units": pin_units, "poisoned": poisoned, "packed_units": sorted(store.slabs),
            "streamed_units": list(manager.streamed), "pinned_bytes": store.pinned_bytes,
            "max_abs_difference": max(d["max_abs_difference"] for d in differences),
            "finite": all(d["finite"] for d in differences), "passes": passes,
            "poisoned_slots": manager.backend.poisoned if poisoned else 0,
            "bytes_read_last_pass": manager.stats().last_pass.bytes_read}
    finally:
        if model is not None:
            model.close(restore=False)
    result["races"] = device.races()[races_before:][:5]
    result["race_count"] = len(device.races()) - races_before
    return result


def control_case(device: Device, folder: Path, inputs, reference, *, pin_units: int = 0) -> dict:
    """The broken backend (free events that wait for nothing): the poison must be seen, as wrong outputs (CUDA) or
    as races (simulated); otherwise the poisoning checks could not fail."""
    races_before = len(device.races())
    config = h3_core.resolve_dit_checkpoint(folder).config
    model = device.layerwise(folder, pin_budget=constrained_budget(config, device.dtype, pin_units),
                             backend_class=BrokenBackend)
    try:
        device.slow_down(model)
        with device.watching():
            precomputed = precompute(model, inputs)
            outputs = forward(model, inputs, precomputed)
        device.synchronize()
        found = difference(outputs, reference)
    finally:
        model.close(restore=False)
    races = len(device.races()) - races_before
    wrong = not found["finite"] or found["max_abs_difference"] != 0
    return {**found, "race_count": races, "outputs_wrong": wrong, "detected": wrong or races > 0}


@contextlib.contextmanager
def inject_failure(kind: str, model, at_call: int = 2):
    """While active, the `at_call`-th read (`"read_error"`: an I/O error in the staging reader's thread) or copy
    (`"copy_out_of_memory"`: torch's out-of-memory error raised by a host-to-device copy) fails; yields the calls."""
    calls = []
    if kind == "read_error":
        reader = model.block_residency.store._reader
        original = reader.read_into

        def failing_read(*args, **kwargs):
            calls.append(1)
            if len(calls) == at_call:
                raise OSError(5, "Input/output error (injected)")
            return original(*args, **kwargs)

        with mock.patch.object(reader, "read_into", failing_read):
            yield calls
    elif kind == "copy_out_of_memory":
        original = Platform.copy_to_device

        def failing_copy(self, dst, src, non_blocking=False):
            calls.append(1)
            if len(calls) == at_call:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.20 GiB (injected)")
            return original(self, dst, src, non_blocking)

        with mock.patch.object(Platform, "copy_to_device", failing_copy):
            yield calls
    else:
        raise ValueError(f"failure kind {kind!r}")


FAILURES = ("read_error", "copy_out_of_memory")


def recovery_case(device: Device, folder: Path, inputs, reference, *, kind: str, pin_units: int = 1) -> dict:
    """A sampling step, then one whose block load fails mid-pass (`inject_failure(kind)`), then two more: the
    failed one raises, leaves no slot loaded and no staging buffer lent, and the next ones equal resident."""
    races_before = len(device.races())
    config = h3_core.resolve_dit_checkpoint(folder).config
    model = device.layerwise(folder, pin_budget=constrained_budget(config, device.dtype, pin_units))
    manager = model.block_residency
    try:
        with device.watching():
            precomputed = precompute(model, inputs)
            first = difference(forward(model, inputs, precomputed), reference)
            error = None
            with inject_failure(kind, model) as calls:
                try:
                    forward(model, inputs, precomputed)
                except Exception as exc:  # noqa: BLE001 - the injected failure, however the forward words it
                    error = f"{type(exc).__name__}: {exc}"
            slots_left = manager.materialised_streamed()
            lent = staging_buffers_lent_out(manager.store)
            after = [difference(forward(model, inputs, precomputed), reference) for _ in range(2)]
        device.synchronize()
    finally:
        model.close(restore=False)
    return {"kind": kind, "failure_reached": bool(calls), "raised": error, "slots_loaded_after_failure": slots_left,
            "staging_buffers_lent_after_failure": lent, "first_step_difference": first["max_abs_difference"],
            "max_abs_difference_after": max(d["max_abs_difference"] for d in after),
            "finite_after": all(d["finite"] for d in after), "race_count": len(device.races()) - races_before}


def steady_state_syncs(device: Device, folder: Path, inputs, *, pin_units: int = 2) -> dict:
    """Host synchronisations of a steady-state sampling step (precomputed text and AdaLN tables) and of a block
    loop, after two warm-up passes of each, with ring and packed blocks both in use."""
    races_before = len(device.races())
    config = h3_core.resolve_dit_checkpoint(folder).config
    model = device.layerwise(folder, pin_budget=constrained_budget(config, device.dtype, pin_units))
    try:
        with device.watching():
            precomputed = precompute(model, inputs)
            x, context, tables = block_context(model, inputs, device)
            for _ in range(2):
                expected_step = forward(model, inputs, precomputed)
                expected_loop = block_loop(model, x, context, tables)
            device.synchronize()
            with device.count_host_syncs() as step_syncs:
                step = forward(model, inputs, precomputed)
            with device.count_host_syncs() as loop_syncs:
                loop = block_loop(model, x, context, tables)
            device.synchronize()
        same = (difference(step, expected_step)["max_abs_difference"] == 0
                and difference((loop,), (expected_loop,))["max_abs_difference"] == 0)
    finally:
        model.close(restore=False)
    return {"step_syncs": len(step_syncs.events), "loop_syncs": len(loop_syncs.events),
            "where": (step_syncs.events + loop_syncs.events)[:10], "same_outputs": same,
            "race_count": len(device.races()) - races_before}


# ---- a LoRA folded into streamed blocks -----------------------------------------------------------------------------


def write_check_loras(folder: Path, config, rank: int = 4) -> list[Path]:
    """Two LoRAs on every block of the check model, in the formats whose rows the loader places: DiffSynth (the
    per-head interleaved QKV: a row order; out_proj) and diffusers (q / k / v row slices, fc1's `[up; gate]` swap: a
    row order; fc2; the AdaLN projection, streamed apart; the text refiner's q, phase-scoped), scaled by a metadata
    alpha."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(5)
    inner, hidden, ffn = config.inner_dim, config.hidden_size, config.ffn_dim

    def pair(state, name, rows, cols, infix=""):
        state[f"{name}.lora_A.{infix}weight"] = torch.randn(rank, cols, generator=g) / cols ** 0.5
        state[f"{name}.lora_B.{infix}weight"] = torch.randn(rows, rank, generator=g) * 0.05

    diffsynth, diffusers = {}, {}
    for i in range(config.num_layers):
        pair(diffsynth, f"blocks.{i}.attn.qkv_proj", 3 * inner, hidden, "default.")
        pair(diffsynth, f"blocks.{i}.attn.out_proj", hidden, inner, "default.")
        block = f"transformer.transformer_blocks.{i}"
        for projection in ("to_q", "to_k", "to_v"):
            pair(diffusers, f"{block}.attn.{projection}", inner, hidden)
        pair(diffusers, f"{block}.ff.net.0.proj", 2 * ffn, hidden)
        pair(diffusers, f"{block}.ff.net.2", hidden, ffn)
        pair(diffusers, f"{block}.adaln_proj.linear", 6 * 3 * hidden, config.time_embed_dim)
    pair(diffusers, "transformer.token_refiner.refiner_blocks.0.attn.to_q", inner, hidden)
    paths = [folder / "diffsynth.safetensors", folder / "diffusers.safetensors"]
    save_file(diffsynth, str(paths[0]))
    save_file(diffusers, str(paths[1]), metadata={"alpha": str(2 * rank)})
    return paths


def lora_steady_state(device: Device, folder: Path, inputs, loras, *, pin_budget: PinBudget, **load_options) -> dict:
    """The layerwise model with `loras` ((file, strength), ...) against the resident one with them, then a
    steady-state sampling step (precomputed text and AdaLN tables, after two warm-up steps): its host
    synchronisations, its reads of the LoRA files, and the factor bytes its folds moved against those copied
    non-blocking on the compute stream from page-locked memory. Then the LoRA set removed and applied again (the
    same bits), and the pin budget after close."""
    from h3_core.runtime.file_reads import FileReader

    with torch.no_grad():
        reference = tuple(t.clone() for t in forward(device.resident(folder, loras=loras, **load_options), inputs))
    races_before, used_before = len(device.races()), pin_budget.used_bytes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = device.layerwise(folder, pin_budget=pin_budget, loras=loras, **load_options)
    extra = model.block_residency.stats().extra
    lora_files = {Path(path).resolve() for path, _ in loras}
    lora_reads, real_read = [], FileReader.read_into

    def census(reader, segment, target, start=0):
        if Path(segment.path).resolve() in lora_files:
            lora_reads.append(segment.path)
        return real_read(reader, segment, target, start)

    try:
        with device.watching():
            precomputed = precompute(model, inputs)
            first = forward(model, inputs, precomputed)
            forward(model, inputs, precomputed)
            device.synchronize()
            moved = model.lora_fold.factor_bytes_moved
            with mock.patch.object(FileReader, "read_into", census), device.count_pinned_compute_copies() as copies, \
                    device.count_host_syncs() as syncs:
                step = forward(model, inputs, precomputed)
            moved = model.lora_fold.factor_bytes_moved - moved
            pins_with = pin_budget.used_bytes - used_before
            h3_core.set_loras(model, [])  # right behind queued folds: unpinned only once they ran
            pins_without = pin_budget.used_bytes - used_before
            h3_core.set_loras(model, loras)
            pins_again = pin_budget.used_bytes - used_before
            again = forward(model, inputs, precomputed)
            device.synchronize()
    finally:
        model.close(restore=False)
    return {"same_as_resident": difference(first, reference)["max_abs_difference"] == 0,
            "steady_same": difference(step, first)["max_abs_difference"] == 0,
            "again_same": difference(again, first)["max_abs_difference"] == 0,
            "host_syncs": len(syncs.events), "where": syncs.events[:10], "lora_reads": len(lora_reads),
            "factor_bytes_moved": moved, "factor_bytes_from_pinned": copies.bytes,
            "cache_bytes": extra.get("transform_host_bytes", 0),
            "cache_pinned_bytes": extra.get("transform_pinned_bytes", 0),
            "pins_with": pins_with, "pins_without": pins_without, "pins_again": pins_again,
            "pins_after_close": pin_budget.used_bytes - used_before,
            "pin_warnings": [str(w.message) for w in caught if "LoRA factors" in str(w.message)],
            "race_count": len(device.races()) - races_before}
