"""The networks of H3, one file each with its config beside it: the DiT, the Qwen3-VL text encoder and its vision
tower, the video and audio VAEs, and the tokenizer. Each has one forward (`chunk_size=None` is the fused path of
the same code). Imports only `h3_core.errors` and `h3_core.runtime` (where weights live, how rows are chunked)."""
