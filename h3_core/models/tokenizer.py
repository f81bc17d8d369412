"""The H3 tokenizer and how a request is presented to the Qwen3-VL text encoder.

H3 tokenises with its own `tokenizer.json`: Qwen3-VL's byte-level BPE plus 7 extra tokens at ids 151669-151675
(`<d>`, `</d>`, `<|cutoff|>`, `<|lyrics_start|>`, `<|lyrics_end|>`, `<|caption_start|>`, `<|caption_end|>`).
There is no chat template, no BOS/EOS and no truncation: the prompt is tokenised exactly as given. An empty request
becomes one `<|endoftext|>` token so the conditioning is never empty.

FL2VA keyframes are spliced in front of the prompt: for keyframe i (1-based) the label `"<Picture i>: "` and then a
vision block `<|vision_start|> N x <|image_pad|> <|vision_end|>`, where N is the keyframe's merged patch count.
Each piece is tokenised on its own, as the reference does. Every token of a vision block carries tag 0 (the DiT's
video tag); label and prompt tokens carry tag 1 (text).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .dit_config import TEXT_TAG, VIDEO_TAG
from ..errors import CheckpointError, H3Error

H3_EXTRA_TOKENS = ("<d>", "</d>", "<|cutoff|>", "<|lyrics_start|>", "<|lyrics_end|>", "<|caption_start|>",
                   "<|caption_end|>")
H3_EXTRA_FIRST_ID = 151669
PAD_TOKEN = "<|endoftext|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
TOKENIZER_FILE = "tokenizer.json"


def picture_label(index: int) -> str:
    """The label in front of keyframe / reference image `index` (1-based): `"<Picture 1>: "`."""
    if not isinstance(index, int) or index < 1:
        raise H3Error(f"picture index {index!r} must be a positive integer (pictures are numbered from 1).")
    return f"<Picture {index}>: "


def audio_label(index: int) -> str:
    """The label of Ref2VA audio `index` (1-based; a standalone audio or a video's soundtrack): `"<Audio 1>: "`."""
    return f"<Audio {index}>: "


def video_label(index: int) -> str:
    return f"<Video {index}>: "


def seconds_label(seconds: float) -> str:
    """The label in front of one merged frame pair of a video reference; `.1f` rounds half to even ("<0.2 seconds>"
    for 0.25 s), as the reference renders it."""
    return f"<{seconds:.1f} seconds>"


@dataclass(frozen=True)
class ReferenceTokens:
    """What the presentation needs of one Ref2VA reference: `kind` ("image", "video", "audio"), the vision tokens of
    an image's block or of each of a video's blocks, a video's block timestamps, and whether it has audio."""

    kind: str
    vision_tokens: int = 0
    block_seconds: tuple[float, ...] = ()
    has_audio: bool = False


@dataclass(frozen=True)
class Presentation:
    """A tokenised request: ids, per-token DiT tags, and where each image's pad run sits.

    `image_spans[i]` is `(first pad index, pad count)` of image i; its `<|vision_start|>` is just before and its
    `<|vision_end|>` just after.
    """

    token_ids: tuple[int, ...]
    tags: tuple[int, ...]
    image_spans: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.token_ids)


def find_tokenizer_file(path: str | os.PathLike) -> Path:
    """`path` itself if it is a file, else `path/tokenizer.json`."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: no such tokenizer file. Pass the H3 release's tokenizer/tokenizer.json (or the folder holding "
            "it).",
            path=path,
        )
    return path


class H3Tokenizer:
    """Tokenises prompts and builds the keyframe presentation. Load it with `H3Tokenizer(path)`."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer  # a declared dependency; imported here so h3_core imports without it

        self.path = find_tokenizer_file(path)
        text, kind = self._read_json()
        try:
            self._tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            raise CheckpointError(f"{self.path}: cannot be read as a tokenizer.json ({exc}). Download it again.",
                                  path=self.path) from None
        if kind != "BPE":
            # H3's is Qwen's byte-level BPE; another model (WordLevel, Unigram, ...) loads, then fails or splits
            # differently at the first prompt.
            raise CheckpointError(
                f"{self.path}: a {kind} tokenizer, not H3's byte-level BPE; the file belongs to another model. Use "
                "tokenizer/tokenizer.json from the MiniMax-H3 release.", path=self.path, key="model.type")
        for offset, token in enumerate(H3_EXTRA_TOKENS):
            found = self._tokenizer.token_to_id(token)
            if found != H3_EXTRA_FIRST_ID + offset:
                where = "is missing" if found is None else f"has id {found}"
                raise CheckpointError(
                    f"{self.path}: not the H3 tokenizer: its extra token '{token}' {where}, expected id "
                    f"{H3_EXTRA_FIRST_ID + offset}. The stock Qwen3-VL tokenizer lacks H3's 7 extra tokens and "
                    "splits them differently; use tokenizer/tokenizer.json from the MiniMax-H3 release.",
                    path=self.path,
                    key=token,
                )
        self.pad_id = self._require(PAD_TOKEN)
        self.vision_start_id = self._require(VISION_START_TOKEN)
        self.vision_end_id = self._require(VISION_END_TOKEN)
        self.image_pad_id = self._require(IMAGE_PAD_TOKEN)

    def _read_json(self) -> tuple[str, object]:
        """The file's text and its tokenizer model type (`model.type`), or one error if it is not JSON."""
        try:
            text = self.path.read_text(encoding="utf-8")
            data = json.loads(text)
        except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: not a tokenizer.json: it is not readable JSON ({exc}). Use "
                                  "tokenizer/tokenizer.json from the MiniMax-H3 release.", path=self.path) from None
        model = data.get("model") if isinstance(data, dict) else None
        return text, model.get("type") if isinstance(model, dict) else None

    def _require(self, token: str) -> int:
        found = self._tokenizer.token_to_id(token)
        if found is None:
            raise CheckpointError(
                f"{self.path}: has no '{token}' token, which every Qwen3-VL tokenizer carries; the file is not a "
                "Qwen3-VL / H3 tokenizer. Use tokenizer/tokenizer.json from the MiniMax-H3 release.",
                path=self.path,
                key=token,
            )
        return found

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` exactly as given: no template, no special tokens added, no truncation."""
        if not isinstance(text, str):
            raise H3Error(f"a prompt must be a string, got {type(text).__name__}.")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise H3Error(f"the prompt is not valid Unicode text: character {exc.start} is a lone surrogate "
                          f"({text[exc.start]!r}), as left by decoding bytes that are not UTF-8. Give the prompt as "
                          "UTF-8 text.") from None
        try:
            return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        except Exception as exc:  # tokenizers raises its own Exception type
            raise CheckpointError(f"{self.path}: the tokenizer failed on the prompt ({exc}); the file is not a working "
                                  "H3 tokenizer. Use tokenizer/tokenizer.json from the MiniMax-H3 release.",
                                  path=self.path) from None

    def present(self, prompt: str, image_token_counts: Sequence[int] = ()) -> Presentation:
        """Keyframes first (`"<Picture i>: "` + vision block each), then the prompt verbatim."""
        ids: list[int] = []
        tags: list[int] = []
        spans: list[tuple[int, int]] = []
        for index, count in enumerate(image_token_counts, start=1):
            if int(count) < 1:
                raise H3Error(f"image {index} has {count} vision tokens; an image needs at least one.")
            label = self.tokenize(picture_label(index))
            ids += label
            tags += [TEXT_TAG] * len(label)
            block = [self.vision_start_id] + [self.image_pad_id] * int(count) + [self.vision_end_id]
            spans.append((len(ids) + 1, int(count)))
            ids += block
            tags += [VIDEO_TAG] * len(block)
        prompt_ids = self.tokenize(prompt)
        ids += prompt_ids
        tags += [TEXT_TAG] * len(prompt_ids)
        if not ids:
            # An empty request still needs one row of conditioning; ComfyUI pads with <|endoftext|>.
            ids, tags = [self.pad_id], [TEXT_TAG]
        return Presentation(tuple(ids), tuple(tags), tuple(spans))

    def present_references(self, prompt: str, references: Sequence[ReferenceTokens]) -> Presentation:
        """The Ref2VA presentation, references in request order, each numbered per modality: an audio-bearing
        reference first gets `"<Audio j>: "` (audio never enters the encoder); an image `"<Picture i>: "` and its
        vision block; a video `"<Video k>: "` and, per merged frame pair, `"<t seconds>"` and a `<|video_pad|>`
        vision block. Then the prompt verbatim. `image_spans` lists every vision block's pad run in token order."""
        ids: list[int] = []
        tags: list[int] = []
        spans: list[tuple[int, int]] = []

        def text(value: str) -> None:
            piece = self.tokenize(value)
            ids.extend(piece)
            tags.extend([TEXT_TAG] * len(piece))

        def vision(pad_id: int, count: int, what: str) -> None:
            if int(count) < 1:
                raise H3Error(f"{what} has {count} vision tokens; a vision block needs at least one.")
            spans.append((len(ids) + 1, int(count)))
            block = [self.vision_start_id] + [pad_id] * int(count) + [self.vision_end_id]
            ids.extend(block)
            tags.extend([VIDEO_TAG] * len(block))

        counts = {"image": 0, "video": 0, "audio": 0}
        for ref in references:
            if ref.kind not in counts:
                raise H3Error(f"reference kind must be 'image', 'video' or 'audio', got {ref.kind!r}.")
            if ref.has_audio or ref.kind == "audio":
                counts["audio"] += 1
                text(audio_label(counts["audio"]))
            if ref.kind == "image":
                counts["image"] += 1
                text(picture_label(counts["image"]))
                vision(self.image_pad_id, ref.vision_tokens, f"reference image {counts['image']}")
            elif ref.kind == "video":
                counts["video"] += 1
                text(video_label(counts["video"]))
                video_pad = self._require(VIDEO_PAD_TOKEN)
                for seconds in ref.block_seconds:
                    text(seconds_label(seconds))
                    vision(video_pad, ref.vision_tokens, f"reference video {counts['video']}")
        text(prompt)
        if not ids:
            ids, tags = [self.pad_id], [TEXT_TAG]
        return Presentation(tuple(ids), tuple(tags), tuple(spans))
