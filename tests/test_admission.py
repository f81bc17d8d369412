"""MPS admission rules, checked anywhere with an injected platform description."""

from __future__ import annotations

import pytest

import h3_core
from h3_core.components import COMPONENTS
from h3_core.runtime import AdmissionError, ComponentPlan, Platform, admission_violations, check_admission

MPS = Platform("mps")
CUDA = Platform("cuda")


def plan(**overrides):
    """All four components layerwise on one MPS device, not compiled (the admitted plan), with overrides."""
    out = {name: ComponentPlan("layerwise", "mps") for name in COMPONENTS}
    out.update(overrides)
    return out


def refused(plan_, platform=MPS) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        check_admission(plan_, platform)
    assert isinstance(info.value, h3_core.H3Error)
    return info.value


def test_the_all_layerwise_single_device_eager_plan_is_admitted():
    check_admission(plan(), MPS)
    check_admission(plan(transformer=ComponentPlan(h3_core.Residency.LAYERWISE_OFFLOAD, "mps:0")), MPS)
    assert admission_violations(plan(), MPS) == []


def test_every_component_must_be_layerwise_on_mps():
    error = refused(plan(text_encoder=ComponentPlan("resident", "mps")))
    assert error.violations == [("text_encoder", "is resident; on unified memory that holds a second copy of weights "
                                                 "already mapped from disk", "set residency='layerwise'")]
    assert "text_encoder: is resident" in str(error) and "fix: set residency='layerwise'" in str(error)
    # All four resident: one error naming all four.
    error = refused({name: ComponentPlan(h3_core.Residency.RESIDENT, "mps") for name in COMPONENTS})
    assert [v[0] for v in error.violations] == list(COMPONENTS)
    assert "refused 4 setting(s) of audio_vae, text_encoder, transformer, video_vae" in str(error)
    for name in COMPONENTS:
        assert f"  - {name}: is resident" in str(error)


def test_residency_values_are_limited_to_resident_and_layerwise_on_mps():
    error = refused(plan(video_vae=ComponentPlan("model_offload", "mps"), audio_vae=ComponentPlan("auto", "mps")))
    assert [v[0] for v in error.violations] == ["video_vae", "audio_vae"]
    assert "video_vae: residency 'model_offload' is not available on MPS" in str(error)
    assert "audio_vae: residency 'auto' is not available on MPS" in str(error)
    assert str(error).count("fix: set residency='layerwise'") == 2


def test_torch_compile_is_refused_on_mps():
    error = refused(plan(transformer=ComponentPlan("layerwise", "mps", compile=True)))
    assert error.violations == [("transformer", "asks for torch.compile, which is refused on MPS",
                                 "set compile=False (eager execution)")]
    assert "transformer: asks for torch.compile" in str(error)


def test_only_one_device_on_mps():
    error = refused(plan(audio_vae=ComponentPlan("layerwise", "cpu")))
    assert [v[0] for v in error.violations] == ["audio_vae"]
    assert "audio_vae: runs on 'cpu'; MPS runs use one device; fix: put every component on 'mps'" in str(error)
    error = refused(plan(video_vae=ComponentPlan("layerwise", "mps:1")))
    assert [v[0] for v in error.violations] == ["video_vae"]
    error = refused({name: ComponentPlan("layerwise", "cpu") for name in COMPONENTS})
    assert [v[0] for v in error.violations] == list(COMPONENTS)


def test_one_error_lists_every_violation_with_its_fix():
    error = refused({
        "transformer": ComponentPlan("resident", "mps", compile=True),
        "text_encoder": ComponentPlan("layerwise", "cuda"),
        "video_vae": ComponentPlan("layerwise", "mps"),
        "audio_vae": ComponentPlan("sequential", "mps"),
        "vocoder": ComponentPlan("layerwise", "mps"),
    })
    names = [v[0] for v in error.violations]
    assert names == ["vocoder", "transformer", "transformer", "audio_vae", "text_encoder"]
    assert "refused 5 setting(s)" in str(error)
    assert str(error).count("fix:") == 5
    assert "vocoder: is not an H3 component" in str(error)


def test_other_platforms_admit_resident_and_compiled_components():
    check_admission(plan(transformer=ComponentPlan("resident", "cuda", compile=True),
                         text_encoder=ComponentPlan("resident", "cpu")), CUDA)
    check_admission(plan(), Platform("cpu"))
    error = refused(plan(transformer=ComponentPlan("bogus", "cuda")), CUDA)  # unknown values are refused anywhere
    assert error.violations[0][0] == "transformer" and "residency 'bogus' is unknown" in str(error)


def test_platform_for_a_device():
    assert Platform.for_device("mps:0") == MPS and Platform.for_device("cuda") == CUDA
    assert Platform.for_device("cpu") == Platform("cpu") != MPS


@pytest.mark.parametrize("cuda,mps,expected", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_detect_prefers_cuda_then_mps_then_the_cpu(monkeypatch, cuda, mps, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert Platform.detect() == Platform(expected)


def test_load_dit_applies_the_rules_before_reading_anything(tmp_path):
    with pytest.raises(AdmissionError) as info:
        h3_core.load_dit(tmp_path / "missing", device="mps")  # resident by default: refused before the path is read
    assert info.value.violations[0][:1] == ("transformer",)
    assert "transformer: is resident" in str(info.value) and "residency='layerwise'" in str(info.value)
