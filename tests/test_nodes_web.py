"""The web extension (web/h3_stream.js) under Node.js, with stand-ins for the frontend's `app` and `api` modules.

Skipped where no `node` executable exists; the pack works without the extension (API-format prompts).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NODE = shutil.which("node")

APP_STANDIN = """
export const registered = [];
class Graph {
  constructor() { this._nodes = []; }
  getNodeById(id) { return this._nodes.find((n) => n.id === id) ?? null; }
}
export const app = { graph: new Graph(), registerExtension(ext) { registered.push(ext); } };
"""
API_STANDIN = """
export const listeners = {};
export let deviceType = "cpu";
export function setDevice(type) { deviceType = type; }
export const api = {
  addEventListener(event, handler) { (listeners[event] ??= []).push(handler); },
  async fetchApi(route) {
    if (route !== "/system_stats") throw new Error(route);
    return { json: async () => ({ devices: [{ type: deviceType }] }) };
  },
  dispatch(event, detail) { for (const h of listeners[event] ?? []) h({ detail }); },
};
"""
SCENARIO = """
globalThis.LiteGraph = { NODE_TITLE_HEIGHT: 30 };
const { app, registered } = await import("./scripts/app.js");
const { api, setDevice } = await import("./scripts/api.js");
await import("./extensions/h3-stream/h3_stream.js");
const ext = registered[0];
function makeNode(id, comfyClass, widgets) {
  return { id, comfyClass, size: [300, 200], flags: {}, widgets: widgets.map((name) => ({ name })),
           dirty: 0, setDirtyCanvas() { this.dirty += 1; }, computeSize() { return [300, 180]; },
           setSize(size) { this.size = size; } };
}
const result = {};
for (const device of ["cpu", "mps"]) {
  setDevice(device);
  app.graph._nodes = [];
  const loader = makeNode(1, "H3StreamLoader", ["source", "mps_reclaim_every"]);
  const other = makeNode(2, "KSampler", ["seed"]);
  app.graph._nodes.push(loader, other);
  ext.nodeCreated(loader); ext.nodeCreated(other);
  await ext.setup();
  result[device] = Object.fromEntries(loader.widgets.map((w) => [w.name, w.hidden ?? false]));
  result[device + "_other_drawn"] = typeof other.onDrawForeground;
  if (device === "cpu") {
    const sampler = makeNode(3, "H3StreamAVSampler", []);
    app.graph._nodes.push(sampler);
    ext.nodeCreated(sampler);
    api.dispatch("h3_stream.memory", { node: "3", phase: "sampling", peak_device_bytes: 3 * 2 ** 30,
                                       peak_host_bytes: 2 ** 29, resident_blocks: 4, total_blocks: 50 });
    result.badge = sampler.h3StreamBadge;
    result.redrawn = sampler.dirty;
    const drawn = [];
    const ctx = { save() {}, restore() {}, beginPath() {}, fill() {}, roundRect() {},
                  measureText: (t) => ({ width: t.length * 6 }), fillText: (t, x, y) => drawn.push([t, y]) };
    sampler.onDrawForeground(ctx);
    result.drawn = drawn;
    result.node_height = sampler.size[1];
    api.dispatch("h3_stream.memory", { node: "3", phase: "sampling", peak_device_bytes: null, peak_host_bytes: 2 ** 30,
                                       resident_blocks: 0, total_blocks: 2, step_cache_hits: 9, step_cache_calls: 29,
                                       step_cache: "step cache quality: 9 of 29 steps cached, 49 of 58 blocks run" });
    result.cached_badge = sampler.h3StreamBadge;
    for (const event of ["execution_start", "execution_error", "execution_interrupted"]) {
      api.dispatch("h3_stream.memory", { node: "3", phase: "sampling", peak_device_bytes: 1, peak_host_bytes: 1 });
      api.dispatch(event, {});
      result["after_" + event] = sampler.h3StreamBadge;
    }
    const modelLoader = makeNode(4, "H3StreamModelLoader", ["source", "memory_profile"]);
    ext.nodeCreated(modelLoader);
    const preflight = "memory_profile 24 GB GPU: plans for 21.60 GiB of 24 GiB, at 1344x768, 124 frames: " +
                      "text_encoder layerwise, transformer layerwise";
    modelLoader.onExecuted({ h3_stream_preflight: [preflight] });
    const lines = [];
    const ctx2 = { save() {}, restore() {}, beginPath() {}, fill() {}, roundRect() {},
                   measureText: (t) => ({ width: t.length * 6 }), fillText: (t, x, y) => lines.push([t, y]) };
    api.dispatch("execution_start", {});
    modelLoader.onDrawForeground(ctx2);
    result.preflight = preflight;
    result.preflight_lines = lines;
    result.loader_height = modelLoader.size[1];
  }
}
console.log(JSON.stringify(result));
"""


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_memory_badge_and_mps_only_widgets(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(APP_STANDIN)
    (tmp_path / "scripts" / "api.js").write_text(API_STANDIN)
    extension = tmp_path / "extensions" / "h3-stream"
    extension.mkdir(parents=True)
    shutil.copy(ROOT / "web" / "h3_stream.js", extension / "h3_stream.js")
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "scenario.js").write_text(SCENARIO)
    done = subprocess.run([NODE, "scenario.js"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cpu"] == {"source": False, "mps_reclaim_every": True}  # MPS-only option hidden off MPS
    assert result["mps"] == {"source": False, "mps_reclaim_every": False}
    assert result["cpu_other_drawn"] == "undefined"  # other packs' nodes are left alone
    assert result["badge"] == "sampling: dev 3.00 GiB · host 0.50 GiB · blocks 4/50 resident"
    # With a step cache on, the sampler's badge says how many of its transformer calls were cached.
    assert result["cached_badge"] == "sampling: dev n/a · host 1.00 GiB · blocks 0/2 resident · cached 9/29 steps"
    assert result["redrawn"] >= 1 and [text for text, _ in result["drawn"]] == [result["badge"]]
    # Drawn under the node's bottom edge, clear of the title bar's own badges (node source, id).
    assert all(y > result["node_height"] for _, y in result["drawn"])
    # A run that starts, fails or is cancelled clears the badges of the previous one.
    assert [result[f"after_{e}"] for e in ("execution_start", "execution_error", "execution_interrupted")] == [None] * 3
    # H3 Loader's preflight (its UI output, sent again by ComfyUI while the loader is cached): kept across runs, drawn
    # under the node wrapped to its width (300 px here, 6 px a character in the stand-in).
    lines = result["preflight_lines"]
    assert " ".join(text for text, _ in lines) == result["preflight"] and len(lines) > 1
    assert all(len(text) * 6 <= 290 for text, _ in lines) and all(y > result["loader_height"] for _, y in lines)
