"""Draw the template browser's thumbnails (`<workflow>.jpg` next to each example workflow): a designed card per
workflow, readable at card size (a big title, what goes in and what comes out), instead of a screenshot of the graph.

    python example_workflows/make_thumbnails.py        # rewrites every .jpg here

Only Pillow is needed (its bundled font, so the cards come out the same on any machine).
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).resolve().parent
SIZE = (768, 432)
BACKGROUND = (24, 27, 36)
TEXT = (236, 238, 245)
MUTED = (150, 156, 175)

# workflow file -> (title, what goes in, what comes out, accent colour, footnote)
CARDS = {
    "H3 - Text to Video and Audio": ("Text to video + audio", ["prompt"], "tiny test model: checks an install"),
    "H3 - Turbo LoRA Text to Video": ("Turbo LoRA, few steps", ["prompt", "LoRA"], "9 steps with a turbo LoRA"),
    "H3 - First and Last Frame to Video": ("First + last frame", ["first frame", "last frame"],
                                           "keyframes fix both ends"),
    "H3 - References to Video": ("References to video", ["images", "videos", "audio"], "Ref2VA: up to 9 + 3 + 3"),
    "H3 - Text to Video on a Remote Server": ("Remote server", ["prompt", "SGLang / vLLM"],
                                              "runs on an H3 server's GPUs"),
    "H3 - Guides at Any Frame": ("Guides at any frame", ["image @ frame", "clip / audio"],
                                 "H3 Guide: chain one per frame"),
}
ACCENTS = {"H3 - Text to Video and Audio": (64, 156, 255), "H3 - Turbo LoRA Text to Video": (255, 170, 60),
           "H3 - First and Last Frame to Video": (120, 210, 120), "H3 - References to Video": (200, 130, 255),
           "H3 - Text to Video on a Remote Server": (80, 210, 210), "H3 - Guides at Any Frame": (240, 110, 150)}


def font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def card(name: str) -> Image.Image:
    title, inputs, note = CARDS[name]
    accent = ACCENTS[name]
    image = Image.new("RGB", SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, SIZE[0], 10], fill=accent)
    draw.text((40, 36), "H3 Stream", font=font(30), fill=accent)
    draw.text((40, 78), title, font=font(54), fill=TEXT)
    # what goes in -> H3 -> video + audio
    top, box_h = 190, 56
    step = box_h + 14
    for index, label in enumerate(inputs):
        y = top + index * step - (len(inputs) - 1) * step // 2 + step // 2
        draw.rounded_rectangle([40, y, 290, y + box_h], radius=12, outline=accent, width=3)
        draw.text((165, y + box_h // 2), label, font=font(28), fill=TEXT, anchor="mm")
        draw.line([290, y + box_h // 2, 360, top + step // 2 + box_h // 2], fill=MUTED, width=3)
    middle = top + step // 2 + box_h // 2
    draw.rounded_rectangle([360, middle - 44, 470, middle + 44], radius=16, fill=accent)
    draw.text((415, middle), "H3", font=font(44), fill=BACKGROUND, anchor="mm")
    draw.line([470, middle, 530, middle], fill=MUTED, width=3)
    # a film strip and a waveform for the output
    draw.rounded_rectangle([530, middle - 60, 728, middle - 4], radius=8, outline=TEXT, width=3)
    for x in range(546, 720, 30):
        draw.rectangle([x, middle - 52, x + 18, middle - 12], fill=accent)
    wave = [(530 + i * 6, middle + 32 + (14 if i % 4 == 1 else -14 if i % 4 == 3 else 0) * (1 + (i % 3)) // 2)
            for i in range(34)]
    draw.line(wave, fill=TEXT, width=3)
    draw.text((40, SIZE[1] - 56), note, font=font(28), fill=MUTED)
    return image


def main() -> None:
    for name in CARDS:
        if not (HERE / f"{name}.json").exists():
            raise SystemExit(f"{name}.json is missing: CARDS names a workflow that is not in {HERE}")
        card(name).save(HERE / f"{name}.jpg", quality=90)
        print(f"wrote {name}.jpg")


if __name__ == "__main__":
    main()
