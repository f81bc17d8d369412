"""Outputs are written atomically (a staging name in the same folder, then `os.replace`): a failed, interrupted or
terminated run leaves no partial file and never destroys the file already at --out. The tiny model's cache recovers
from an interrupted first use and regenerates a damaged model."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cli_fixtures import default_sigint

from h3_core.app import cli
from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.request.generation_result import GenerationResult
from h3_core.request.media_files import save_generation
from h3_core.sources.tiny_default import TINY_VERSION, ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]
OLD = b"an earlier, good video"


def fake_result() -> GenerationResult:
    generator = torch.Generator().manual_seed(0)
    return GenerationResult(torch.rand(5, 32, 64, 3, generator=generator),
                            torch.rand(2, 7000, generator=generator) * 2 - 1)


def folder_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# The CLI with the model's work replaced: `generate` returns a small fixed result at once (or waits for a signal),
# and optionally the mp4 muxer waits for a signal after its second packet, when the staging file exists.
CHILD = r"""
import sys, time
from h3_core.app import cli
from h3_core.pipeline import H3Pipeline
from h3_core.request import GenerationResult
import torch

mode = sys.argv[1]

def wait_for_signal():
    print("READY", flush=True)
    while True:
        time.sleep(0.05)

def generate(self, *args, **kwargs):
    if mode == "generation":
        wait_for_signal()
    g = torch.Generator().manual_seed(0)
    return GenerationResult(torch.rand(5, 32, 64, 3, generator=g), torch.rand(2, 7000, generator=g) * 2 - 1)

H3Pipeline.generate = generate
if mode == "write":
    import av
    real_open = av.open

    class WaitsMidWrite:
        def __init__(self, container):
            self.container, self.packets = container, 0
        def __enter__(self):
            self.container.__enter__()
            return self
        def __exit__(self, *exc):
            return self.container.__exit__(*exc)
        def __getattr__(self, name):
            return getattr(self.container, name)
        def mux(self, packet):
            self.container.mux(packet)
            self.packets += 1
            if self.packets == 2:
                wait_for_signal()

    av.open = lambda *a, **k: WaitsMidWrite(real_open(*a, **k))
sys.exit(cli.main(["generate", "x", "--out", sys.argv[2]]))
"""


def child_env(tiny) -> dict:
    return dict(os.environ, H3_STREAM_CACHE=str(tiny.parent), PYTHONPATH=str(ROOT))


def signalled_run(tiny, tmp_path, mode, signum):
    """Run the CLI child, send `signum` once it waits (mid-generation or mid-write), return its result."""
    out = tmp_path / "clip.mp4"
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(out)], cwd=tmp_path, env=child_env(tiny),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    watchdog = threading.Timer(300, child.kill)
    watchdog.start()
    try:
        seen = []
        for line in child.stdout:
            seen.append(line)
            if line.strip() == "READY":
                break
        assert seen and seen[-1].strip() == "READY", (seen, child.stderr.read())
        staged = [name for name in folder_names(tmp_path) if name.endswith(".partial")]
        child.send_signal(signum)
        stdout, stderr = child.communicate()
    finally:
        watchdog.cancel()
    return child.returncode, stderr, staged, out


@pytest.mark.parametrize("mode", ["generation", "write"])
@pytest.mark.parametrize("signum,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_interrupt_and_terminate_leave_no_file(tiny, tmp_path, mode, signum, code, word):
    returncode, stderr, staged, out = signalled_run(tiny, tmp_path, mode, signum)
    assert returncode == code
    assert stderr == f"{word}; nothing was written\n"
    # Mid-write the video existed only under its staging name, and that is gone too.
    assert staged == ([f".clip.mp4.{_only_pid(staged)}.partial"] if mode == "write" else [])
    assert folder_names(tmp_path) == []


def _only_pid(staged):
    return staged[0].split(".")[3] if staged else ""


@pytest.mark.parametrize("signum,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_interrupted_write_keeps_the_existing_file(tiny, tmp_path, signum, code, word):
    (tmp_path / "clip.mp4").write_bytes(OLD)
    returncode, stderr, _, out = signalled_run(tiny, tmp_path, "write", signum)
    assert returncode == code
    assert stderr == f"{word}; nothing was written; {out} is unchanged\n"
    assert out.read_bytes() == OLD and folder_names(tmp_path) == ["clip.mp4"]


def limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the fake result's mp4 is about 11 KB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@pytest.mark.parametrize("existing", [False, True])
def test_file_size_limit_gives_one_message_and_no_corrupt_file(tiny, tmp_path, existing):
    out = tmp_path / "clip.mp4"
    if existing:
        out.write_bytes(OLD)
    done = subprocess.run([sys.executable, "-c", CHILD, "now", str(out)], cwd=tmp_path, env=child_env(tiny),
                          capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    kept = "; the file already there is unchanged" if existing else ""
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: {out}: could not write the output: File too large, past the process's file-size "
                           f"limit (ulimit -f). Nothing was written{kept}.\n")
    assert folder_names(tmp_path) == (["clip.mp4"] if existing else [])
    if existing:
        assert out.read_bytes() == OLD


def test_a_second_run_replaces_the_file_and_says_so(tiny, monkeypatch, capsys, tmp_path):
    import av

    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))
    monkeypatch.setattr(H3Pipeline, "generate", lambda self, *a, **k: fake_result())
    out = tmp_path / "clip.mp4"
    assert cli.main(["generate", "x", "--out", str(out)]) == 0
    assert f"wrote {out}\n" in capsys.readouterr().out
    out.write_bytes(OLD)
    assert cli.main(["generate", "x", "--out", str(out)]) == 0
    assert f"wrote {out} (replaced the file that was there)\n" in capsys.readouterr().out
    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
    assert folder_names(tmp_path) == ["clip.mp4"]


def test_failed_run_keeps_the_existing_file(tiny, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))

    def fails(self, *args, **kwargs):
        raise H3Error("the transformer produced NaN/Inf at step 1.")

    monkeypatch.setattr(H3Pipeline, "generate", fails)
    out = tmp_path / "clip.mp4"
    out.write_bytes(OLD)
    assert cli.main(["generate", "x", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "error: the transformer produced NaN/Inf at step 1.\n"
    assert out.read_bytes() == OLD


@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_gives_one_message_and_leaves_no_partial_file(tiny, monkeypatch, capsys, tmp_path, existing):
    """The disk fills up half way through the mp4 (ENOSPC from the writer): one message, no staging file left, an
    existing file unchanged."""
    import errno

    import h3_core.request.media_files as media

    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))
    monkeypatch.setattr(H3Pipeline, "generate", lambda self, *a, **k: fake_result())

    def fills_the_disk(path, *args, **kwargs):  # the encoder, writing into the staging file
        Path(path).write_bytes(b"half an mp4")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(media, "_encode_mp4", fills_the_disk)
    out = tmp_path / "clip.mp4"
    if existing:
        out.write_bytes(OLD)
    assert cli.main(["generate", "x", "--out", str(out)]) == 2
    kept = "; the file already there is unchanged" if existing else ""
    assert capsys.readouterr().err == (f"error: {out}: could not write the output: No space left on device. Nothing "
                                       f"was written{kept}.\n")
    assert folder_names(tmp_path) == (["clip.mp4"] if existing else [])
    if existing:
        assert out.read_bytes() == OLD


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_staging_leftovers_of_a_killed_writer_are_removed(tmp_path):
    result = fake_result()
    dead, alive = dead_pid(), os.getppid()
    for pid in (dead, alive):
        (tmp_path / f".clip.mp4.{pid}.partial").write_bytes(b"half a video")
    save_generation(tmp_path / "clip.mp4", result.frames, result.waveform)
    assert folder_names(tmp_path) == [f".clip.mp4.{alive}.partial", "clip.mp4"]  # a live writer's is left alone


def test_png_and_wav_fallback_replaces_whole_folders(tmp_path):
    result = fake_result()
    (tmp_path / "clip_frames").mkdir()
    (tmp_path / "clip_frames" / "frame_00099.png").write_bytes(b"from an earlier, longer run")
    written = save_generation(tmp_path / "clip.mp4", result.frames, result.waveform, prefer_mp4=False)
    assert written == [tmp_path / "clip_frames", tmp_path / "clip.wav"]
    assert folder_names(tmp_path / "clip_frames") == [f"frame_{i:05d}.png" for i in range(5)]
    assert folder_names(tmp_path) == ["clip.wav", "clip_frames"]


def test_save_generation_refuses_other_suffixes(tmp_path):
    result = fake_result()
    with pytest.raises(H3Error, match=r"^path '.*clip\.mkv': h3-stream writes \.mp4 files"):
        save_generation(tmp_path / "clip.mkv", result.frames, result.waveform)
    assert folder_names(tmp_path) == []


# ---- the tiny model's cache ----------------------------------------------------------------------------------------


def test_interrupted_first_use_is_cleaned_up(tmp_path):
    """A kill during the first generation leaves `.tiny-v2-PID-*`; the next use removes it and writes the model."""
    stale = tmp_path / f".{TINY_VERSION}-{dead_pid()}-k1ll3d"
    (stale / "diffusion_models").mkdir(parents=True)
    (stale / "diffusion_models" / "half.safetensors").write_bytes(b"\0" * 4096)
    live = tmp_path / f".{TINY_VERSION}-{os.getppid()}-busy"  # another process writing right now
    live.mkdir()
    target = ensure_tiny_model(tmp_path)
    assert (target / "model_index.json").is_file()
    assert folder_names(tmp_path) == [live.name, TINY_VERSION]


def test_damaged_cached_model_is_regenerated(tiny, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(tiny.parent / TINY_VERSION, root / TINY_VERSION)
    dit = root / TINY_VERSION / "diffusion_models" / "minimax_h3_tiny_fl2va_fp32.safetensors"
    original = dit.read_bytes()
    os.truncate(dit, 1000)
    notes = []
    assert ensure_tiny_model(root, log=notes.append) == root / TINY_VERSION
    assert notes == [f"note: the cached tiny model in {root / TINY_VERSION} is damaged (diffusion_models/"
                     f"minimax_h3_tiny_fl2va_fp32.safetensors is 1000 bytes, expected {len(original)}); "
                     "regenerating it"]
    assert dit.read_bytes() == original  # generated deterministically: the same bytes again
    assert folder_names(root) == [TINY_VERSION]
    notes.clear()
    ensure_tiny_model(root, log=notes.append)
    assert notes == []  # intact now: nothing to say


def test_cli_regenerates_a_damaged_tiny_model(tiny, run_cli, monkeypatch, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(tiny.parent / TINY_VERSION, root / TINY_VERSION)
    (root / TINY_VERSION / "text_encoders" / "qwen3vl_tiny_minimax_h3" / "tokenizer.json").unlink()
    monkeypatch.setattr(H3Pipeline, "generate", lambda self, *args, **kwargs: fake_result())
    done = run_cli(["generate", "x", "--out", "clip.mp4"], tmp_path, H3_STREAM_CACHE=root)
    assert done.returncode == 0, done.stderr
    assert (f"note: the cached tiny model in {root / TINY_VERSION} is damaged (text_encoders/qwen3vl_tiny_minimax_h3/"
            "tokenizer.json is missing); regenerating it\n") in done.stdout
    assert "Download it again" not in done.stdout + done.stderr
    assert (root / TINY_VERSION / "text_encoders" / "qwen3vl_tiny_minimax_h3" / "tokenizer.json").is_file()


def limit_file_size_only():
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as a shell starts it (a kill), whatever this process inherited


def test_the_real_cli_past_the_file_size_limit_is_one_line_not_a_kill(tiny, tmp_path):
    # Python ignores SIGXFSZ at start-up, so the write fails with EFBIG and quantize reports it (before: an OSError
    # traceback). quantize's output (0.3 MiB) passes the 64 KiB limit.
    source = tiny / "diffusion_models" / "minimax_h3_tiny_fl2va_fp32.safetensors"
    done = subprocess.run([sys.executable, "-m", "h3_core", "quantize", str(source), "q.gguf", "--format", "q8_0"],
                          cwd=tmp_path, env=child_env(tiny), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_file_size_only)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.startswith("error: q.gguf: could not write the quantised file: ") and \
        "past the process's file-size limit (ulimit -f). Nothing was written." in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and folder_names(tmp_path) == []
