"""Run every API-format example workflow on a real ComfyUI server and check the saved files (not run by the tests).

    python verify_server.py http://127.0.0.1:8188 <ComfyUI>/output

Checks: `/object_info` lists the pack's node ids; each prompt in example_workflows/api/ (and the core-latent round trip
of `core_latent_prompt`) is accepted by `POST /prompt`, finishes with status success, and its SaveVideo / SaveAudio
outputs exist as non-empty files in the output folder.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

PACK = Path(__file__).resolve().parents[2]
NODE_IDS = ["H3StreamLoader", "H3StreamTextEncode", "H3StreamSampler", "H3StreamDecodeVideo", "H3StreamDecodeAudio",
            "H3StreamMemoryReport", "H3StreamUnload", "H3StreamLoRA", "H3StreamLatentToCore",
            "H3StreamLatentFromCore"]


def call(url: str, data: dict | None = None) -> dict:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        raise SystemExit(f"{url}: HTTP {error.code}: {error.read().decode()[:2000]}") from None


def saved_files(outputs: dict) -> list[dict]:
    files = []
    for node_output in outputs.values():
        for key in ("images", "audio", "video", "gifs"):
            files.extend(item for item in node_output.get(key, []) if isinstance(item, dict) and "filename" in item)
    return files


def core_latent_prompt() -> dict:
    """The tiny T2VA example with its latent sent through core's nodes between sampler and decoders: H3 Latent to
    Core -> Separate AV Latent -> Concat AV Latent -> H3 Latent from Core."""
    prompt = json.loads((PACK / "example_workflows" / "api" / "h3_stream_t2va_tiny.json").read_text())
    sampler = next(node for node, spec in prompt.items() if spec["class_type"] == "H3StreamSampler")
    prompt.update({
        "90": {"class_type": "H3StreamLatentToCore", "inputs": {"h3_latent": [sampler, 0]}},
        "91": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["90", 0]}},
        "92": {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["91", 0], "audio_latent": ["91", 1]}},
        "93": {"class_type": "H3StreamLatentFromCore", "inputs": {"latent": ["92", 0]}},
    })
    for spec in prompt.values():
        if spec["class_type"] in ("H3StreamDecodeVideo", "H3StreamDecodeAudio"):
            spec["inputs"]["h3_latent"] = ["93", 0]
        if spec["class_type"] in ("SaveVideo", "SaveAudio"):
            spec["inputs"]["filename_prefix"] = "h3_stream/core_latent_round_trip"
    return prompt


def prompts() -> list[tuple[str, dict]]:
    examples = [(path.name, json.loads(path.read_text()))
                for path in sorted((PACK / "example_workflows" / "api").glob("*.json"))]
    return examples + [("core latent round trip", core_latent_prompt())]


def main() -> int:
    server, output_dir = sys.argv[1].rstrip("/"), Path(sys.argv[2])
    info = call(f"{server}/object_info")
    missing = [node for node in NODE_IDS if node not in info]
    print(f"/object_info: {len(info)} nodes; pack nodes missing: {missing or 'none'}")
    failures = len(missing)
    for name, prompt in prompts():
        started = time.time()
        queued = call(f"{server}/prompt", {"prompt": prompt, "client_id": str(uuid.uuid4())})
        prompt_id = queued["prompt_id"]
        while True:
            history = call(f"{server}/history/{prompt_id}").get(prompt_id)
            if history and history.get("status", {}).get("completed") is not None and \
                    history["status"].get("status_str") in ("success", "error"):
                break
            time.sleep(1)
        status = history["status"]["status_str"]
        files = saved_files(history["outputs"])
        present = [f for f in files if (output_dir / f.get("subfolder", "") / f["filename"]).is_file()
                   and (output_dir / f.get("subfolder", "") / f["filename"]).stat().st_size > 0]
        kinds = sorted({Path(f["filename"]).suffix for f in present})
        ok = status == "success" and len(present) == len(files) and {".mp4", ".flac"} <= set(kinds)
        failures += not ok
        names = [str(Path(f.get("subfolder", "")) / f["filename"]) for f in present]
        print(f"{name}: {status} in {time.time() - started:.1f} s; saved {names}{'' if ok else '  <-- FAILED'}")
        if status != "success":
            print(json.dumps(history["status"].get("messages", [])[-1:], indent=1)[:3000])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
