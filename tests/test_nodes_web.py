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
globalThis.__app = { app };
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
  dispatchCustomEvent(event, detail) { this.dispatch(event, detail); },
};
// As the frontend shows a progress text: its box widget on the node, made when first needed.
api.addEventListener("progress_text", ({ detail }) => {
  const { app } = globalThis.__app;
  const node = app.graph.getNodeById(Number(detail.nodeId));
  if (!node) return;
  let box = node.widgets.find((w) => w.name === "$$node-text-preview");
  if (!box) node.widgets.push(box = { name: "$$node-text-preview", value: "" });
  box.value = detail.text;
});
"""
SCENARIO = """
globalThis.LiteGraph = { NODE_TITLE_HEIGHT: 30, INPUT: 1 };
const { app, registered } = await import("./scripts/app.js");
const { api, setDevice, shown } = await import("./scripts/api.js");
const web = await import("./extensions/h3-stream/h3_stream.js");
const ext = registered[0];
const TEXT = web.TEXT_WIDGET;
function makeNode(id, comfyClass, widgets, inputs = []) {
  return { id, comfyClass, size: [300, 200], flags: {}, widgets: widgets.map((name) => ({ name, value: "" })),
           inputs: inputs.map((name) => ({ name, link: null })),
           dirty: 0, setDirtyCanvas() { this.dirty += 1; }, computeSize() { return [300, 180]; },
           setSize(size) { this.size = [...size]; },
           removeInput(index) { this.inputs.splice(index, 1); },
           addInput(name, type) { this.inputs.push({ name, type, link: null }); } };
}
const result = {};
for (const device of ["cpu", "mps"]) {
  setDevice(device);
  app.graph._nodes = [];
  const loader = makeNode(1, "H3StreamModelLoader", ["source", "memory_profile"]);
  const other = makeNode(2, "KSampler", ["seed"]);
  app.graph._nodes.push(loader, other);
  ext.nodeCreated(loader); ext.nodeCreated(other);
  await ext.setup();
  // The custom profile's widgets arrive after the node was created: hidden when the node is next drawn.
  loader.widgets.push({ name: "memory_profile.mps_reclaim_every", value: 0 });
  loader.onDrawForeground({});
  result[device] = Object.fromEntries(loader.widgets.map((w) => [w.name, w.hidden ?? false]));
  result[device + "_other_touched"] = typeof other.onDrawForeground + typeof other.onExecuted;
  result[device + "_loader_width"] = loader.size[0];
}
// The server's text for a node: the frontend's handler puts it in its box (the stand-in does as the frontend does);
// ours makes it unbreakable and grows the node by the text's height.
const sampler = makeNode(3, "H3StreamAVSampler", ["steps"]);
app.graph._nodes.push(sampler);
ext.nodeCreated(sampler);
const baseHeight = sampler.size[1];
const line = "sampling: peak RAM 0.61 GiB, 0 of 2 blocks kept loaded, the rest streamed";
api.dispatch("progress_text", { nodeId: "3", text: line });
await new Promise((r) => setTimeout(r, 5));
const box = sampler.widgets.find((w) => w.name === TEXT);
result.text = box.value;
result.grown = sampler.size[1] - baseHeight;
result.box_height = box.computeLayoutSize().minHeight;
result.lines = web.wrapLines(box.value, sampler.size[0] - 52).length;
// Load H3's plan (its UI output, sent again while the loader is cached) goes into the same box.
const loader = app.graph._nodes[0];
const plan = "memory_profile 24 GB GPU, planned for 21.60 GiB of 24 GiB: all weights stay loaded.";
loader.onExecuted({ h3_stream_preflight: [plan] });
result.plan = loader.widgets.find((w) => w.name === TEXT)?.value.replaceAll("\\u2060", "");
// A run starts: every text goes and the nodes get their height back; a cached node gets its text back.
api.dispatch("execution_start", {});
result.after_start = app.graph._nodes.map((n) => n.widgets.some((w) => w.name === TEXT));
result.height_back = sampler.size[1] === baseHeight;
api.dispatch("execution_cached", { nodes: ["3"] });
result.cached_back = sampler.widgets.find((w) => w.name === TEXT)?.value.replaceAll("\\u2060", "");
// A failed or cancelled node says so instead of its last partial progress.
api.dispatch("execution_error", { node_id: "3" });
result.failed = sampler.widgets.find((w) => w.name === TEXT)?.value.replaceAll("\\u2060", "");
api.dispatch("execution_interrupted", { node_id: "3" });
result.cancelled = sampler.widgets.find((w) => w.name === TEXT)?.value.replaceAll("\\u2060", "");
// H3 References: one free socket of each kind, growing as they are connected; links follow their sockets.
const names = (n) => n.inputs.map((i) => i.name);
const all = web.GROWING.flatMap(([prefix, count]) => Array.from({ length: count }, (_, i) => prefix + (i + 1)));
const refs = makeNode(5, "H3StreamReferenceMedia", ["ref_image_size"], all);
refs.inputs.unshift({ name: "ref_image_size", widget: { name: "ref_image_size" }, link: null });
ext.nodeCreated(refs);
result.refs_fresh = names(refs);
app.graph.links = { 7: { target_slot: 1 } };
refs.inputs[1].link = 7;  // ref_image_1 connected
refs.onConnectionsChange(1, 1, true);
await new Promise((r) => setTimeout(r, 5));
result.refs_grown = names(refs);
result.link_slot = app.graph.links[7].target_slot;
// A saved workflow's node (all 15 sockets, ref_video_2 connected) keeps its link when the free ones go.
const saved = makeNode(6, "H3StreamReferenceMedia", [], all);
ext.nodeCreated(saved);
saved.inputs = all.map((name) => ({ name, link: name === "ref_video_2" ? 9 : null }));
app.graph.links[9] = { target_slot: 10 };
saved.onConfigure({});
result.saved = names(saved);
result.saved_slot = app.graph.links[9].target_slot;
result.unbreakable = web.unbreakable("peak 0.64 GiB");
console.log(JSON.stringify(result));
"""


@pytest.mark.skipif(NODE is None, reason="Node.js is not installed")
def test_node_text_mps_only_widgets_widths_and_growing_references(tmp_path):
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
    r = json.loads(done.stdout.strip().splitlines()[-1])
    # MPS-only options hidden off MPS, also one a dynamic combo adds after the node was created.
    assert r["cpu"] == {"source": False, "memory_profile": False, "memory_profile.mps_reclaim_every": True}
    assert r["mps"] == {"source": False, "memory_profile": False, "memory_profile.mps_reclaim_every": False}
    assert r["cpu_other_touched"] == "undefinedundefined"  # other packs' nodes are left alone
    assert r["cpu_loader_width"] >= 400  # a fresh loader is wide enough for its source values
    # The text: word joiners between the characters of each word (the box breaks anywhere otherwise), same words.
    words = "sampling: peak RAM 0.61 GiB, 0 of 2 blocks kept loaded, the rest streamed"
    assert r["text"].replace("\u2060", "") == words and "0\u2060.\u20606\u20601" in r["text"]
    assert r["unbreakable"] == "p\u2060e\u2060a\u2060k 0\u2060.\u20606\u20604 G\u2060i\u2060B"
    # The box is exactly as high as its lines, and the node grew by that (its widgets keep their room).
    assert r["box_height"] == r["lines"] * 16 + 36 and r["grown"] == r["box_height"] + 4 and r["lines"] >= 2
    assert r["plan"].startswith("memory_profile 24 GB GPU, planned for")
    assert r["after_start"] == [False, False, False] and r["height_back"]
    assert r["cached_back"].startswith("sampling: peak RAM")
    assert (r["failed"], r["cancelled"]) == ("failed: see the error message", "cancelled")
    assert r["refs_fresh"] == ["ref_image_size", "ref_image_1", "ref_video_1", "ref_audio_1"]
    assert r["refs_grown"] == ["ref_image_size", "ref_image_1", "ref_image_2", "ref_video_1", "ref_audio_1"]
    assert r["link_slot"] == 1
    assert r["saved"] == ["ref_image_1", "ref_video_1", "ref_video_2", "ref_audio_1"]  # the lowest free one of each
    assert r["saved_slot"] == 2
