"""H3 tokenisation and keyframe presentation against transformers' Qwen2 tokenizer.

The reference is `transformers`' `Qwen2Tokenizer` built from the vocabulary and merges of the same tokenizer.json
(and its added tokens), so its pre-tokenisation (Qwen's split pattern), normalisation (NFC) and byte-level mapping
are transformers' own, not what our file says: a tokenizer.json or a tokenizer that splits or normalises
differently from Qwen gives other ids."""

from __future__ import annotations

import json

import pytest

from h3_core import H3Tokenizer
from h3_core.errors import CheckpointError, H3Error
from h3_core.models.tokenizer import H3_EXTRA_FIRST_ID as H3_FIRST_ID, H3_EXTRA_TOKENS as H3_TOKENS, picture_label
from text_encoder_fixtures import QWEN_FIRST_SPECIAL_ID, write_tiny_tokenizer

PROMPTS = [
    "A red fox runs across a snowy field at dawn.",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\r\n\ttabbed",
    "Ein Hund läuft über die Wiese — 日本語のテキスト 🎵",
    "<|caption_start|>A dog barks.<|caption_end|><|lyrics_start|>la la la<|lyrics_end|>",
    "<d>scene</d> cut here <|cutoff|> and <|endoftext|> inline",
    "x<d>y</d>z<|cutoff|><|cutoff|>",
    "Numbers 12345 and symbols (a) [b] {c}!",
    " ",
]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def h3_tokenizer(tokenizer_path):
    return H3Tokenizer(tokenizer_path)


class Reference:
    """transformers' Qwen2 tokenizer on the vocabulary, merges and added tokens of a tokenizer.json."""

    def __init__(self, path):
        from tokenizers import AddedToken
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

        data = json.loads(path.read_text(encoding="utf-8"))
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]]
        self.tokenizer = Qwen2Tokenizer(vocab=data["model"]["vocab"], merges=merges)
        self.tokenizer.add_tokens([AddedToken(t["content"], special=True, normalized=False)
                                   for t in data["added_tokens"]])

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def token_to_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)


@pytest.fixture(scope="module")
def reference(tokenizer_path):
    return Reference(tokenizer_path)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ids_match_the_qwen2_reference(h3_tokenizer, reference, prompt):
    expected = reference.ids(prompt)
    assert h3_tokenizer.tokenize(prompt) == expected
    # The prompt alone is presented verbatim, every token tagged text.
    presentation = h3_tokenizer.present(prompt)
    assert list(presentation.token_ids) == expected
    assert presentation.tags == (1,) * len(expected)
    assert presentation.image_spans == ()


def test_h3_extra_tokens_have_their_ids(h3_tokenizer):
    for offset, token in enumerate(H3_TOKENS):
        assert h3_tokenizer.tokenize(token) == [H3_FIRST_ID + offset]
    ids = h3_tokenizer.tokenize("<|lyrics_start|>la<|lyrics_end|>")
    assert ids[0] == H3_FIRST_ID + 3 and ids[-1] == H3_FIRST_ID + 4 and len(ids) > 2


def test_empty_prompt_is_one_endoftext(h3_tokenizer):
    presentation = h3_tokenizer.present("")
    assert presentation.token_ids == (QWEN_FIRST_SPECIAL_ID,)
    assert presentation.tags == (1,)
    assert h3_tokenizer.tokenize("") == []


def test_picture_labels_are_exact():
    assert picture_label(1) == "<Picture 1>: "
    assert picture_label(2) == "<Picture 2>: "
    assert picture_label(12) == "<Picture 12>: "
    for bad in (0, -1, 1.0):
        with pytest.raises(H3Error, match="positive integer"):
            picture_label(bad)


def test_keyframe_presentation(h3_tokenizer, reference):
    ref = reference.ids
    start, end, pad = reference.token_to_id("<|vision_start|>"), reference.token_to_id("<|vision_end|>"), \
        reference.token_to_id("<|image_pad|>")
    assert (start, end, pad) == (151652, 151653, 151655)
    presentation = h3_tokenizer.present("a fox in the snow", [3, 2])
    label1, label2, prompt = ref("<Picture 1>: "), ref("<Picture 2>: "), ref("a fox in the snow")
    expected_ids = label1 + [start] + [pad] * 3 + [end] + label2 + [start] + [pad] * 2 + [end] + prompt
    expected_tags = [1] * len(label1) + [0] * 5 + [1] * len(label2) + [0] * 4 + [1] * len(prompt)
    assert list(presentation.token_ids) == expected_ids
    assert list(presentation.tags) == expected_tags
    first = len(label1) + 1
    second = len(label1) + 5 + len(label2) + 1
    assert presentation.image_spans == ((first, 3), (second, 2))
    for s, n in presentation.image_spans:
        assert presentation.token_ids[s - 1] == start and presentation.token_ids[s + n] == end
        assert set(presentation.token_ids[s : s + n]) == {pad}


def test_keyframe_with_empty_prompt_needs_no_pad(h3_tokenizer, reference):
    presentation = h3_tokenizer.present("", [1])
    label = reference.ids("<Picture 1>: ")
    assert list(presentation.token_ids) == label + [151652, 151655, 151653]
    assert list(presentation.tags) == [1] * len(label) + [0, 0, 0]


def test_folder_is_accepted(tokenizer_path, h3_tokenizer):
    assert H3Tokenizer(tokenizer_path.parent).tokenize(PROMPTS[0]) == h3_tokenizer.tokenize(PROMPTS[0])


def test_stock_qwen_tokenizer_is_refused(tmp_path):
    stock = write_tiny_tokenizer(tmp_path / "tokenizer.json", with_h3_tokens=False)
    with pytest.raises(CheckpointError, match="not the H3 tokenizer.*'<d>' is missing") as info:
        H3Tokenizer(stock)
    assert info.value.path == stock and info.value.key == "<d>"


def test_bad_tokenizer_files(tmp_path, h3_tokenizer):
    with pytest.raises(CheckpointError, match="no such tokenizer file"):
        H3Tokenizer(tmp_path / "missing.json")
    broken = tmp_path / "broken" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text(json.dumps({"model": {"type": "nonsense"}}))
    with pytest.raises(CheckpointError, match="cannot be read as a tokenizer.json") as info:
        H3Tokenizer(broken.parent)
    assert info.value.path == broken
    with pytest.raises(H3Error, match="must be a string"):
        h3_tokenizer.tokenize(None)
    with pytest.raises(H3Error, match="at least one"):
        h3_tokenizer.present("x", [0])
