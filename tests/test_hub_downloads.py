"""Hugging Face downloads against a loopback server standing in for the Hub (never the internet): only the needed
files, retries of transient failures, no retry of 401/403/404, the disk check before any byte, resume with a Range
request, progress, offline mode."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from loopback_hub import COMMIT, LoopbackHub, Repo  # noqa: E402

from h3_core.errors import CheckpointError  # noqa: E402
from h3_core.sources import hub as hub_module
from h3_core.sources.hub import RetryPolicy, download_partition

REPO = "owner/h3"
SHARD_1 = "text_encoder/model-00001-of-00002.safetensors"
SHARD_2 = "text_encoder/model-00002-of-00002.safetensors"
# What an fl2va request reads from the repo below, and nothing else.
FL2VA_FILES = ["model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
               "text_encoder/config.json", "text_encoder/model.safetensors.index.json", SHARD_1,
               "tokenizer/tokenizer.json", "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
               "audio_vae/config.json", "audio_vae/diffusion_pytorch_model.safetensors"]


@pytest.fixture(scope="module")
def text_encoder_shards(tiny, tmp_path_factory):
    """The tiny text encoder (2 layers, all H3 reads with layer=2) split the way the Qwen3-VL release is: shard 1
    holds what H3 reads, shard 2 only layers at or above the one used, the final norm and the LM head."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tiny / "text_encoders" / "qwen3vl_tiny_minimax_h3"
    state = load_file(str(folder / "model.safetensors"))
    upper = {k.replace("layers.1.", f"layers.{n}."): v.clone() for n in (2, 3) for k, v in state.items()
             if k.startswith("model.language_model.layers.1.")}
    hidden = state["model.language_model.embed_tokens.weight"].shape[1]
    upper["model.language_model.norm.weight"] = torch.ones(hidden)
    upper["lm_head.weight"] = torch.zeros(4, hidden)
    out = {}
    scratch = tmp_path_factory.mktemp("shards")  # never beside the shared tiny model
    for name, tensors in ((SHARD_1, state), (SHARD_2, upper)):
        path = scratch / Path(name).name
        save_file(tensors, str(path))
        out[name] = path.read_bytes()
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 4  # the release holds more layers than H3 reads
    index = {"metadata": {}, "weight_map": {**{k: Path(SHARD_1).name for k in state},
                                            **{k: Path(SHARD_2).name for k in upper}}}
    out["text_encoder/config.json"] = json.dumps(config).encode()
    out["text_encoder/model.safetensors.index.json"] = json.dumps(index).encode()
    out["tokenizer/tokenizer.json"] = (folder / "tokenizer.json").read_bytes()
    return out


def official_repo(text_encoder_shards) -> dict[str, bytes]:
    files = dict(text_encoder_shards)
    files["model_index.json"] = json.dumps({"_class_name": "MiniMaxH3Pipeline",
                                            "_minimax_h3": {"text_encoder_layer": 2}}).encode()
    for folder, size in (("transformer", 3000), ("transformer_ref", 3000), ("vae", 500), ("audio_vae", 400)):
        # Distinct bytes per file: the cache is content-addressed, equal files would be fetched once.
        files[f"{folder}/config.json"] = json.dumps({"folder": folder}).encode()
        files[f"{folder}/diffusion_pytorch_model.safetensors"] = folder.encode() + bytes(range(256)) * (size // 256)
    files.update({"README.md": b"# H3", ".gitattributes": b"*.safetensors filter=lfs",
                  "text_encoder/pytorch_model.bin": b"pickle", "assets/demo.mp4": b"video"})
    return files


@pytest.fixture
def hub(monkeypatch, text_encoder_shards):
    from huggingface_hub import constants

    with LoopbackHub({REPO: Repo(official_repo(text_encoder_shards))}) as server:
        # huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, at import; h3_core reads HF_ENDPOINT when it
        # runs and passes it as `endpoint=` to every call (patching constants.ENDPOINT alone would leave its URL
        # template on huggingface.co).
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        # A retry nobody injected must not make a test sleep: it fails the test instead.
        monkeypatch.setattr(hub_module, "DEFAULT_RETRY", RetryPolicy(sleep=lambda s: pytest.fail(f"slept {s} s")))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/token")
        yield server


def file_gets(server) -> list[str]:
    return [path for path in server.requested("GET") if path != "api"]


def download(tmp_path, partition="fl2va", sleeps=None, **options):
    options.setdefault("retry", RetryPolicy(sleep=(sleeps if sleeps is not None else []).append))
    return download_partition(REPO, partition, False, tmp_path / "cache", log=lambda t: None, **options)


def test_only_the_needed_files_are_fetched_and_the_text_encoder_loads(hub, tmp_path):
    from h3_core.checkpoints.text_encoder_loader import resolve_text_encoder_checkpoint
    from h3_core.sources import resolve_model

    sources = resolve_model(REPO, partition="fl2va", cache_dir=tmp_path / "cache")
    assert sorted(file_gets(hub)) == sorted(FL2VA_FILES)
    assert SHARD_2 not in hub.requested() and "transformer_ref/diffusion_pytorch_model.safetensors" not in \
        hub.requested()
    # The index is read before any shard.
    gets = file_gets(hub)
    assert gets.index("text_encoder/model.safetensors.index.json") < gets.index(SHARD_1)
    assert sources.root == tmp_path / "cache" / "models--owner--h3" / "snapshots" / COMMIT
    assert sources.text_encoder_layer == 2
    # The loader accepts the folder without shard 2: it holds nothing read up to layer 2.
    ckpt = resolve_text_encoder_checkpoint(sources.text_encoder, sources.text_encoder_layer)
    assert ckpt.config.language.num_hidden_layers == 4
    assert (sources.transformer / "diffusion_pytorch_model.safetensors").read_bytes() == \
        hub.repos[REPO].files["transformer/diffusion_pytorch_model.safetensors"]


def test_ref2va_fetches_its_own_transformer_only(hub, tmp_path):
    download(tmp_path, "ref2va")
    assert sorted(file_gets(hub)) == sorted(
        f.replace("transformer/", "transformer_ref/") for f in FL2VA_FILES)


def test_a_release_layout_fetches_only_its_partition_folder(hub, tmp_path):
    hub.repos["owner/release"] = Repo({"README.md": b"x", "FL2VA/model_index.json": b"{}",
                                       "FL2VA/transformer/model.safetensors": b"f" * 10,
                                       "Ref2VA/model_index.json": b"{}", "Ref2VA/transformer/model.safetensors": b"r",
                                       "Ref2VA/video_vae/model.safetensors": b"v", "Ref2VA/weights.pt": b"p"})
    download_partition("owner/release", "ref2va", False, tmp_path / "cache", retry=RetryPolicy(sleep=lambda s: None))
    assert sorted(file_gets(hub)) == ["Ref2VA/model_index.json", "Ref2VA/transformer/model.safetensors",
                                      "Ref2VA/video_vae/model.safetensors"]


def test_resets_and_a_503_are_retried_with_backoff_until_the_download_completes(hub, tmp_path):
    name = "transformer/diffusion_pytorch_model.safetensors"
    hub.fail("GET", name, "reset", "reset", 503)
    sleeps = []
    folder = download(tmp_path, sleeps=sleeps)
    assert (folder / name).read_bytes() == hub.repos[REPO].files[name]
    assert file_gets(hub).count(name) == 4
    assert sleeps == [1.0, 2.0, 4.0]


def test_the_backoff_is_capped_and_gives_up_with_one_message(hub, tmp_path):
    name = "vae/diffusion_pytorch_model.safetensors"
    hub.fail("GET", name, *[503] * 4)
    sleeps = []
    with pytest.raises(CheckpointError) as caught:
        download_partition(REPO, "fl2va", False, tmp_path / "cache", log=lambda t: None,
                           retry=RetryPolicy(attempts=4, first_delay_s=1.0, max_delay_s=2.5, sleep=sleeps.append))
    assert str(caught.value) == (
        f"{REPO}: {name} still failed after 4 attempts (HTTP 503). Check the network (or the Hub's status) and run "
        "again: finished files are kept and a partial file continues where it stopped.")
    assert sleeps == [1.0, 2.0, 2.5]
    assert file_gets(hub).count(name) == 4


def test_a_closed_client_is_retried_with_a_new_one(hub, tmp_path):
    from huggingface_hub.utils import get_session

    get_session().close()  # what another thread's cleanup does under a running download
    sleeps = []
    folder = download(tmp_path, sleeps=sleeps)
    assert sleeps == [1.0]
    assert (folder / SHARD_1).is_file()


def test_a_missing_repo_fails_at_once(hub, tmp_path):
    sleeps = []
    with pytest.raises(CheckpointError) as caught:
        download_partition("owner/nothing", "fl2va", False, tmp_path / "cache",
                           retry=RetryPolicy(sleep=sleeps.append))
    assert str(caught.value) == ("owner/nothing: no such model repo on Hugging Face, or it is private (404). Check "
                                 "the repo id; for a private repo set HF_TOKEN to a token that can read it.")
    assert hub.requested() == ["api"] and sleeps == []


def test_a_missing_file_fails_at_once_without_retries(hub, tmp_path):
    name = "audio_vae/diffusion_pytorch_model.safetensors"
    hub.fail("GET", name, 404)
    sleeps = []
    with pytest.raises(CheckpointError) as caught:
        download(tmp_path, sleeps=sleeps)
    assert str(caught.value) == (f"{REPO}: {name} does not exist in the repo (404), or the repo is private; check "
                                 "the repo id.")
    assert file_gets(hub).count(name) == 1 and sleeps == []


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_fails_at_once_and_never_shows_the_token(hub, tmp_path, monkeypatch, status):
    secret = "hf_loopbackSecretToken123"
    monkeypatch.setenv("HF_TOKEN", secret)
    hub.repos[REPO].status = status
    sleeps = []
    with pytest.raises(CheckpointError) as caught:
        download(tmp_path, sleeps=sleeps)
    assert str(caught.value) == (
        f"{REPO}: Hugging Face refused access to the file list ({status}): the repo needs a token. Set HF_TOKEN to a "
        "token with read access (and accept the model's conditions on its page if it is gated).")
    assert secret not in str(caught.value)
    assert hub.requested() == ["api"] and sleeps == []
    assert hub.requests[0].authorization == f"Bearer {secret}"  # the token was sent, only to the hub


def test_a_disk_shortage_is_refused_before_the_first_byte(hub, tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(hub_module.shutil, "disk_usage",
                        lambda path: usage._replace(free=1000))
    with pytest.raises(CheckpointError) as caught:
        download_partition(REPO, "fl2va", False, tmp_path / "cache")
    needed = sum(len(b) for n, b in hub.repos[REPO].files.items() if n in FL2VA_FILES and not n.startswith(
        "text_encoder/model-"))
    assert str(caught.value) == (
        f"{REPO}: the download needs {needed / 2**30:.2f} GiB ({len(FL2VA_FILES) - 1} files) but only 0.00 GiB is "
        f"free in {tmp_path / 'cache'}. Free some space, or set HF_HUB_CACHE (cache_dir) to a disk with room.")
    assert hub.requested() == ["api"]  # the file list only: not one file requested
    assert not (tmp_path / "cache").exists()


def test_a_shortage_found_in_the_text_encoder_index_fetches_no_weights(hub, tmp_path):
    files = hub.repos[REPO].files
    planning = ("model_index.json", "text_encoder/model.safetensors.index.json")
    # Room for all but one byte of what is left once the two JSON files that plan the download are read: the
    # first check (without the shards) passes, the one after reading the index refuses.
    after_index = sum(len(files[n]) for n in FL2VA_FILES if n not in planning)
    with pytest.raises(CheckpointError, match=r"the download needs .* \(9 files\)"):
        download(tmp_path, free_bytes=lambda folder: after_index - 1)
    assert file_gets(hub) == ["model_index.json", "text_encoder/model.safetensors.index.json"]


def test_an_interrupted_download_resumes_with_a_range_request_in_the_next_run(hub, tmp_path):
    name = SHARD_1
    data = hub.repos[REPO].files[name]
    hub.fail("GET", name, f"cut:{len(data) // 3}")
    with pytest.raises(CheckpointError, match="still failed after 1 attempts"):
        download(tmp_path, retry=RetryPolicy(attempts=1))
    folder = download(tmp_path)
    assert (folder / name).read_bytes() == data
    ranges = [r.range for r in hub.requests if r.method == "GET" and r.path == name]
    assert ranges == [None, f"bytes={len(data) // 3}-"]
    assert hub.bytes_served[name] == len(data)  # every byte sent once


def test_progress_reports_the_bytes_still_to_fetch(hub, tmp_path):
    calls = []
    download(tmp_path, progress=lambda done, total: calls.append((done, total)))
    files = hub.repos[REPO].files
    # The two JSON files read to plan the download come before it and are not in the total.
    total = sum(len(files[n]) for n in FL2VA_FILES if n not in ("model_index.json",
                                                                 "text_encoder/model.safetensors.index.json"))
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_a_second_run_fetches_nothing_and_offline_mode_uses_the_cache(hub, tmp_path, monkeypatch):
    first = download(tmp_path)
    before = len(hub.requests)
    assert download(tmp_path) == first
    assert [r.path for r in hub.requests[before:] if r.method == "GET"] == ["api"]  # the file list, no file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests)
    assert download_partition(REPO, "fl2va", None, tmp_path / "cache") == first
    assert len(hub.requests) == before  # no request at all


def test_offline_without_a_cached_copy_says_so(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"^owner/h3: Offline mode is on \(HF_HUB_OFFLINE\) and the model is "
                                              r"not in the local cache"):
        download_partition(REPO, "fl2va", None, tmp_path / "cache")
    assert hub.requests == []


def test_the_cli_shows_a_download_bar(hub, tmp_path, monkeypatch, capfd):
    from huggingface_hub import constants

    from h3_core.app import cli

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    code = cli.main(["generate", "x", "--model", REPO, "--out", str(tmp_path / "o.mp4")])
    err = capfd.readouterr().err
    assert "downloading [##############################]" in err
    assert sorted(file_gets(hub)) == sorted(FL2VA_FILES)
    assert code == 2  # the stand-in transformer is not a model; the CLI says so after the download


def test_the_loader_node_shows_comfyui_progress_and_text(hub, tmp_path, monkeypatch):
    import comfy_double
    from huggingface_hub import constants

    comfy_double.install(tmp_path / "comfyui")
    pack = comfy_double.load_pack()
    import comfy.utils
    from comfy_double.executor import run_node
    from server import PromptServer

    from h3_core.errors import CheckpointError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    # The stand-in hub serves placeholder files, not a model: once downloaded, the pipeline's header check (run when
    # the loader builds it) refuses them. The download and its progress come first.
    with pytest.raises(CheckpointError, match="not an H3 transformer"):
        run_node(pack["H3StreamLoader"], "7", source="Hugging Face repo", repo_id=REPO, partition="FL2VA",
                 transformer_residency="LAYERWISE_OFFLOAD", text_encoder_residency="LAYERWISE_OFFLOAD",
                 video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT", prefetch=-1, resident_blocks=0,
                 chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu")
    assert sorted(file_gets(hub)) == sorted(FL2VA_FILES)
    updates = [u for u in comfy.utils.UPDATES if u[0] == "7"]
    assert updates and updates[-1][1] == updates[-1][2]  # ComfyUI's bar on the loader ends full
    texts = [data["text"] for event, data, _ in PromptServer.instance.messages
             if event == "progress_text" and data["node"] == "7"]
    assert texts[-1].startswith(f"downloading {REPO}: ") and texts[-1].endswith("(100%)")


def test_an_unreachable_hub_falls_back_to_the_cached_copy(hub, tmp_path):
    first = download(tmp_path)
    hub.fail("GET", "api", "reset")
    sleeps, said = [], []
    assert download_partition(REPO, "fl2va", False, tmp_path / "cache", log=said.append,
                              retry=RetryPolicy(sleep=sleeps.append)) == first
    assert sleeps == [] and len(said) == 1
    assert said[0].startswith(f"{REPO}: Hugging Face cannot be reached (") and \
        said[0].endswith(f"); using the cached copy {first}")


def test_an_exception_from_the_progress_callback_passes_unchanged(hub, tmp_path):
    """ComfyUI's Cancel raises from its progress bar: never retried, never rewrapped."""
    class Cancelled(Exception):
        pass

    def cancel(done, total):
        raise Cancelled()

    sleeps = []
    with pytest.raises(Cancelled):
        download(tmp_path, sleeps=sleeps, progress=cancel)
    assert sleeps == []


def test_a_server_that_ignores_the_range_gets_the_whole_file_again(hub, tmp_path):
    name = SHARD_1
    data = hub.repos[REPO].files[name]
    hub.repos[REPO].ranges = False
    hub.fail("GET", name, f"cut:{len(data) // 3}")
    calls = []
    folder = download(tmp_path, progress=lambda done, total: calls.append((done, total)))
    assert (folder / name).read_bytes() == data
    assert [r.range for r in hub.requests if r.method == "GET" and r.path == name] == [None, f"bytes={len(data) // 3}-"]
    assert hub.bytes_served[name] == len(data) // 3 + len(data)
    assert calls[-1][0] == calls[-1][1]  # the bar ends full, the bytes sent twice counted in its total


@pytest.mark.parametrize("key, unused", [
    ("model.language_model.layers.49.mlp.up_proj.weight", False),
    ("model.language_model.layers.50.mlp.up_proj.weight", True),
    ("model.language_model.layers.63.self_attn.q_proj.weight", True),
    ("model.language_model.norm.weight", True),
    ("lm_head.weight", True),
    ("model.language_model.embed_tokens.weight", False),
    ("model.visual.blocks.60.attn.qkv.weight", False),  # the vision tower's blocks are not decoder layers
    ("model.visual.merger.norm.weight", False),
    ("language_model.model.layers.55.input_layernorm.weight", True),  # an older export
    ("text_encoders.qwen3vl_32b.transformer.model.layers.50.mlp.up_proj.weight", True),  # a ComfyUI nesting
    ("text_encoders.qwen3vl_32b.transformer.model.layers.3.mlp.up_proj.weight", False),
])
def test_which_text_encoder_keys_h3_never_reads_at_layer_50(key, unused):
    from h3_core.checkpoints.text_encoder_loader import never_read_by_h3

    assert never_read_by_h3(key, 50) is unused


def test_a_needed_shard_missing_from_the_folder_is_still_one_clear_error(hub, tmp_path):
    from h3_core.checkpoints.text_encoder_loader import resolve_text_encoder_checkpoint

    folder = download(tmp_path)
    (folder / SHARD_1).unlink()
    with pytest.raises(CheckpointError, match=r"names shard 'model-00001-of-00002.safetensors' \(for key '.*'\), "
                                              r"which is missing from"):
        resolve_text_encoder_checkpoint(folder / "text_encoder", 2)


# ---- content hashes (issue 28) ---------------------------------------------------------------------------------------

WEIGHTS = "vae/diffusion_pytorch_model.safetensors"  # an LFS file: 302 to the CDN, X-Linked-Etag its sha256
CONFIG = "vae/config.json"  # stored in git: ETag its git blob sha1


def test_the_stand_in_answers_as_the_hub_does_for_lfs_and_git_files(hub):
    """huggingface_hub's own metadata call against the stand-in: an LFS file's ETag is the sha256 of its bytes (from
    X-Linked-Etag on the 302, not the 302's own ETag) and it lives on another host; a git file's is git's sha1."""
    import hashlib

    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils.sha import git_hash

    files = hub.repos[REPO].files
    lfs = get_hf_file_metadata(hf_hub_url(REPO, WEIGHTS, revision=COMMIT, endpoint=hub.url), endpoint=hub.url)
    assert lfs.etag == hashlib.sha256(files[WEIGHTS]).hexdigest() and lfs.size == len(files[WEIGHTS])
    assert lfs.commit_hash == COMMIT and lfs.location.startswith(hub.cdn_url + "/")
    git = get_hf_file_metadata(hf_hub_url(REPO, CONFIG, revision=COMMIT, endpoint=hub.url), endpoint=hub.url)
    assert git.etag == git_hash(files[CONFIG]) and git.size == len(files[CONFIG])


def test_the_token_goes_to_the_hub_and_never_to_the_cdn(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_loopbackSecretToken123")
    download(tmp_path)
    cdn = [r for r in hub.requests if r.cdn]
    assert {r.path for r in cdn} == {n for n in FL2VA_FILES if n.endswith(".safetensors")}
    assert all(r.authorization is None for r in cdn)
    assert {r.authorization for r in hub.requests if not r.cdn} == {"Bearer hf_loopbackSecretToken123"}


@pytest.mark.parametrize("name", [WEIGHTS, CONFIG])
def test_a_file_with_the_right_size_and_wrong_bytes_is_fetched_again_once(hub, tmp_path, name):
    """Before: cached as good (huggingface_hub checks only the size). The LFS file is checked against its sha256,
    the git file against its git sha1."""
    hub.fail("GET", name, "corrupt")
    sleeps, said = [], []
    folder = download_partition(REPO, "fl2va", False, tmp_path / "cache", log=said.append,
                                retry=RetryPolicy(sleep=sleeps.append))
    assert (folder / name).read_bytes() == hub.repos[REPO].files[name]
    assert file_gets(hub).count(name) == 2 and sleeps == []
    kind = "sha256" if name == WEIGHTS else "git-sha1"
    assert said == [f"{REPO}: {name} arrived with other bytes than its {kind} says; deleted, fetching it again"]


def test_a_file_wrong_twice_is_one_error_and_nothing_of_it_is_cached(hub, tmp_path):
    import hashlib

    data = hub.repos[REPO].files[WEIGHTS]
    sha = hashlib.sha256(data).hexdigest()
    bad = hashlib.sha256(data[:-1] + bytes([data[-1] ^ 0xFF])).hexdigest()
    hub.fail("GET", WEIGHTS, "corrupt", "corrupt")
    sleeps = []
    with pytest.raises(CheckpointError) as caught:
        download(tmp_path, sleeps=sleeps)
    assert str(caught.value) == (
        f"{REPO}: {WEIGHTS} arrived twice with other bytes than the Hub lists for it (sha256 {sha}, received {bad}); "
        "it was deleted and nothing of it is cached. Something between here and the Hub alters the file (a proxy, a "
        f"mirror set in HF_ENDPOINT, a failing disk under {tmp_path / 'cache'}); run again on another network or "
        "with another cache_dir / HF_HUB_CACHE.")
    assert file_gets(hub).count(WEIGHTS) == 2 and sleeps == []
    blobs = tmp_path / "cache" / "models--owner--h3" / "blobs"
    assert not any(p.name.startswith(sha) for p in blobs.iterdir())  # neither the blob nor a partial file
    snapshot = tmp_path / "cache" / "models--owner--h3" / "snapshots" / COMMIT
    assert not (snapshot / WEIGHTS).exists()
    assert (download(tmp_path) / WEIGHTS).read_bytes() == data  # the next run fetches it as new


def test_a_resumed_partial_file_is_checked_over_all_its_bytes(hub, tmp_path):
    """The bytes a partial file already held are hashed too: a corrupt first part (a cut download whose disk
    flipped a byte) is found after the resume, and the file is fetched whole."""
    import hashlib

    data = hub.repos[REPO].files[SHARD_1]
    cut = len(data) // 3
    hub.fail("GET", SHARD_1, f"cut:{cut}")
    with pytest.raises(CheckpointError, match="still failed after 1 attempts"):
        download(tmp_path, retry=RetryPolicy(attempts=1))
    partial = tmp_path / "cache" / "models--owner--h3" / "blobs" / (hashlib.sha256(data).hexdigest() + ".h3-partial")
    held = bytearray(partial.read_bytes())
    held[10] ^= 0xFF
    partial.write_bytes(bytes(held))
    folder = download(tmp_path)
    assert (folder / SHARD_1).read_bytes() == data
    assert [r.range for r in hub.requests if r.method == "GET" and r.path == SHARD_1] == [None, f"bytes={cut}-",
                                                                                           None]
