"""Every config.json field a loader uses is validated before anything is built: a string, float, bool, negative,
zero or absurd (10^6, 10^9) layer count or width gives one CheckpointError naming the config file, the key and its
value (and, for a size, what the weights hold), found from the headers without building the module. The absurd
counts used to hang (the loader built 10^9 blocks to learn the expected tensors): those run in one child process,
each case with its own line and a timeout (`child_cases`)."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from child_cases import run_cases
from h3_fixtures import TINY, reference_model, save_diffusers, save_native
from vae_fixtures import reference_audio, reference_video, save_audio_diffusers, save_video_diffusers, save_video_native

import h3_core
from h3_core.errors import CheckpointError
from h3_core.sources.tiny_default import TEXT_ENCODER_LAYER

BAD_VALUES = ["2", 2.0, True, -1, 0, 10 ** 6, 10 ** 9]
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_cache):
    from h3_core.sources.tiny_default import ensure_tiny_model

    root = tmp_path_factory.mktemp("configs")
    dit = reference_model(TINY, seed=3)
    return {
        "dit-native": save_native(dit, TINY, root / "dit-native"),
        "dit-diffusers": save_diffusers(dit, root / "dit-diffusers"),
        "text-encoder": ensure_tiny_model(tiny_cache) / "text_encoders" / "qwen3vl_tiny_minimax_h3",
        "video-diffusers": save_video_diffusers(reference_video(seed=3), root / "video-diffusers"),
        "video-native": save_video_native(reference_video(seed=3), root / "video-native"),
        "audio-diffusers": save_audio_diffusers(reference_audio(seed=3), root / "audio-diffusers"),
    }


LOADERS = {
    "dit-native": h3_core.load_dit,
    "dit-diffusers": h3_core.load_dit,
    "text-encoder": lambda source: h3_core.load_text_encoder(source, layer=TEXT_ENCODER_LAYER),
    "video-diffusers": h3_core.load_video_vae,
    "video-native": h3_core.load_video_vae,
    "audio-diffusers": h3_core.load_audio_vae,
}
CONFIG_FILE = {"video-native": "source/config.json"}

# (checkpoint, config key as a path into the JSON, what the message calls it)
FIELDS = [
    ("dit-native", "num_layers", "num_layers"),
    ("dit-native", "token_refiner_num_layers", "token_refiner_num_layers"),
    ("dit-native", "hidden_size", "hidden_size"),
    ("dit-native", "ffn_hidden_size", "ffn_hidden_size"),
    ("dit-native", "attention_head_dim", "attention_head_dim"),
    ("dit-native", "latents_dim", "latents_dim"),
    ("dit-diffusers", "num_layers", "num_layers"),
    ("dit-diffusers", "num_refiner_layers", "num_refiner_layers"),
    ("dit-diffusers", "num_attention_heads", "num_attention_heads"),
    ("dit-diffusers", "text_dim", "text_dim"),
    ("text-encoder", "text_config.hidden_size", "hidden_size"),
    ("text-encoder", "text_config.num_attention_heads", "text_config.num_attention_heads"),
    ("text-encoder", "text_config.intermediate_size", "text_config.intermediate_size"),
    ("text-encoder", "vision_config.depth", "vision_config.depth"),
    ("text-encoder", "vision_config.hidden_size", "vision_config.hidden_size"),
    ("text-encoder", "vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
    ("video-diffusers", "decoder_num_layers", "decoder_num_layers"),
    ("video-diffusers", "layers_per_block", "layers_per_block"),
    ("video-diffusers", "decoder_num_register_tokens", "decoder_num_register_tokens"),
    ("video-native", "vit_decoder_kwargs.num_layers", "num_layers"),
    ("video-native", "num_res_blocks", "num_res_blocks"),
    ("audio-diffusers", "encoder_dim", "encoder_dim"),
    ("audio-diffusers", "decoder_dim", "decoder_dim"),
    ("audio-diffusers", "latent_dim", "latent_dim"),
]
# Lists whose length is a count (10^5 dilations per residual block used to hang building them).
LONG_LISTS = [
    ("audio-diffusers", "resblock_dilation_sizes", [[1] * 100_000] * 3,
     "'resblock_dilation_sizes[0] (their number)' is 100000 but the weights hold 3"),
]


def _edit_config(folder: Path, relative: str, dotted: str, value) -> Path:
    path = folder / relative
    config = json.loads(path.read_text())
    node = config
    *parents, leaf = dotted.split(".")
    for name in parents:
        node = node[name]
    node[leaf] = value
    path.write_text(json.dumps(config))
    return path


def _copy(checkpoints, name, tmp_path) -> Path:
    return shutil.copytree(checkpoints[name], tmp_path / name)


COUNTS = ("num_layers", "token_refiner_num_layers", "num_refiner_layers", "vision_config.depth", "decoder_num_layers",
          "layers_per_block", "vit_decoder_kwargs.num_layers", "num_res_blocks")
ABSURD = (10 ** 6, 10 ** 9)
# An absurd layer count used to hang: those cases run in a subprocess with a timeout (below), never in this process.
CASES = [(c, k, n, v) for c, k, n in FIELDS for v in BAD_VALUES if not (k in COUNTS and v in ABSURD)]


@pytest.mark.parametrize("checkpoint,key,named,value", CASES, ids=[f"{c}-{k}-{v!r}" for c, k, _, v in CASES])
def test_bad_config_value_gives_one_message(checkpoints, tmp_path, checkpoint, key, named, value):
    folder = _copy(checkpoints, checkpoint, tmp_path)
    config_path = _edit_config(folder, CONFIG_FILE.get(checkpoint, "config.json"), key, value)
    with pytest.raises(CheckpointError) as info:
        LOADERS[checkpoint](folder)
    message = str(info.value)
    assert message.startswith(f"{config_path}: "), message
    assert named in message and repr(value) in message, message
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        # A well-typed size that the weights (or another field of the config) contradict: the message says what.
        assert " but the weights hold " in message and "The config and the weights do not match" in message \
            or " implies " in message or "does not describe a valid H3 VAE" in message \
            or " differs from the language model's hidden_size " in message, message
    else:
        assert " must be a positive " in message or " must be an integer >= 0" in message \
            or " but the weights hold " in message, message


def test_dit_mismatch_message_in_full(checkpoints, tmp_path):
    folder = _copy(checkpoints, "dit-native", tmp_path)
    config_path = _edit_config(folder, "config.json", "num_layers", 5)
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(folder)
    assert str(info.value) == (
        f"{config_path}: 'num_layers' is 5 but the weights hold 2: 2 transformer blocks ('blocks.0.' to 'blocks.1.'). "
        "The config and the weights do not match; restore the config.json that came with these weights.")
    assert info.value.key == "num_layers" and info.value.path == config_path


def test_dit_type_message_in_full(checkpoints, tmp_path):
    folder = _copy(checkpoints, "dit-native", tmp_path)
    config_path = _edit_config(folder, "config.json", "ffn_hidden_size", "96")
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(folder)
    assert str(info.value) == (f"{config_path}: 'ffn_hidden_size' must be a positive integer, got '96'. Restore the "
                               "config.json of the release.")


# Each absurd count (and long list) in its own copy of its checkpoint; id -> (checkpoint, key, value).
ABSURD_CASES = {f"{c}-{key}-{value}": (c, key, value) for c, key, _ in FIELDS if key in COUNTS for value in ABSURD}
ABSURD_CASES.update({f"{c}-{key}-long": (c, key, value) for c, key, value, _ in LONG_LISTS})
LONG_LIST_MESSAGE = {key: expected for _, key, _, expected in LONG_LISTS}
LOAD_IN_CHILD = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    import h3_core
    from h3_core.errors import CheckpointError
    from child_cases import report_cases

    LOADERS = {{"dit": lambda source: h3_core.load_dit(source),
               "tex": lambda source: h3_core.load_text_encoder(source, layer=2),
               "vid": lambda source: h3_core.load_video_vae(source),
               "aud": lambda source: h3_core.load_audio_vae(source)}}

    def load(case):
        try:
            LOADERS[case["loader"]](case["source"])
        except CheckpointError as exc:
            return str(exc)
        return "loaded"

    report_cases(load)
""")


@pytest.fixture(scope="module")
def absurd_outcomes(checkpoints, tmp_path_factory):
    """Every absurd case loaded in one child process, each within 60 s of the one before (the first with the
    interpreter's start), one line each: a case that hangs (they used to build the 10^9 blocks) is killed and fails
    alone, and the cases after it run in a fresh child."""
    root = tmp_path_factory.mktemp("absurd")
    cases, config_paths = {}, {}
    for case, (checkpoint, key, value) in ABSURD_CASES.items():
        folder = shutil.copytree(checkpoints[checkpoint], root / case)
        config_paths[case] = _edit_config(folder, CONFIG_FILE.get(checkpoint, "config.json"), key, value)
        cases[case] = {"loader": checkpoint[:3], "source": str(folder)}
    root_path = str(Path(h3_core.__file__).parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root_path, str(TESTS), os.environ.get("PYTHONPATH", "")]))
    outcomes = run_cases(LOAD_IN_CHILD, cases, timeout_s=60, env=env)
    return {case: (config_paths[case], outcome) for case, outcome in outcomes.items()}


@pytest.mark.parametrize("case", ABSURD_CASES)
def test_absurd_counts_are_refused_without_building_them(absurd_outcomes, case):
    """An absurd count (10^6, 10^9 blocks; 10^5 dilations) is one CheckpointError, found without building them."""
    checkpoint, key, value = ABSURD_CASES[case]
    config_path, outcome = absurd_outcomes[case]
    message = outcome.value()
    if key in LONG_LIST_MESSAGE:
        expected = f"{config_path}: {LONG_LIST_MESSAGE[key]}"
    else:
        expected = f"{config_path}: '{key}' is {value} but the weights hold "
    assert message.startswith(expected), message
