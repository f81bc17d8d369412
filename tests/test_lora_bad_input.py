"""LoRAs under bad input: every bad number in a file (factors, alphas, peft metadata), every strength that could
overflow a fold, a folder, a file given twice, a file changed while a run folds it, and a NaN output a LoRA caused.
Each is one `LoraError` (the CLI: one `error: --lora ...` line, exit 2) naming the file, key and value, raised when
the file is read, before any fold; never a traceback, a SIGBUS or a silently wrong model.

The base file is the tiny turbo LoRA (rank 4 on the attention of both blocks of the tiny model), with one thing
changed per case.
"""

from __future__ import annotations

import json

import pytest
import torch
from child_cases import ROOT, run_cases
from safetensors.torch import load_file, save_file

import h3_core
from h3_core import LoraError
from h3_core.app import cli
from h3_core.sources import resolve_model
from h3_core.sources.tiny_default import write_tiny_lora

PAIR = "blocks.0.attn.qkv_proj"
UP, DOWN, ALPHA = f"{PAIR}.lora_B.weight", f"{PAIR}.lora_A.weight", f"{PAIR}.alpha"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return load_file(write_tiny_lora(tmp_path_factory.mktemp("lora") / "base.safetensors"))


@pytest.fixture
def dit(tiny):
    return resolve_model(tiny).transformer


def write(tmp_path, base, changes=None, metadata=None, name="bad.safetensors", drop=()):
    state = {k: v.clone() for k, v in base.items() if k not in drop}
    state.update(changes or {})
    path = tmp_path / name
    save_file(state, str(path), metadata=metadata)
    return path


def first_row(value):
    """The tiny LoRA's up factor with its first entry replaced."""
    return lambda base: base[UP].clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(value))


def peft(alpha: str, **extra) -> dict:
    return {"lora_adapter_metadata": json.dumps({"r": 4, **extra})[:-1] + f', "lora_alpha": {alpha}}}'}


# (case, changed tensors (name -> tensor or function of the base), metadata, key the error names, message part)
BAD_FILES = [
    ("alpha NaN", {ALPHA: torch.tensor(float("nan"))}, None, ALPHA,
     f"'{ALPHA}' is nan; a LoRA alpha must be a positive finite number"),
    ("alpha Inf", {ALPHA: torch.tensor(float("inf"))}, None, ALPHA, f"'{ALPHA}' is inf"),
    ("alpha negative", {ALPHA: torch.tensor(-4.0)}, None, ALPHA, f"'{ALPHA}' is -4.0"),
    ("alpha 0", {ALPHA: torch.tensor(0.0)}, None, ALPHA, f"'{ALPHA}' is 0.0"),
    ("alpha 1e38", {ALPHA: torch.tensor(1e38)}, None, ALPHA, f"'{ALPHA}' = 1e+38 with rank 4 scales the pair"),
    ("alpha vector", {ALPHA: torch.tensor([4.0, 4.0])}, None, ALPHA, "tensor of shape [2]; a LoRA alpha is one number"),
    ("alpha empty", {ALPHA: torch.zeros(0)}, None, ALPHA, "tensor of shape [0]; a LoRA alpha is one number"),
    ("alpha bool", {ALPHA: torch.tensor(True)}, None, ALPHA, "is a bool tensor"),
    ("rank 0 with an alpha", {UP: torch.zeros(192, 0), DOWN: torch.zeros(0, 64), ALPHA: torch.tensor(4.0)}, None, UP,
     "have rank 0"),
    ("rank 0", {UP: torch.zeros(192, 0), DOWN: torch.zeros(0, 64)}, None, UP, "have rank 0"),
    ("bool factors", {UP: lambda b: b[UP] > 0}, None, UP, "has dtype bool; LoRA factors are floating-point"),
    ("int32 factors", {DOWN: lambda b: (b[DOWN] * 100).to(torch.int32)}, None, DOWN, "has dtype int32"),
    ("complex factors", {UP: lambda b: b[UP].to(torch.complex64)}, None, UP, "has dtype complex64"),
    ("factors x1e30", {UP: lambda b: b[UP] * 1e30, DOWN: lambda b: b[DOWN] * 1e30}, None, UP,
     "holds values up to 8.39e+28 in size; LoRA values are at most 65504"),
    ("bf16 factors x1e30", {UP: lambda b: (b[UP] * 1e30).bfloat16()}, None, UP, "holds values up to"),
    ("factors x300 (their product 9e4 times)", {UP: lambda b: b[UP] * 300, DOWN: lambda b: b[DOWN] * 300}, None, UP,
     "(no alpha: scale 1), so at strength 1 it could change a weight by up to 1.17e+04, more than the 10000"),
    ("factors x1e3 (their product past float16)", {UP: lambda b: b[UP] * 1e3, DOWN: lambda b: b[DOWN] * 1e3}, None,
     UP, "can reach 1.3e+05, more than the 65504 a fold holds"),
    ("factors whose product overflows float16, scaled back by a tiny alpha",
     {UP: lambda b: b[UP] * 3e3, DOWN: lambda b: b[DOWN] * 3e3, ALPHA: torch.tensor(1e-4)}, None, UP,
     "can reach 1.17e+06, more than the 65504 a fold holds"),
    ("Inf factor", {UP: first_row(float("inf"))}, None, UP, "holds inf at flat index 0: its values must be finite"),
    ("NaN factor", {DOWN: lambda b: b[DOWN].index_fill(1, torch.tensor([3]), float("nan"))}, None, DOWN,
     "holds nan at flat index 3"),
    ("NaN full-weight delta", {"blocks.0.mlp.fc2.diff": torch.full((64, 128), float("nan"))}, None,
     "blocks.0.mlp.fc2.diff", "(a full-weight delta) holds nan"),
    ("Inf bias delta", {"blocks.0.adaln_proj.linear.diff_b": torch.full((1152,), float("-inf"))}, None,
     "blocks.0.adaln_proj.linear.diff_b", "holds -inf"),
    ("delta 1e5", {"blocks.0.mlp.fc2.diff": torch.full((64, 128), 1e5)}, None, "blocks.0.mlp.fc2.diff",
     "holds values up to 1e+05 in size"),
    ("metadata alpha 1e38", {}, {"alpha": "1e38"}, "blocks.0.attn.out_proj.lora_B.weight",
     "is scaled by 2.5e+37 (metadata 'alpha' = 1e+38, rank 4)"),
    ("peft lora_alpha NaN", {}, peft("NaN"), "lora_adapter_metadata", "sets lora_alpha to NaN; it must be a positive"),
    ("peft lora_alpha Infinity", {}, peft("1e400"), "lora_adapter_metadata", "sets lora_alpha to Infinity"),
    ("peft lora_alpha -8", {}, peft("-8"), "lora_adapter_metadata", "sets lora_alpha to -8"),
    ("peft lora_alpha 0", {}, peft("0"), "lora_adapter_metadata", "sets lora_alpha to 0"),
    ("peft lora_alpha a string", {}, peft('"abc"'), "lora_adapter_metadata", 'sets lora_alpha to "abc"'),
    ("peft lora_alpha true", {}, peft("true"), "lora_adapter_metadata", "sets lora_alpha to true"),
    ("peft lora_alpha null", {}, peft("null"), "lora_adapter_metadata", "sets lora_alpha to null"),
    ("peft lora_alpha a list", {}, peft("[8]"), "lora_adapter_metadata", "sets lora_alpha to [8]"),
    ("peft lora_alpha an object", {}, peft('{"a": 8}'), "lora_adapter_metadata", 'sets lora_alpha to {"a": 8}'),
    ("peft lora_alpha 1e38", {}, peft("1e38"), "blocks.0.attn.out_proj.lora_B.weight",
     "is scaled by 2.5e+37 (metadata 'lora_adapter_metadata' lora_alpha = 1e+38, rank 4)"),
    ("diffusers' prefixed lora_alpha NaN", {}, {"lora_adapter_metadata": '{"transformer.lora_alpha": NaN}'},
     "lora_adapter_metadata", "sets lora_alpha to NaN"),
    ("peft use_rslora a string", {}, peft("8", use_rslora="yes"), "lora_adapter_metadata",
     "sets use_rslora to 'yes'; it must be true or false"),
    ("peft config a list", {}, {"lora_adapter_metadata": "[1, 2]"}, "lora_adapter_metadata",
     "is '[1, 2]', not a JSON object"),
    ("peft config a number", {}, {"lora_adapter_metadata": "3"}, "lora_adapter_metadata", "is '3', not a JSON object"),
    ("peft config a string", {}, {"lora_adapter_metadata": '"x"'}, "lora_adapter_metadata", "not a JSON object"),
    ("peft config nested 5000 deep", {}, {"lora_adapter_metadata": "[" * 5000 + "]" * 5000}, "lora_adapter_metadata",
     "is not JSON (or nested too deeply)"),
    ("one tensor spelled twice", {"diffusion_model." + UP: lambda b: b[UP]}, None, "diffusion_model." + UP,
     f"keys '{UP}' and 'diffusion_model.{UP}' are the same tensor of '{PAIR}', so which one applies is ambiguous"),
]


@pytest.mark.parametrize("case,changes,metadata,key,message", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_bad_lora_file_is_one_error_when_it_is_read(base, tmp_path, case, changes, metadata, key, message):
    changes = {name: value(base) if callable(value) else value for name, value in changes.items()}
    path = write(tmp_path, base, changes, metadata)
    with pytest.raises(LoraError) as info:
        h3_core.read_lora(path)  # without the model: the node and the CLI see it before anything loads
    text = str(info.value)
    assert text.startswith(f"{path}: ") and message in text and info.value.key == key, text
    assert "\n" not in text


def test_good_numbers_of_every_kind_still_fold(base, tmp_path, dit):
    """What the checks allow: an integer alpha (scalar or [1]), float16 / bfloat16 factors, peft metadata with
    rsLoRA off; each folds a finite, changed weight."""
    plain = h3_core.load_dit(dit).blocks[0].attn.qkv_proj.weight
    for i, (changes, metadata) in enumerate([
            ({ALPHA: torch.tensor(8)}, None),
            ({ALPHA: torch.tensor([2.0])}, None),
            ({UP: base[UP].half(), DOWN: base[DOWN].bfloat16()}, None),
            ({}, peft("8", use_rslora=False))]):
        path = write(tmp_path, base, changes, metadata, name=f"good{i}.safetensors")
        weight = h3_core.load_dit(dit, loras=[(path, 1.0)], dtype=torch.float16).blocks[0].attn.qkv_proj.weight
        assert torch.isfinite(weight).all() and not torch.equal(weight.float(), plain.half().float()), i


@pytest.mark.parametrize("strength,dtype", [(1e308, None), (-1e308, None), (1e30, torch.float16),
                                            (2e5, torch.bfloat16)])
def test_a_strength_that_could_overflow_the_fold_is_refused(base, tmp_path, dit, strength, dtype):
    """1e308 was a RuntimeError from inside addmm_; 1e30 into float16 weights silently made them inf; 2e5 would
    change a weight by more than 1e4. The largest usable strength is named."""
    path = write(tmp_path, base, name="good.safetensors")
    with pytest.raises(LoraError) as info:
        h3_core.load_dit(dit, loras=[(path, strength)], dtype=dtype)
    text = str(info.value)
    assert text.startswith(f"{path}: strength {strength:g} would change 'blocks.0.attn.out_proj.weight' by up to ")
    assert "more than the 10000 any LoRA may" in text and "Use a strength of at most 7.42e+04 in size." in text


def test_the_strengths_of_loras_on_one_weight_add_up(base, tmp_path, dit):
    """A delta of 6000 is allowed once; the same file given twice (applied twice, as a chain of LoRA nodes does) or
    at strength 2 could change the weight by 12000, and is refused."""
    path = write(tmp_path, {"blocks.0.mlp.fc2.diff": torch.full((64, 128), 6000.0)}, name="delta.safetensors")
    assert h3_core.load_dit(dit, loras=[(path, 1.0)]).blocks[0].mlp.fc2.weight.abs().min() > 5000
    for loras, change in (([(path, 1.0), (path, 1.0)], "6e+03 (with the other LoRAs on it, 1.2e+04)"),
                          ([(path, 2.0)], "1.2e+04")):
        with pytest.raises(LoraError) as info:
            h3_core.load_dit(dit, loras=loras)
        assert str(info.value).startswith(f"{path}: strength {loras[-1][1]:g} would change 'blocks.0.mlp.fc2.weight' "
                                          f"by up to {change}, more than the 10000"), str(info.value)
        assert str(info.value).endswith("Use a strength of at most 1.67 in size.")


def test_a_folder_given_as_a_lora_says_it_is_a_folder(base, tmp_path):
    folder = tmp_path / "my_lora"
    folder.mkdir()
    write(folder, base, name="pytorch_lora_weights.safetensors")
    with pytest.raises(LoraError) as info:
        h3_core.read_lora(folder)
    assert str(info.value) == (f"{folder}: is a folder, not a LoRA file; give the LoRA's .safetensors file inside it "
                               "(it holds pytorch_lora_weights.safetensors).")


# ---- the CLI --------------------------------------------------------------------------------------------------------


def generate_args(tmp_path, *extra) -> list[str]:
    return ["generate", "a fox", "--frames", "5", "--size", "64x32", "--out", str(tmp_path / "o.mp4"), *extra]


def test_cli_bad_loras_are_one_error_line(base, tmp_path, tiny_cache, monkeypatch, capsys):
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny_cache))
    nan_alpha = write(tmp_path, base, {ALPHA: torch.tensor(float("nan"))}, name="nan_alpha.safetensors")
    good = write(tmp_path, base, name="good.safetensors")
    folder = tmp_path / "folder"
    folder.mkdir()
    for value, start in ((str(nan_alpha), f"error: --lora: {nan_alpha}: '{ALPHA}' is nan; a LoRA alpha must be"),
                         (f"{good}:1e308", f"error: --lora: {good}: strength 1e+308 would change "),
                         (str(folder), f"error: --lora: {folder}: is a folder, not a LoRA file")):
        assert cli.main(generate_args(tmp_path, "--lora", value)) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(start) and captured.err.count("\n") == 1, captured.err
        assert not (tmp_path / "o.mp4").exists()


def test_cli_the_same_lora_twice_is_applied_twice_with_a_note(base, tmp_path):
    """Applied twice, as the library and a chain of ComfyUI LoRA nodes do; the CLI says so, naming both strengths
    (another spelling of the same file counts too)."""
    path = write(tmp_path, base, name="twice.safetensors")
    alias = tmp_path / "alias.safetensors"
    alias.symlink_to(path)
    args = cli.build_parser().parse_args(generate_args(tmp_path, "--lora", f"{path}:0.5", "--lora", str(alias)))
    notes = []
    request = cli.check_arguments(args, notes.append)
    assert len(request.loras) == 2
    assert f"--lora {path}: given 2 times, so it is applied 2 times (strength 0.5 + 1 = 1.5); give it once to apply " \
           "it once" in notes


# ---- a LoRA file changed while a layerwise run folds it ------------------------------------------------------------


CHILD = f"""
import os, shutil, sys
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
import torch
import h3_core
from child_cases import report_cases
from h3_core.checkpoints.lora_loader import has_loras
from h3_fixtures import packed_inputs
from safetensors.torch import load_file, save_file


def run_case(parameters):
    dit, path, how = parameters["dit"], parameters["path"], parameters["how"]
    model = h3_core.load_dit(dit, loras=[(path, 1.0)], residency="layerwise")
    inputs = packed_inputs(model.config, text_len=6, latent_frames=2, latent_hw=(4, 4), audio_latents=3)
    with torch.no_grad():
        first = model(**inputs)
    size, before = os.path.getsize(path), os.stat(path)
    if how == "truncate":
        os.truncate(path, size // 3)
    elif how == "overwrite":  # cp new.safetensors over it: the same inode, truncated and written again
        shutil.copyfile(path + ".new", path)
    elif how in ("rewrite", "rewrite-keeping-mtime"):  # the factors' bytes made NaN in place, same size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\\xff" * (size - size // 2))
        if how == "rewrite-keeping-mtime":  # as rsync --inplace -t: only the status-change time moves
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif how == "rename":  # a new file moved over it, as downloads and editors do
        save_file({{k: v * 2 for k, v in load_file(path).items()}}, path + ".tmp")
        os.replace(path + ".tmp", path)
    try:
        with torch.no_grad():
            again = model(**inputs)
    except h3_core.CheckpointError as exc:
        return {{"error": str(exc), "path": str(exc.path), "read_again": not has_loras(model, [(path, 1.0)])}}
    return {{"error": None, "same": all(torch.equal(a, b) for a, b in zip(first, again)),
            "read_again": not has_loras(model, [(path, 1.0)])}}


report_cases(run_case)
"""

CHANGES = ("truncate", "overwrite", "rewrite", "rewrite-keeping-mtime", "rename")


@pytest.fixture(scope="module")
def changed_outcomes(tiny, tmp_path_factory):
    """Every case run once in one child (a SIGBUS, exit -7, fails only the case it happened in)."""
    root = tmp_path_factory.mktemp("lora_changed")
    dit = str(resolve_model(tiny).transformer)
    cases = {}
    for how in CHANGES:
        path = write_tiny_lora(root / f"{how}.safetensors")
        if how == "overwrite":  # what is copied over it: the same LoRA, doubled
            save_file({k: v * 2 for k, v in load_file(path).items()}, str(path) + ".new")
        cases[how] = {"dit": dit, "path": str(path), "how": how}
    return cases, run_cases(CHILD, cases, timeout_s=120)


@pytest.mark.parametrize("how", [c for c in CHANGES if c != "rename"])
def test_a_lora_changed_while_a_layerwise_run_folds_it_is_the_checkpoints_error(changed_outcomes, how):
    """Truncated: was a SIGBUS (the fold faulted the memory map's pages past the new end). Rewritten in place: was
    folded silently, NaN bytes and all. Now the checkpoints' own error, naming the LoRA, and the next run reads
    the file again (its identity, status-change time included, no longer matches)."""
    cases, outcomes = changed_outcomes
    result = outcomes[how].value()
    assert result["error"] is not None and result["path"] == cases[how]["path"], result
    assert result["error"].startswith(f"{cases[how]['path']}: the checkpoint changed while it was loaded (")
    assert ("size changed" if how in ("truncate", "overwrite") else "rewritten") in result["error"]
    assert result["read_again"] is True


def test_a_lora_replaced_by_rename_while_in_use_keeps_its_read_bytes_until_the_next_run(changed_outcomes):
    """The fold's descriptor stays on the file that was read and checked (as the checkpoints' does): the run in
    progress folds the same bytes; the next sample sees the new file and reads it."""
    _, outcomes = changed_outcomes
    result = outcomes["rename"].value()
    assert result == {"error": None, "same": True, "read_again": True}


# ---- a NaN output with a LoRA folded in ------------------------------------------------------------------------------


def test_a_nan_output_with_a_lora_folded_in_names_the_lora(tiny, tmp_path):
    """Finite factors, a change within the bound, and still an overflow in float16: the message names the LoRA and
    its strength (it said "its weights are finite" and named nothing)."""
    from h3_core.pipeline import H3Pipeline

    path = tmp_path / "loud.safetensors"
    save_file({f"blocks.{i}.mlp.fc2.diff": torch.full((64, 128), 9000.0) for i in (0, 1)}, str(path))
    pipe = H3Pipeline(resolve_model(tiny), dtype=torch.float16)
    try:
        with pytest.raises(h3_core.H3Error) as info:
            pipe.generate("a fox", width=64, height=64, num_frames=5, steps=3, seed=5, loras=[(path, 1.0)])
    finally:
        pipe.release_all()
    assert str(info.value) == (
        "the transformer produced NaN/Inf at step 1 of 2 (its video velocity output) although its weights and LoRA "
        f"factors are finite, with this LoRA folded in: {path} at strength 1. A LoRA's change can push the numbers "
        "out of range: run without it, or at a lower strength, to tell; if that runs clean, the LoRA does not suit "
        "this model. Otherwise the numbers overflowed float16's range. Set the dtype to bfloat16 or float32 rather "
        "than float16.")
