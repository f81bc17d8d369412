"""The step cache where users reach it: the CLI's --step-cache and its expert numbers (in the flags' words, the hits
printed at the end), the pipeline's request field, and the remote engine, which refuses it before sending anything."""

from __future__ import annotations

import pytest
from test_cli_reliability import one_error_line
from videos_api_server import FRAMES, HEIGHT, WIDTH, VideosApiServer

from h3_core.errors import H3Error
from h3_core.remote import RemoteEngine
from h3_core.step_cache_settings import STEP_CACHE_PRESETS

TINY = ["--seconds", "0.5", "--size", "96x64"]




def test_generate_help_lists_the_presets(run_cli, tmp_path):
    done = run_cli(["generate", "--help"], tmp_path)
    assert "--step-cache {" + ",".join(STEP_CACHE_PRESETS) + "}" in done.stdout.replace("\n", " ")
    for flag in ("--step-cache-threshold", "--step-cache-blocks", "--step-cache-warmup",
                 "--step-cache-max-consecutive"):
        assert flag in done.stdout


def test_the_cli_prints_the_hits_and_an_expert_setting(tiny, run_cli, tmp_path):
    # The tiny model has 2 blocks: 1 always runs, the other is skipped on every call the rules allow.
    done = run_cli(["generate", "x", *TINY, "--steps", "9", "--step-cache-threshold", "1", "--step-cache-warmup", "2",
                    "--out", tmp_path / "a.mp4"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "step cache: quality with --step-cache-threshold, --step-cache-warmup (custom: first 1 / last 0 blocks " \
           "always run, threshold 1, 2 warm-up steps, at most 1 in a row)" in done.stdout
    # 8 calls: 0 and 1 warm up, then every other one is cached (2, 4, 6).
    assert "step cache custom: 3 of 8 steps cached, 13 of 16 blocks run" in done.stdout
    off = run_cli(["generate", "x", *TINY, "--steps", "9", "--out", tmp_path / "b.mp4"], tmp_path)
    assert off.returncode == 0 and "step cache" not in off.stdout


@pytest.mark.parametrize("args, message", [
    (["--step-cache-blocks", "1,2,3"], "--step-cache-blocks '1,2,3': give F or F,B"),
    (["--step-cache-blocks", "0"], "--step-cache-blocks F must be an integer >= 1, got 0"),
    (["--step-cache-blocks", "1,-1"], "--step-cache-blocks B must be an integer >= 0, got -1"),
    (["--step-cache-threshold", "inf"], "--step-cache-threshold must be a finite number"),
    (["--step-cache-warmup", "-2"], "--step-cache-warmup must be an integer >= 0, got -2"),
    (["--step-cache-max-consecutive", "-5"], "--step-cache-max-consecutive must be an integer >= -1, got -5"),
])
def test_bad_step_cache_flags_give_one_line(args, message, tiny, run_cli, tmp_path):
    assert message in one_error_line(run_cli(["generate", "x", *TINY, *args, "--out", tmp_path / "a.mp4"], tmp_path))


def test_an_unknown_preset_is_argparse_s_choice_error(run_cli, tmp_path):
    done = run_cli(["generate", "x", "--step-cache", "turbo"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        "error: argument --step-cache: invalid choice: 'turbo' (choose from 'off', 'quality', 'fast')")


def test_too_many_always_run_blocks_name_the_flag(tiny, run_cli, tmp_path):
    # Known once the transformer is loaded (its block count), and refused before the sampling bar starts.
    done = run_cli(["generate", "x", *TINY, "--step-cache-blocks", "1,1", "--out", tmp_path / "a.mp4"], tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "sampling [" not in done.stderr
    assert done.stderr == ("error: --step-cache custom: 1 first + 1 last blocks always run, which leaves none of this "
                           "transformer's 2 blocks to skip; let fewer blocks always run.\n")
    assert not (tmp_path / "a.mp4").exists()


@pytest.mark.parametrize("args", [["--step-cache", "quality"], ["--step-cache-threshold", "0.1"]])
def test_the_cli_refuses_the_step_cache_with_a_server_before_contacting_it(args, run_cli, tmp_path):
    line = one_error_line(run_cli(["generate", "x", "--server", "http://127.0.0.1:9", *args, "--out",
                                   tmp_path / "a.mp4"], tmp_path))
    assert line.startswith(f"error: {args[0]}: a server runs its own step cache")
    assert "Drop it, or drop --server to run locally." in line


def test_the_remote_engine_refuses_the_step_cache_before_sending():
    with VideosApiServer() as server:
        engine = RemoteEngine(server.url, poll_interval=0.01, backoff=0.01, attempts=3)
        with pytest.raises(H3Error, match="^step_cache fast: a server runs its own step cache"):
            engine.generate("x", width=WIDTH, height=HEIGHT, num_frames=FRAMES, steps=3, step_cache="fast")
        assert server.seen == []


def test_too_few_steps_for_a_hit_get_a_note(tiny, run_cli, tmp_path):
    done = run_cli(["generate", "x", *TINY, "--step-cache", "quality", "--out", tmp_path / "a.mp4"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("note: --step-cache quality: 2 model calls and 4 warm-up steps leave no call it can skip; it runs every "
            "block") in done.stdout
    assert "step cache quality: 0 of 2 steps cached, 4 of 4 blocks run" in done.stdout
    assert "0 of 2 steps cached" in done.stderr  # the progress bar's note
