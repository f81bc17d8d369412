"""Check guides at any frame against a real ComfyUI core's own code, in this process (no server; not run by the tests:
CI cannot fetch core).

    <ComfyUI venv>/bin/python -B tests/comfy_double/verify_guides_core.py <ComfyUI folder>

For each case, core's real nodes place the guides (`MiniMaxH3ImageToVideo` for first / last frames, then one
`MiniMaxH3AddGuide` per guide, chained, with stand-in VAEs whose latents have the real shapes), core's real
`PackedLayout` lays the rows out, and core's real `MiniMaxH3Model._forward` (a one-block model; its block is
replaced through core's own `patches_replace` hook, which hands over the block's arguments) gives the per-row
modality tags and timestep indices (`mod_segments`) and the rotary table. Ours: `GenerationRequest(guides=...)`
(`place_guides`), `build_packed_layout(guides=...)`, `row_timesteps`. Compared bitwise:

* which rows exist and in which order: core's `img_pos` / `audio_pos` (condition rows first) equal our `video_indices`
  / `audio_indices`, core's update masks our condition-row counts;
* positions: core's float64 `position_ids` equal ours, and core's fp32 rotary angles equal ours cast to fp32;
* modality tags and timestep indices per row, and the distinct timesteps themselves (float32);
* what core keeps of each guide: clip frames (17k + 5 crop), resolved frame, audio latents (cropped at the track's end);
* the guide frames fitted to the canvas: core's `_resize(..., "center")` equals our `prepare_guide_frames`;
* refusals: a frame outside the video and a clip past the end are refused by both.

Prints one line per check; exit status 1 if any fails.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

PACK = Path(__file__).resolve().parents[2]


def load_comfyui(folder: str):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from verify_core_latent import import_comfyui

    import_comfyui(folder)
    sys.path.insert(0, str(PACK))


class StandInVideoVAE:
    """Latents of the real shape: one frame -> one latent frame, 17k + 5 frames -> 5k + 2 (values irrelevant here)."""

    def encode(self, frames):
        import torch

        count = frames.shape[0]
        latent_t = 1 if count == 1 else (count - 5) // 17 * 5 + 2
        return torch.zeros(1, 24, latent_t, frames.shape[1] // 16, frames.shape[2] // 16)


class StandInAudioVAE:
    audio_sample_rate = 32000

    def encode(self, waveform):  # core passes [1, N, C]
        import torch

        return torch.zeros(1, 32, 2, math.ceil(waveform.shape[1] / 800))


class StandInClip:
    """core's text encoder stand-in: `tags` are the presentation's token tags (1 text, 0 vision rows)."""

    def __init__(self, tags):
        self.tags = tags

    def tokenize(self, prompt, images=()):
        return {"images": len(images)}

    def encode_from_tokens_scheduled(self, tokens):
        import torch

        return [[torch.zeros(1, self.tags.shape[0], 128), {"minimax_token_tags": self.tags}]]


def core_forward_capture(core_model_module, layout, text_tags, sigma):
    """Run core's real `_forward` on a one-block model until its block: returns core's (mod_segments, rotary angles,
    distinct timesteps)."""
    import torch
    import comfy.ops
    import comfy.nested_tensor  # noqa: F401

    model = core_model_module.MiniMaxH3Model(
        hidden_size=128, num_layers=1, token_refiner_num_layers=1, num_attention_heads=1, attention_head_dim=128,
        ffn_hidden_size=64, text_dim=128, time_embed_hidden_size=32, time_embed_dim=32,
        operations=comfy.ops.disable_weight_init, dtype=torch.float32)
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    model.rope.inv_freq = 10000.0 ** (-torch.arange(16, dtype=torch.float32) * 2 / 32)
    seen = {}
    model.time_embedder.register_forward_pre_hook(lambda module, args: seen.update(unique_t=args[0].clone()))

    def replaced_block(args, extra):
        seen["mod_segments"] = list(args["mod_segments"])
        seen["rope"] = args["rope_freqs"]
        return {"img": args["img"]}

    latent_t, lat_h, lat_w, audio_t = layout.signature[1:]
    video = torch.zeros(1, 24, latent_t, lat_h, lat_w)
    audio = torch.zeros(1, 32, 2, audio_t)
    context = torch.zeros(1, text_tags.shape[0], 128)
    options = {"patches_replace": {"dit": {("double_block", 0): replaced_block}}}
    payload = {"layout": layout, "text_token_tags": text_tags, "keyframes": layout._keyframes,
               "cond_video_latents": [kf["latent"] for kf in layout._keyframes if kf.get("latent") is not None],
               "cond_audio_latents": [kf["audio_latent"] for kf in layout._keyframes
                                      if kf.get("audio_latent") is not None]}
    model._forward([video, audio], torch.tensor([sigma * 1000.0]), context, options, minimax_payload=payload)
    return seen


def compare_positions(title, core_layout, ours, check, last_frame_rows=None):
    """Time axis bitwise in float64 (but `last_frame`'s rows: SGLang's anchor, bitwise in fp32); height / width
    bitwise in float64 where core's spatial grid (torch.arange) equals SGLang's (numpy.linspace, which ours and our
    target video rows follow), else in fp32, the precision the model uses."""
    import torch

    core, mine = core_layout.position_ids, ours.position_ids
    keep = torch.ones(core.shape[0], dtype=torch.bool)
    if last_frame_rows is not None:
        keep[last_frame_rows] = False
    time_ok = torch.equal(core[keep, 0], mine[keep, 0]) and torch.equal(core[:, 0].float(), mine[:, 0].float())
    detail = "" if last_frame_rows is None else ("last_frame rows in fp32 (float64 "
                                                 + ("equal" if torch.equal(core[:, 0], mine[:, 0]) else "1 ulp apart")
                                                 + ": SGLang's anchor)")
    check(f"{title}: time positions (float64)", time_ok, detail)
    exact = torch.equal(core[:, 1:], mine[:, 1:])
    check(f"{title}: height / width positions " + ("(float64)" if exact else "(fp32)"),
          exact or torch.equal(core[:, 1:].float(), mine[:, 1:].float()),
          "" if exact else "core's torch.arange grid is 1 float64 ulp from SGLang's numpy.linspace grid here, "
          "on the target video rows too")


def main() -> int:
    load_comfyui(sys.argv[1])
    import numpy as np
    import torch
    import comfy.ldm.minimax.model as core_model
    import comfy_extras.nodes_minimax_h3 as core_nodes

    from h3_core.errors import H3Error
    from h3_core.pipeline.layout import GuideBlock, build_packed_layout
    from h3_core.pipeline.sampler import row_timesteps
    from h3_core.request.generation_request import GenerationRequest
    from h3_core.request.guides import Guide, prepare_guide_frames

    g = torch.Generator().manual_seed(7)
    results = []

    def check(name, ok, detail=""):
        results.append(bool(ok))
        print(f"{'PASS' if ok else 'FAIL'}  {name}{(': ' + detail) if detail else ''}")

    def image(h=40, w=70, n=1):
        return torch.rand(n, h, w, 3, generator=g)

    def sound(frames):  # a soundtrack as long as `frames` video frames, at 32 kHz
        return (torch.rand(2, math.ceil(32000 / 24 * frames), generator=g) - 0.5) * 0.2

    width, height, num_frames = 320, 192, 124
    text_len = 9
    cases = [
        ("an image at frame 0", [dict(frame=0, frames=image())], {}),
        ("an image at the middle (frame 62)", [dict(frame=62, frames=image())], {}),
        ("an image at frame -1", [dict(frame=-1, frames=image())], {}),
        ("a 22-frame clip at frame 0", [dict(frame=0, frames=image(n=22))], {}),
        ("a 30-frame clip at 10 (cropped to 22)", [dict(frame=10, frames=image(n=30))], {}),
        ("audio alone at frame 50", [dict(frame=50, audio=sound(30))], {}),
        ("a clip with its soundtrack at frame 40", [dict(frame=40, frames=image(n=22), audio=sound(22))], {}),
        ("a clip with its soundtrack ending at the last frame",
         [dict(frame=num_frames - 22, frames=image(n=22), audio=sound(22))], {}),
        ("three guides: clip+soundtrack at 0, image at 60, audio at -30",
         [dict(frame=0, frames=image(n=22), audio=sound(22)), dict(frame=60, frames=image()),
          dict(frame=-30, audio=sound(20))], {}),
        ("first frame + last frame + an image guide at 50", [dict(frame=50, frames=image())],
         {"first": image(), "last": image()}),
    ]
    for title, guides, keyframes in cases:
        guides_ours = tuple(Guide(label=f"guide {i + 1}", **spec) for i, spec in enumerate(guides))
        request = GenerationRequest("p", width=width, height=height, num_frames=num_frames,
                                    first_frame=keyframes.get("first"), last_frame=keyframes.get("last"),
                                    guides=guides_ours)
        shape = request.shape
        tags = torch.ones(text_len, dtype=torch.long)
        if keyframes:
            tags[2:5] = 0  # a vision block's rows in the presentation
        # core: its nodes place the guides, its PackedLayout lays them out.
        latent, _ = core_nodes._empty_av_latent(width, height, num_frames)
        if keyframes:
            positive, latent2 = core_nodes.MiniMaxH3ImageToVideo.execute(
                StandInClip(tags), StandInVideoVAE(), "p", width, height, num_frames,
                first_frame=keyframes.get("first"), last_frame=keyframes.get("last")).args
        else:
            positive = [[torch.zeros(1, text_len, 128), {"minimax_token_tags": tags}]]
        for spec in guides:
            audio = None if spec.get("audio") is None else {"waveform": spec["audio"][None], "sample_rate": 32000}
            positive = core_nodes.MiniMaxH3AddGuide.execute(
                positive, latent, spec["frame"], vae=StandInVideoVAE(), audio_vae=StandInAudioVAE(),
                image=spec.get("frames"), audio=audio).args[0]
        core_keyframes = positive[0][1]["minimax_keyframes"]
        core_layout = core_model.PackedLayout(text_len, shape.latent_frames, shape.latent_height, shape.latent_width,
                                              shape.audio_latents, keyframes=core_keyframes)
        core_layout._keyframes = core_keyframes
        core_guides = core_keyframes[len(request.anchors):]
        # ours
        placed = request.placed_guides
        blocks = [GuideBlock(p.frame, 0 if not p.num_frames else (1 if p.num_frames == 1 else
                                                                  (p.num_frames - 5) // 17 * 5 + 2),
                             p.audio_latents) for p in placed]
        ours = build_packed_layout(tags, shape.latent_frames, shape.latent_height, shape.latent_width,
                                   shape.audio_latents, request.anchors, guides=blocks)
        kept = [(p.frame, p.num_frames and (1 if p.num_frames == 1 else (p.num_frames - 5) // 17 * 5 + 2),
                 p.audio_latents) for p in placed]
        core_kept = [(kf["resolved_frame_index"], kf["latent"].shape[2] if "latent" in kf else 0,
                      kf["audio_latent"].shape[-1] if "audio_latent" in kf else 0) for kf in core_guides]
        check(f"{title}: frame, latent frames, audio latents kept", kept == core_kept, f"{kept}")
        same_rows = (torch.equal(core_layout.img_pos, ours.video_indices)
                     and torch.equal(core_layout.audio_pos, ours.audio_indices)
                     and core_layout.seq_len == ours.num_rows
                     and int((~core_layout.img_update).sum()) == ours.num_condition_video_rows
                     and int((~core_layout.audio_update).sum()) == ours.num_condition_audio_rows)
        check(f"{title}: rows and their order", same_rows, f"{ours.num_rows} rows")
        compare_positions(title, core_layout, ours, check,
                          last_frame_rows=ours.video_indices[shape.latent_height * shape.latent_width // 4:][
                              :shape.latent_height * shape.latent_width // 4] if "last" in request.anchors else None)
        for sigma in (0.7, 0.0005):
            seen = core_forward_capture(core_model, core_layout, tags, sigma)
            core_row = torch.empty(core_layout.seq_len, dtype=torch.long)
            for a, b, value in seen["mod_segments"]:
                core_row[a:b] = value
            # the sampler's inputs, derived from sigma as core does
            sigma_v = torch.tensor(sigma, dtype=torch.float32).clamp(min=1e-6)
            t_v = float(1.0 - sigma_v)
            t_a = float(1.0 - core_model.time_shift_sigma(sigma_v, 12.0, 3.0))
            unique, index = row_timesteps(ours, t_v, t_a)
            ok = (torch.equal(core_row // 3, index) and torch.equal(core_row % 3, ours.token_tags)
                  and torch.equal(seen["unique_t"], unique))
            check(f"{title}: tags and timestep indices at sigma {sigma}", ok, f"timesteps {unique.tolist()}")
        ours_rope = ours.model_kwargs()["position_ids"]
        core_angles = core_model.MiniMaxH3Model.rope_freqs(
            type("M", (), {"rope": type("R", (), {"inv_freq": 10000.0 ** (-torch.arange(16, dtype=torch.float32)
                                                                         * 2 / 32)})()})(),
            core_layout.position_ids, "cpu")
        inv = 10000.0 ** (-torch.arange(16, dtype=torch.float32) * 2 / 32)
        per_axis = ours_rope.unsqueeze(-1) * inv.view(1, 1, -1)
        half = torch.cat(per_axis.unbind(dim=1), dim=-1)
        check(f"{title}: fp32 rotary angles", torch.equal(core_angles, torch.cat((half, half), dim=-1)))
        for spec, p in zip(guides, placed):
            if spec.get("frames") is not None:
                core_frames = core_nodes._resize(spec["frames"][:p.num_frames], width, height, "center")
                check(f"{title}: {p.label}'s frames fitted to the canvas", torch.equal(
                    core_frames, prepare_guide_frames(p.frames, width, height)))

    # The released canvas, one case.
    request = GenerationRequest("p", width=1344, height=768, num_frames=124,
                                guides=(Guide(frame=-1, frames=image()), Guide(frame=40, audio=sound(22))))
    shape = request.shape
    latent, _ = core_nodes._empty_av_latent(1344, 768, 124)
    positive = [[torch.zeros(1, 256, 128), {}]]
    for guide in request.guides:
        audio = None if guide.audio is None else {"waveform": guide.audio[None], "sample_rate": 32000}
        positive = core_nodes.MiniMaxH3AddGuide.execute(positive, latent, guide.frame, vae=StandInVideoVAE(),
                                                        audio_vae=StandInAudioVAE(), image=guide.frames,
                                                        audio=audio).args[0]
    core_layout = core_model.PackedLayout(256, shape.latent_frames, shape.latent_height, shape.latent_width,
                                          shape.audio_latents, keyframes=positive[0][1]["minimax_keyframes"])
    ours = build_packed_layout(torch.ones(256, dtype=torch.long), shape.latent_frames, shape.latent_height,
                               shape.latent_width, shape.audio_latents,
                               guides=[GuideBlock(p.frame, 1 if p.num_frames else 0, p.audio_latents)
                                       for p in request.placed_guides])
    check("1344x768, 124 frames: image at -1 + audio at 40: rows", torch.equal(core_layout.img_pos, ours.video_indices)
          and torch.equal(core_layout.audio_pos, ours.audio_indices))
    compare_positions("1344x768, 124 frames: image at -1 + audio at 40", core_layout, ours, check)

    # A soundtrack one latent longer than the rest of the track (22 frames ending at the last of 107): core crops it.
    spec = dict(frame=85, frames=image(n=22), audio=sound(22))
    request = GenerationRequest("p", width=width, height=height, num_frames=107, guides=(Guide(**spec),))
    latent, _ = core_nodes._empty_av_latent(width, height, 107)
    positive = core_nodes.MiniMaxH3AddGuide.execute(
        [[torch.zeros(1, 3, 128), {}]], latent, 85, vae=StandInVideoVAE(), audio_vae=StandInAudioVAE(),
        image=spec["frames"], audio={"waveform": spec["audio"][None], "sample_rate": 32000}).args[0]
    core_latents = positive[0][1]["minimax_keyframes"][0]["audio_latent"].shape[-1]
    check("a soundtrack 1 latent past the track's end is cropped as core crops it",
          request.placed_guides[0].audio_latents == core_latents, f"{core_latents} latents")

    # Refusals: both refuse a frame outside the video and a clip past its end.
    for title, spec in (("a frame outside the video", dict(frame=124, frames=image())),
                        ("a clip past the end", dict(frame=110, frames=image(n=22)))):
        latent, _ = core_nodes._empty_av_latent(width, height, num_frames)
        try:
            core_nodes.MiniMaxH3AddGuide.execute([[torch.zeros(1, 3, 128), {}]], latent, spec["frame"],
                                                 vae=StandInVideoVAE(), image=spec["frames"])
            core_refused = False
        except ValueError:
            core_refused = True
        try:
            GenerationRequest("p", width=width, height=height, num_frames=num_frames, guides=(Guide(**spec),))
            ours_refused = ""
        except H3Error as exc:
            ours_refused = str(exc)
        check(f"refused by both: {title}", core_refused and ours_refused, ours_refused)

    # Not compared, said: our last_frame keeps SGLang's anchor (pairwise span sum), core's last frame is
    # L + 5/3 (F - 1); the two differ in the last float64 ulp for some lengths (not in fp32 here).
    diffs = []
    for frames in range(5, 363, 17):
        request = GenerationRequest("p", width=width, height=height, num_frames=frames, last_frame=image())
        shape = request.shape
        ours = build_packed_layout(torch.ones(256, dtype=torch.long), shape.latent_frames, shape.latent_height,
                                   shape.latent_width, shape.audio_latents, ("last",))
        core_t = 256.0 + core_model.FRAME_RESCALE * (frames - 1)
        if float(ours.position_ids[256, 0]) != core_t:
            diffs.append((frames, np.float32(ours.position_ids[256, 0]) == np.float32(core_t)))
    print(f"note: last_frame (SGLang's anchor) differs from core's last-frame time in float64 (by at most 2 ulps) for "
          f"{len(diffs)} of 22 lengths; equal in fp32 for {sum(d[1] for d in diffs)} of them")
    print(f"{sum(results)} of {len(results)} checks pass")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
