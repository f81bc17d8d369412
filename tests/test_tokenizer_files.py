"""Tokenizer files that are not H3's: one CheckpointError naming the file (and what it is instead); prompts that
are not valid Unicode: one H3Error."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from h3_core.errors import CheckpointError, H3Error
from h3_core.models.tokenizer import H3_EXTRA_FIRST_ID, H3_EXTRA_TOKENS, H3Tokenizer
from text_encoder_fixtures import QWEN_FIRST_SPECIAL_ID, QWEN_SPECIAL_TOKENS, write_tiny_tokenizer


def _other_model_tokenizer(path, model):
    """A tokenizer.json of another model type that still carries every special token H3 checks, at H3's ids."""
    specials = {t: QWEN_FIRST_SPECIAL_ID + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}
    specials.update({t: H3_EXTRA_FIRST_ID + i for i, t in enumerate(H3_EXTRA_TOKENS)})
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t, i in specials.items()]
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("kind,model", [
    ("WordLevel", lambda: models.WordLevel({"a": 0, "fox": 1}, unk_token=None)),
    ("WordPiece", lambda: models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
    ("Unigram", lambda: models.Unigram([("a", -1.0), ("fox", -2.0)], 0, byte_fallback=False)),
])
def test_non_bpe_tokenizer_is_refused_at_load(tmp_path, kind, model):
    path = _other_model_tokenizer(tmp_path / "tokenizer.json", model())
    # The reference library loads it; the WordLevel one then fails on the first prompt ("WordLevel error").
    Tokenizer.from_file(str(path))
    with pytest.raises(CheckpointError) as info:
        H3Tokenizer(path)
    assert str(info.value) == (f"{path}: a {kind} tokenizer, not H3's byte-level BPE; the file belongs to another "
                               "model. Use tokenizer/tokenizer.json from the MiniMax-H3 release.")
    assert info.value.path == path and info.value.key == "model.type"


@pytest.mark.parametrize("content", [b"not json at all", b'{"model": ', b"\xff\xfe\x00garbage", b"[" * 100_000],
                         ids=["text", "truncated", "not-utf8", "nested-100000"])
def test_tokenizer_file_that_is_not_json(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        H3Tokenizer(path)
    assert str(info.value).startswith(f"{path}: not a tokenizer.json: it is not readable JSON (")
    assert info.value.path == path


def test_tokenizer_without_the_h3_tokens(tmp_path):
    path = write_tiny_tokenizer(tmp_path / "tokenizer.json", with_h3_tokens=False)
    with pytest.raises(CheckpointError) as info:
        H3Tokenizer(path)
    assert str(info.value).startswith(f"{path}: not the H3 tokenizer: its extra token '<d>' is missing, expected "
                                      "id 151669.")


def test_prompt_with_a_lone_surrogate(tmp_path):
    """What Python's surrogateescape leaves of undecodable bytes (e.g. a non-UTF-8 command line)."""
    tokenizer = H3Tokenizer(write_tiny_tokenizer(tmp_path / "tokenizer.json"))
    with pytest.raises(H3Error) as info:
        tokenizer.tokenize("a fox \udcff runs")
    assert str(info.value) == ("the prompt is not valid Unicode text: character 6 is a lone surrogate ('\\udcff'), "
                               "as left by decoding bytes that are not UTF-8. Give the prompt as UTF-8 text.")
