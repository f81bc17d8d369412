// h3-stream web extension: a memory badge on the pack's nodes, and MPS-only options shown only on MPS.
// Optional: every node works from API-format prompts without a browser. Uses documented hooks only.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EVENT = "h3_stream.memory"; // sent by nodes/comfy_runtime.py after each H3 node ran
const NODE_IDS = new Set([
  "H3StreamLoader", "H3StreamModelLoader", "H3StreamEncodePrompt", "H3StreamAVSampler", "H3StreamTextEncode",
  "H3StreamSampler", "H3StreamDecodeVideo", "H3StreamDecodeAudio", "H3StreamMemoryReport", "H3StreamUnload",
]);
// Widgets that only do something on Apple MPS (unified memory).
const MPS_ONLY_WIDGETS = { H3StreamLoader: ["mps_reclaim_every"], H3StreamModelLoader: ["memory_profile.mps_reclaim_every"] };

let deviceType = null; // "cpu" | "cuda" | "mps", from /system_stats

function gib(bytes) {
  return bytes === null || bytes === undefined ? "n/a" : `${(bytes / 2 ** 30).toFixed(2)} GiB`;
}

function badgeText(report) {
  const parts = [`dev ${gib(report.peak_device_bytes)}`, `host ${gib(report.peak_host_bytes)}`];
  if (report.total_blocks) parts.push(`blocks ${report.resident_blocks}/${report.total_blocks} resident`);
  // The sampler with a step cache on: how many of its transformer calls were cached (the progress text has more).
  if (report.step_cache_calls) parts.push(`cached ${report.step_cache_hits}/${report.step_cache_calls} steps`);
  return `${report.phase}: ${parts.join(" · ")}`;
}

function applyMpsVisibility(node) {
  const names = MPS_ONLY_WIDGETS[node.comfyClass];
  if (!names || !node.widgets) return;
  const hide = deviceType !== null && deviceType !== "mps";
  for (const widget of node.widgets) {
    if (names.includes(widget.name)) widget.hidden = hide;
  }
  node.setSize?.(node.computeSize());
}

function drawBadge(node) {
  const draw = node.onDrawForeground;
  node.onDrawForeground = function (ctx) {
    draw?.apply(this, arguments);
    if (!this.h3StreamBadge || this.flags?.collapsed) return;
    ctx.save();
    ctx.font = "11px sans-serif";
    const width = ctx.measureText(this.h3StreamBadge).width + 10;
    ctx.fillStyle = "rgba(20, 90, 60, 0.85)";
    // Under the node's bottom edge, right-aligned: the title bar above carries the frontend's own badges (node
    // source, id), which a badge there would cover.
    const top = this.size[1] + 4;
    ctx.beginPath();
    ctx.roundRect?.(this.size[0] - width, top, width, 17, 5);
    ctx.fill();
    ctx.fillStyle = "#fff";
    ctx.fillText(this.h3StreamBadge, this.size[0] - width + 5, top + 13);
    ctx.restore();
  };
}

function wrapLines(ctx, text, width) {
  const lines = [];
  let line = "";
  for (const word of text.split(" ")) {
    const candidate = line ? `${line} ${word}` : word;
    if (line && ctx.measureText(candidate).width > width) {
      lines.push(line);
      line = word;
    } else {
      line = candidate;
    }
  }
  if (line) lines.push(line);
  return lines;
}

// Load H3's memory preflight: sent as the node's UI output, so ComfyUI sends it again when the loader's output is
// cached and the text stays with the node across runs. Drawn under the node, wrapped to its width.
function drawPreflight(node) {
  const executed = node.onExecuted;
  node.onExecuted = function (output) {
    executed?.apply(this, arguments);
    const text = output?.h3_stream_preflight?.[0];
    if (text) {
      this.h3StreamPreflight = text;
      this.setDirtyCanvas?.(true, true);
    }
  };
  const draw = node.onDrawForeground;
  node.onDrawForeground = function (ctx) {
    draw?.apply(this, arguments);
    if (!this.h3StreamPreflight || this.flags?.collapsed) return;
    ctx.save();
    ctx.font = "11px sans-serif";
    const lines = wrapLines(ctx, this.h3StreamPreflight, this.size[0] - 10);
    const top = this.size[1] + 4;
    ctx.fillStyle = "rgba(30, 50, 80, 0.9)";
    ctx.beginPath();
    ctx.roundRect?.(0, top, this.size[0], lines.length * 14 + 6, 5);
    ctx.fill();
    ctx.fillStyle = "#dde";
    lines.forEach((line, index) => ctx.fillText(line, 5, top + 14 + index * 14));
    ctx.restore();
  };
}

app.registerExtension({
  name: "h3_stream.memory_badge",
  async setup() {
    try {
      const stats = await (await api.fetchApi("/system_stats")).json();
      deviceType = stats?.devices?.[0]?.type ?? null;
    } catch (error) {
      console.warn("h3-stream: /system_stats unavailable, MPS-only options stay visible", error);
    }
    for (const node of app.graph?._nodes ?? []) applyMpsVisibility(node);
    // A badge belongs to the run that produced it: cleared when a run starts, fails or is cancelled.
    const clearBadges = () => {
      for (const node of app.graph?._nodes ?? []) {
        if (node.h3StreamBadge) {
          node.h3StreamBadge = null;
          node.setDirtyCanvas?.(true, true);
        }
      }
    };
    for (const event of ["execution_start", "execution_error", "execution_interrupted"]) {
      api.addEventListener(event, clearBadges);
    }
    api.addEventListener(EVENT, ({ detail }) => {
      const node = app.graph?.getNodeById(Number(detail.node)) ?? app.graph?.getNodeById(detail.node);
      if (!node) return;
      node.h3StreamBadge = badgeText(detail);
      node.setDirtyCanvas?.(true, true);
    });
  },
  nodeCreated(node) {
    if (!NODE_IDS.has(node.comfyClass)) return;
    drawBadge(node);
    if (node.comfyClass === "H3StreamModelLoader") drawPreflight(node);
    applyMpsVisibility(node);
  },
});
