"""The packed sequence: latent shape arithmetic, patchify, and the row layout (positions, tags, stream indices).

Rows are ordered `text | condition (keyframe) rows | target audio (channel 0, then 1) | target video`. Positions are
real-valued (t, h, w) rotary coordinates built in float64: one time unit is 1/40 s, a pixel frame is 5/3 units, the
spatial grid is centred, area-normalised and scaled by 32, and the two audio channels are pinned to the leftmost and
rightmost width coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import H3Error
from ..models.dit_config import AUDIO_TAG, VIDEO_TAG
from ..request.grid import AUDIO_CHANNELS

# Rotary time of one pixel frame, and how many pixel frames each latent frame of a chunk stands for.
ROPE_FRAME_UNITS = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32.0


# ---- shape arithmetic ---------------------------------------------------------------------------------------------


# ---- patchify -----------------------------------------------------------------------------------------------------


def patchify(latent: torch.Tensor, patch_size=(1, 2, 2)) -> torch.Tensor:
    """`[B, C, T, H, W]` -> rows `[B, T/pt * H/ph * W/pw, C * pt * ph * pw]`, frame-major, feature index c-slowest."""
    pt, ph, pw = patch_size
    b, c, t, h, w = latent.shape
    if t % pt or h % ph or w % pw:
        raise H3Error(f"latent of shape {tuple(latent.shape)} is not divisible by the patch {tuple(patch_size)}.")
    x = latent.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * pt * ph * pw)


def unpatchify(rows: torch.Tensor, latent_shape, patch_size=(1, 2, 2)) -> torch.Tensor:
    """Inverse of `patchify`: rows `[B, N, C*pt*ph*pw]` -> `[B, C, T, H, W]` with `latent_shape = (C, T, H, W)`."""
    pt, ph, pw = patch_size
    c, t, h, w = latent_shape
    b = rows.shape[0]
    x = rows.reshape(b, t // pt, h // ph, w // pw, c, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, t, h, w)


def audio_to_rows(latent: torch.Tensor) -> torch.Tensor:
    """`[B, C, 2, Ta]` -> channel-major rows `[B, 2 * Ta, C]`."""
    b, c, ch, ta = latent.shape
    return latent.permute(0, 2, 3, 1).reshape(b, ch * ta, c)


def rows_to_audio(rows: torch.Tensor, channels: int = AUDIO_CHANNELS) -> torch.Tensor:
    """Inverse of `audio_to_rows`."""
    b, n, c = rows.shape
    return rows.reshape(b, channels, n // channels, c).permute(0, 3, 1, 2)


# ---- positions ----------------------------------------------------------------------------------------------------


def spatial_axis(latent_dim: int, patch: int, sqrt_area: float) -> np.ndarray:
    """Centred, area-normalised coordinates of one spatial axis (right end excluded), scaled by 32, float64."""
    ratio = latent_dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    # numpy's linspace(endpoint=False) defines the released coordinates to the last ulp; torch.linspace differs.
    return np.linspace(left, left + ratio, latent_dim // patch, endpoint=False) * ROPE_SPATIAL_SCALE


def frame_grid(latent_height: int, latent_width: int, patch_size=(1, 2, 2)) -> tuple[np.ndarray, np.ndarray]:
    """(h, w) coordinates of one latent frame's rows `[h*w, 2]`, and the width axis."""
    _, ph, pw = patch_size
    sqrt_area = float(np.sqrt(latent_height * latent_width))
    hs = spatial_axis(latent_height, ph, sqrt_area)
    ws = spatial_axis(latent_width, pw, sqrt_area)
    grid = np.stack([np.repeat(hs, ws.size), np.tile(ws, hs.size)], axis=-1)
    return grid, ws


def latent_frame_spans(latent_frames: int) -> np.ndarray:
    """Rotary duration of each latent frame: 5/3 x (1, 4, 4, 4, 4, 1, 4, ...)."""
    pattern = ROPE_FRAMES_PER_LATENT
    return np.array([ROPE_FRAME_UNITS * pattern[i % len(pattern)] for i in range(latent_frames)], dtype=np.float64)


def latent_frame_times(latent_frames: int, origin: float) -> np.ndarray:
    """Rotary time of the first pixel frame of every latent frame (sequential summation)."""
    spans = latent_frame_spans(latent_frames)
    return origin + np.concatenate([[0.0], np.cumsum(spans[:-1])])


def last_keyframe_time(latent_frames: int, origin: float) -> float:
    """Rotary time of the last pixel frame. The reference sums the spans pairwise here (np.sum), not sequentially."""
    return float(origin) + float(np.sum(latent_frame_spans(latent_frames))) - ROPE_FRAME_UNITS


@dataclass(frozen=True)
class PackedLayout:
    """Row layout of one forward: positions `[S, 3]` float64, tags `[S]`, and the rows of each stream.

    `video_indices` lists the condition rows first, then the target video rows; `audio_indices` the target audio rows
    (channel 0, then channel 1).
    """

    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.position_ids.shape[0])

    def to(self, device) -> "PackedLayout":
        return PackedLayout(*(t.to(device) for t in (self.position_ids, self.token_tags, self.video_indices,
                                                     self.audio_indices, self.text_indices)),
                            self.num_condition_video_rows, self.num_condition_audio_rows)

    def model_kwargs(self, position_dtype=torch.float32) -> dict:
        """The layout arguments of `H3DiT.forward`."""
        return dict(token_tags=self.token_tags, position_ids=self.position_ids.to(position_dtype),
                    video_indices=self.video_indices, audio_indices=self.audio_indices,
                    text_indices=self.text_indices)


@dataclass(frozen=True)
class GuideBlock:
    """The geometry of one guide's condition rows (`request.guides`): the target pixel `frame` it starts at
    (resolved, 0 .. F - 1), its video latent frames on the target grid (0: audio alone; 1: an image) and its audio
    latents per channel (0: none)."""

    frame: int
    latent_frames: int = 0
    audio_latents: int = 0


def guide_time(frame: int, origin: float) -> float:
    """Rotary time of a guide at pixel `frame`: `origin + 5/3 x frame`, as ComfyUI core's PackedLayout computes it
    (`cursor + FRAME_RESCALE * resolved_frame_index`). For the last frame this differs from `last_keyframe_time`
    (SGLang's pairwise span sum) in the last float64 ulp for some lengths: `last_frame` keeps SGLang's."""
    return float(origin) + ROPE_FRAME_UNITS * int(frame)


def build_packed_layout(text_tags: torch.Tensor, latent_frames: int, latent_height: int, latent_width: int,
                        audio_latents: int, keyframe_anchors: tuple[str, ...] = (), patch_size=(1, 2, 2),
                        audio_channels: int = AUDIO_CHANNELS, guides=()) -> PackedLayout:
    """Layout of a T2VA (no anchors) or FL2VA (`"first"` / `"last"` keyframe anchors, in packed order) request,
    with `guides` (`GuideBlock`s, request order).

    `text_tags` are the per-token tags of the text rows (1 for text, 0 for the rows of a keyframe's vision block).
    Rows: `text | keyframes | guides | target audio | target video`, each guide its video rows (on the target grid,
    frame-major, times from `guide_time`) then its audio rows (channel-major, `guide_time + n`, width pinned to the
    target grid's extremes), as ComfyUI core's PackedLayout packs its keyframe list (core's first / last keyframes
    come first there too). `video_indices` lists keyframe rows, guide video rows, then the target video;
    `audio_indices` guide audio rows, then the target audio.
    """
    _, ph, pw = patch_size
    if latent_height % ph or latent_width % pw:
        raise H3Error(f"latent {latent_height}x{latent_width} is not divisible by the patch {ph}x{pw}.")
    num_text = int(text_tags.shape[0])
    frame_rows = (latent_height // ph) * (latent_width // pw)
    guides = list(guides)
    for guide in guides:
        if guide.latent_frames < 0 or guide.audio_latents < 0 or not (guide.latent_frames or guide.audio_latents):
            raise H3Error(f"guide at frame {guide.frame}: it has no rows ({guide.latent_frames} latent frames, "
                          f"{guide.audio_latents} audio latents).")
    num_keyframe_rows = len(keyframe_anchors) * frame_rows
    guide_video_rows = sum(g.latent_frames for g in guides) * frame_rows
    guide_audio_rows = sum(g.audio_latents for g in guides) * audio_channels
    num_cond = num_keyframe_rows + guide_video_rows + guide_audio_rows
    num_audio = audio_channels * audio_latents
    num_video = latent_frames * frame_rows
    cond_start = num_text
    audio_start = cond_start + num_cond
    video_start = audio_start + num_audio
    total = video_start + num_video

    pos = np.zeros((total, 3), dtype=np.float64)
    pos[:num_text, 0] = np.arange(num_text, dtype=np.float64)
    grid, width_axis = frame_grid(latent_height, latent_width, patch_size)
    origin = float(num_text)

    for i, anchor in enumerate(keyframe_anchors):
        if anchor == "first":
            t = origin
        elif anchor == "last":
            t = last_keyframe_time(latent_frames, origin)
        else:
            raise H3Error(f"keyframe anchor must be 'first' or 'last', got {anchor!r}.")
        rows = slice(cond_start + i * frame_rows, cond_start + (i + 1) * frame_rows)
        pos[rows, 0] = t
        pos[rows, 1:] = grid

    video_runs, audio_runs = [(cond_start, cond_start + num_keyframe_rows)], []
    row = cond_start + num_keyframe_rows
    for guide in guides:
        time = guide_time(guide.frame, origin)
        if guide.latent_frames:
            rows = guide.latent_frames * frame_rows
            _place_video(pos, row, guide.latent_frames, latent_height, latent_width, time, patch_size)
            video_runs.append((row, row + rows))
            row += rows
        if guide.audio_latents:
            rows = audio_channels * guide.audio_latents
            _place_audio(pos, row, guide.audio_latents, time, width_axis, audio_channels)
            audio_runs.append((row, row + rows))
            row += rows

    _place_audio(pos, audio_start, audio_latents, origin, width_axis, audio_channels)

    times = latent_frame_times(latent_frames, origin)
    video_pos = pos[video_start:].reshape(latent_frames, frame_rows, 3)
    video_pos[:, :, 0] = times[:, None]
    video_pos[:, :, 1:] = grid[None]

    video_indices = torch.cat([torch.arange(a, b) for a, b in video_runs] + [torch.arange(video_start, total)])
    audio_indices = torch.cat([torch.arange(a, b) for a, b in audio_runs] + [torch.arange(audio_start, video_start)])
    tags = torch.empty(total, dtype=torch.long)
    tags[:num_text] = text_tags.to(torch.long)
    tags[video_indices] = VIDEO_TAG
    tags[audio_indices] = AUDIO_TAG
    return PackedLayout(
        position_ids=torch.from_numpy(pos),
        token_tags=tags,
        video_indices=video_indices,
        audio_indices=audio_indices,
        text_indices=torch.arange(num_text),
        num_condition_video_rows=num_keyframe_rows + guide_video_rows,
        num_condition_audio_rows=guide_audio_rows,
    )


# ---- Ref2VA -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceBlock:
    """The geometry of one Ref2VA reference block, as its encoded latents give it.

    `kind` is "image", "video" or "audio". Visual references give their latent `(frames, height, width)`; an image
    has one latent frame. `audio_latents` is the audio latents per channel of an audio reference or of a video's
    soundtrack (0: a video without sound).
    """

    kind: str
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0

    @property
    def has_audio(self) -> bool:
        return self.kind == "audio" or (self.kind == "video" and self.audio_latents > 0)

    def video_rows(self, patch_size=(1, 2, 2)) -> int:
        _, ph, pw = patch_size
        return self.latent_frames * (self.latent_height // ph) * (self.latent_width // pw)


def _place_audio(pos: np.ndarray, start: int, audio_latents: int, time: float, width_axis: np.ndarray,
                 audio_channels: int) -> None:
    """One channel-major audio block from row `start`: time `time + n`, no height, width pinned to the two extremes
    of `width_axis` (channel 0 left, the others right)."""
    times = time + np.arange(audio_latents, dtype=np.float64)
    pinned = [width_axis[0], width_axis[-1]]
    for ch in range(audio_channels):
        rows = slice(start + ch * audio_latents, start + (ch + 1) * audio_latents)
        pos[rows, 0] = times
        pos[rows, 2] = pinned[min(ch, 1)]


def _place_video(pos: np.ndarray, start: int, latent_frames: int, latent_height: int, latent_width: int,
                 origin: float, patch_size) -> np.ndarray:
    """Frame-major video rows from `start` with times from `origin`; returns the block's width axis."""
    grid, width_axis = frame_grid(latent_height, latent_width, patch_size)
    rows = grid.shape[0]
    block = pos[start:start + latent_frames * rows].reshape(latent_frames, rows, 3)
    block[:, :, 0] = latent_frame_times(latent_frames, origin)[:, None]
    block[:, :, 1:] = grid[None]
    return width_axis


def build_ref2va_layout(text_tags: torch.Tensor, references, latent_frames: int, latent_height: int,
                        latent_width: int, audio_latents: int, patch_size=(1, 2, 2),
                        audio_channels: int = AUDIO_CHANNELS) -> PackedLayout:
    """Layout of a Ref2VA request: `text | reference blocks in request order | target audio | target video`.

    A rotary time cursor starts at the text length. An image takes its own area-normalised grid at the cursor and
    advances it by 1; an audio reference its `2 x n` rows at `cursor + k`, width pinned to the *target* grid's
    extremes, advancing by n; a video its soundtrack rows first, then its frames, both from the cursor, the
    soundtrack's width pinned to the *video's* grid extremes, advancing by max(n, sum of its frame spans) (summed
    sequentially, as the reference does here). The targets start at the final cursor. `video_indices` lists the
    reference visual rows (request order), then the target video; `audio_indices` the reference audio rows, then the
    target audio.
    """
    _, ph, pw = patch_size
    for name, dim, patch in (("latent height", latent_height, ph), ("latent width", latent_width, pw)):
        if dim % patch:
            raise H3Error(f"target {name} {dim} is not divisible by the patch {patch}.")
    references = list(references)
    for index, ref in enumerate(references, start=1):
        if ref.kind not in ("image", "video", "audio"):
            raise H3Error(f"reference {index}: kind must be 'image', 'video' or 'audio', got {ref.kind!r}.")
        if ref.kind in ("image", "video") and (ref.latent_height % ph or ref.latent_width % pw
                                               or min(ref.latent_frames, ref.latent_height, ref.latent_width) < 1):
            raise H3Error(f"reference {index} ({ref.kind}): latent {ref.latent_frames}x{ref.latent_height}x"
                          f"{ref.latent_width} is empty or not divisible by the patch {ph}x{pw}.")
        if ref.kind == "image" and ref.latent_frames != 1:
            raise H3Error(f"reference {index} (image): an image has one latent frame, got {ref.latent_frames}.")
        if ref.kind == "audio" and ref.audio_latents < 1:
            raise H3Error(f"reference {index} (audio): an audio reference needs at least one latent.")
    num_text = int(text_tags.shape[0])
    ref_audio_rows = sum(audio_channels * ref.audio_latents for ref in references if ref.has_audio)
    ref_video_rows = sum(ref.video_rows(patch_size) for ref in references if ref.kind != "audio")
    frame_rows = (latent_height // ph) * (latent_width // pw)
    num_audio = audio_channels * audio_latents
    total = num_text + ref_audio_rows + ref_video_rows + num_audio + latent_frames * frame_rows

    pos = np.zeros((total, 3), dtype=np.float64)
    pos[:num_text, 0] = np.arange(num_text, dtype=np.float64)
    _, target_width_axis = frame_grid(latent_height, latent_width, patch_size)
    video_runs, audio_runs = [], []
    row = num_text
    cursor = float(num_text)
    for ref in references:
        if ref.kind == "image":
            rows = ref.video_rows(patch_size)
            _place_video(pos, row, 1, ref.latent_height, ref.latent_width, cursor, patch_size)
            video_runs.append((row, row + rows))
            row += rows
            cursor += 1.0  # one integer rotary slot, not a latent frame's 5/3 units
        elif ref.kind == "audio":
            rows = audio_channels * ref.audio_latents
            _place_audio(pos, row, ref.audio_latents, cursor, target_width_axis, audio_channels)
            audio_runs.append((row, row + rows))
            row += rows
            cursor += float(ref.audio_latents)
        else:
            audio_rows = audio_channels * ref.audio_latents
            video_start = row + audio_rows
            width_axis = _place_video(pos, video_start, ref.latent_frames, ref.latent_height, ref.latent_width,
                                      cursor, patch_size)
            if audio_rows:
                _place_audio(pos, row, ref.audio_latents, cursor, width_axis, audio_channels)
                audio_runs.append((row, video_start))
            rows = ref.video_rows(patch_size)
            video_runs.append((video_start, video_start + rows))
            row = video_start + rows
            span = 0.0
            for s in latent_frame_spans(ref.latent_frames):  # sequential, not np.sum (pairwise): the reference's
                span += float(s)
            cursor += max(float(ref.audio_latents), span)

    audio_start = row
    video_start = audio_start + num_audio
    _place_audio(pos, audio_start, audio_latents, cursor, target_width_axis, audio_channels)
    _place_video(pos, video_start, latent_frames, latent_height, latent_width, cursor, patch_size)

    def runs(pairs):
        return [torch.arange(a, b) for a, b in pairs]

    video_indices = torch.cat(runs(video_runs) + [torch.arange(video_start, total)])
    audio_indices = torch.cat(runs(audio_runs) + [torch.arange(audio_start, video_start)])
    tags = torch.empty(total, dtype=torch.long)
    tags[:num_text] = text_tags.to(torch.long)
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return PackedLayout(
        position_ids=torch.from_numpy(pos),
        token_tags=tags,
        video_indices=video_indices,
        audio_indices=audio_indices,
        text_indices=torch.arange(num_text),
        num_condition_video_rows=ref_video_rows,
        num_condition_audio_rows=ref_audio_rows,
    )
