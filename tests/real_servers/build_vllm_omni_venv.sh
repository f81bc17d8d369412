#!/usr/bin/env bash
# Builds the venv that runs vLLM-Omni 0.30.0's own OpenAI server (on vllm 0.30.0) for the conformance tests
# (tests/test_remote_vllm_omni.py), from the package registry, outside the repository (about 3 GB, a few minutes):
#   bash tests/real_servers/build_vllm_omni_venv.sh [DEST]   (default ~/.cache/h3-stream/vllm-omni-0.30.0)
# It also needs ffprobe on PATH (H3's reference checks probe with it): on Debian, apt-get install ffmpeg.
# Why the workarounds:
# - vllm and vllm-omni go in with --no-deps: their full dependency sets pull CUDA wheels (flashinfer, cutlass-dsl,
#   nvidia-*, ...; about 6 GB). Only what the HTTP and import paths need is installed; torch 2.13.0 (the CPU wheel,
#   the version vllm 0.30.0 pins) is kept by a constraint.
# - PyPI's torchvision and torchaudio link CUDA libraries. torchvision: the server script defines the two operator
#   schemas before importing vllm. torchaudio: its C extensions are deleted here, so it imports as pure Python
#   (vLLM-Omni's audio mixin imports it at module level; nothing on the video path calls its C ops).
# - vllm's argument parser needs a platform: the server script calls vLLM-Omni's own _ensure_vllm_platform() first.
# A second run with the venv in place does nothing.
set -euo pipefail
DEST=${1:-${H3_STREAM_VLLM_OMNI_VENV:-$HOME/.cache/h3-stream/vllm-omni-0.30.0}}
CHECK="import importlib.util, fastapi, uvicorn, av, multipart; assert importlib.util.find_spec('vllm_omni') and importlib.util.find_spec('vllm')"
if [ -x "$DEST/bin/python" ] && "$DEST/bin/python" -c "$CHECK" 2>/dev/null; then
    echo "vllm-omni venv already built: $DEST"
    exit 0
fi
python3 -m venv "$DEST"
echo torch==2.13.0 > "$DEST/constraints.txt"
PIP="$DEST/bin/pip install --quiet --disable-pip-version-check"
$PIP --no-deps vllm-omni==0.30.0 vllm==0.30.0 torchvision==0.28.0 torchaudio==2.11.0 xgrammar==0.2.9 cache-dit==1.5.0
$PIP -c "$DEST/constraints.txt" torch==2.13.0 'fastapi[standard]>=0.133,<0.137' 'starlette>=1.0.1' uvicorn \
    'pydantic>=2.12' pydantic-settings pillow numpy pybase64 msgspec pyzmq psutil httpx orjson python-multipart \
    requests tqdm aiohttp pyyaml einops regex cachetools sentencepiece blake3 py-cpuinfo 'transformers>=5.13,<5.15' \
    'huggingface_hub>=1.31' tokenizers safetensors protobuf 'openai>=2.25' prometheus_client \
    prometheus-fastapi-instrumentator cloudpickle partial-json-parser msgpack janus omegaconf av soundfile scipy \
    python-json-logger setproctitle cbor2 ijson watchfiles aenum==3.1.16 prettytable soxr diffusers==0.40.0 \
    accelerate==1.12.0 gguf imageio imageio-ffmpeg openai-harmony 'llguidance>=1.7,<1.8' tiktoken loguru \
    model_hosting_container_standards 'mistral_common[image]' apache-tvm-ffi==0.1.11 jsonschema
rm -f "$DEST"/lib/python3*/site-packages/torchaudio/lib/*.so
"$DEST/bin/python" -c "$CHECK"
echo "vllm-omni venv ready: $DEST"
