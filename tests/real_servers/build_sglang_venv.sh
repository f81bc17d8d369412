#!/usr/bin/env bash
# Builds the venv that runs SGLang 0.5.23's own diffusion HTTP server for the conformance tests
# (tests/test_remote_sglang.py), from the package registry, outside the repository:
#   bash tests/real_servers/build_sglang_venv.sh [DEST]     (default ~/.cache/h3-stream/sglang-0.5.23)
# It also needs ffprobe on PATH (SGLang probes reference media with it): on Debian, apt-get install ffmpeg. boto3 and
# moto's S3 server are there for SGLang's cloud storage of results (SGLANG_CLOUD_STORAGE_TYPE=s3).
# Why the workarounds: sglang pins a newer torch than the CPU wheel of these machines, so torch 2.13.0 is kept by a
# constraint and sglang is installed without its dependencies, then with what its HTTP entrypoints import. PyPI's
# torchvision links CUDA, so its C ops do not load: the server script defines their two schemas before importing
# sglang (nothing on the HTTP path calls them). pip's resolver lists sglang's GPU dependencies as missing: expected.
# A second run with the venv in place does nothing.
set -euo pipefail
DEST=${1:-${H3_STREAM_SGLANG_VENV:-$HOME/.cache/h3-stream/sglang-0.5.23}}
if [ -x "$DEST/bin/python" ] && "$DEST/bin/python" -c "import importlib.util, fastapi, uvicorn, av, zmq, boto3, moto; assert importlib.util.find_spec('sglang')" 2>/dev/null; then
    echo "sglang venv already built: $DEST"
    exit 0
fi
python3 -m venv "$DEST"
echo torch==2.13.0 > "$DEST/constraints.txt"
PIP="$DEST/bin/pip install --quiet --disable-pip-version-check"
$PIP --no-deps sglang==0.5.23
$PIP -c "$DEST/constraints.txt" torch==2.13.0 fastapi 'uvicorn>=0.51' pydantic numpy pillow msgspec pyzmq psutil \
    httpx orjson python-multipart pybase64 requests triton packaging tqdm IPython aiohttp pyyaml einops \
    apache-tvm-ffi==0.1.11 transformers dill sentencepiece compressed_tensors gguf imageio diffusers addict \
    imageio_ffmpeg cache_dit python-dateutil openai partial_json_parser av boto3 'moto[server]'
$PIP --no-deps torchvision==0.28.0
"$DEST/bin/python" -c "import importlib.util, fastapi, uvicorn, av, zmq, boto3, moto; assert importlib.util.find_spec('sglang')"
echo "sglang venv ready: $DEST"
