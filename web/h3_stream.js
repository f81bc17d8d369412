// h3-stream web extension. Optional: every node works from API-format prompts without a browser; documented hooks
// only. What it does for the pack's nodes:
//  * one place for a node's text: the frontend's own progress-text box (the plan on H3 Loader, the memory figures on
//    the others), kept readable (numbers and words never broken) and inside the node, which grows to fit it instead
//    of squeezing the node's own widgets (H3 Text Encode's prompt);
//  * that text belongs to one run: cleared when a run starts; a failed or cancelled node says so instead of
//    showing its last partial progress; H3 Loader's plan comes back on every run (its UI output, sent again while the
//    loader is cached), so it is there when a later node fails;
//  * MPS-only options hidden off Apple MPS, also those a dynamic combo adds later (the custom memory profile);
//  * freshly added nodes wide enough for their widgets' labels and values;
//  * H3 References shows one empty socket of each kind and grows as they are connected (like core's Autogrow); the
//    server keeps its fixed socket names, so saved workflows and API prompts are unchanged.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_IDS = new Set([
  "H3StreamLoader", "H3StreamModelLoader", "H3StreamEncodePrompt", "H3StreamAVSampler", "H3StreamTextEncode",
  "H3StreamSampler", "H3StreamDecodeVideo", "H3StreamDecodeAudio", "H3StreamMemoryReport", "H3StreamUnload",
  "H3StreamLoRA", "H3StreamReferenceMedia", "H3StreamReferences", "H3StreamGenerateRemote",
  "H3StreamLatentToCore", "H3StreamLatentFromCore", "H3StreamGuide", "H3StreamLongVideo", "H3StreamExtend",
]);
// The frontend's progress-text widget (shown by every renderer; `send_progress_text` on the server fills it).
export const TEXT_WIDGET = "$$node-text-preview";
// Widgets that only do something on Apple MPS (unified memory); a dynamic combo's members carry its name as prefix.
const MPS_ONLY_SUFFIX = "mps_reclaim_every";
// Narrowest width of a freshly added node, so that labels and values fit (H3 Loader's source values are long).
const MIN_WIDTH = { H3StreamModelLoader: 400, H3StreamEncodePrompt: 400, H3StreamAVSampler: 320,
                    H3StreamReferenceMedia: 320, H3StreamLoRA: 360, H3StreamGenerateRemote: 380,
                    H3StreamLongVideo: 360, H3StreamExtend: 360 };
const DEFAULT_MIN_WIDTH = 300;
// H3 References' growing sockets: prefix, how many the model takes, socket type (the order is the request's).
export const GROWING = [["ref_image_", 9, "IMAGE"], ["ref_video_", 3, "VIDEO"], ["ref_audio_", 3, "AUDIO"]];
const GROWING_NODES = new Set(["H3StreamReferenceMedia", "H3StreamReferences"]);
// The progress-text box: 12 px text, 16 px lines, 8 px padding above and below, the widget's 10 px margin.
const LINE_HEIGHT = 16;
const TEXT_CHROME = 16 + 20;
const WIDGET_GAP = 4;
const TEXT_SIDE_PADDING = 32 + 20;

let deviceType = null; // "cpu" | "cuda" | "mps", from /system_stats
let measureContext = null;

function textWidth(text, font = "12px Inter, Arial, sans-serif") {
  if (measureContext === null && typeof document !== "undefined") {
    measureContext = document.createElement("canvas").getContext("2d");
  }
  if (!measureContext) return text.length * 7; // no DOM (tests): an average 12 px glyph
  measureContext.font = font;
  return measureContext.measureText(text).width;
}

// The box breaks text anywhere (CSS `break-all`), which splits numbers ("0.\n64 GiB") and words ("de vice"): a
// word joiner (U+2060, invisible) between the characters of each word leaves only the spaces to break at.
export function unbreakable(text) {
  return text.replace(/(\S)(?=\S)/gu, "$1\u2060");
}

// Lines the box needs for `text` at `width` pixels, breaking at spaces only (as `unbreakable` makes it).
export function wrapLines(text, width) {
  const lines = [];
  for (const paragraph of text.replaceAll("\u2060", "").split("\n")) {
    let line = "";
    for (const word of paragraph.split(" ")) {
      const candidate = line ? `${line} ${word}` : word;
      if (line && textWidth(candidate) > width) {
        lines.push(line);
        line = word;
      } else {
        line = candidate;
      }
    }
    lines.push(line);
  }
  return lines;
}

function textWidgetOf(node) {
  return node.widgets?.find((w) => w.name === TEXT_WIDGET) ?? null;
}

// The node's height without the text is remembered when the text appears, and the text's height added to it: the
// widgets keep their room; the node is given back that height when the text goes.
export function fitText(node) {
  const widget = textWidgetOf(node);
  const text = widget?.value ? String(widget.value) : "";
  if (!text) {
    if (node.h3StreamBaseHeight !== undefined) {
      node.setSize?.([node.size[0], node.h3StreamBaseHeight]);
      delete node.h3StreamBaseHeight;
    }
    node.setDirtyCanvas?.(true, true);
    return;
  }
  if (node.h3StreamBaseHeight === undefined) node.h3StreamBaseHeight = node.size[1];
  const lines = wrapLines(text, node.size[0] - TEXT_SIDE_PADDING).length;
  const height = lines * LINE_HEIGHT + TEXT_CHROME;
  // The box takes exactly its text's height (the frontend otherwise shares the node's free height between it and
  // the other growing widgets, which squeezed the prompt box), and the node grows by as much.
  widget.computeLayoutSize = () => ({ minHeight: height, maxHeight: height, minWidth: 0, maxWidth: 1e6 });
  node.setSize?.([node.size[0], node.h3StreamBaseHeight + height + WIDGET_GAP]);
  node.setDirtyCanvas?.(true, true);
}

// Shown through the frontend's own progress-text handler (which makes the box), then made unbreakable and fitted.
export function showText(node, text) {
  api.dispatchCustomEvent?.("progress_text", { nodeId: String(node.id), text });
  const widget = textWidgetOf(node);
  if (widget) {
    widget.value = unbreakable(text);
    fitText(node);
  }
}

export function clearText(node) {
  const index = node.widgets?.findIndex((w) => w.name === TEXT_WIDGET) ?? -1;
  if (index < 0) return;
  node.widgets[index].onRemove?.();
  node.widgets.splice(index, 1); // as the frontend removes it
  fitText(node);
}

function ourNodes() {
  return (app.graph?._nodes ?? []).filter((node) => NODE_IDS.has(node.comfyClass));
}

function nodeById(id) {
  if (id === undefined || id === null) return null;
  return app.graph?.getNodeById(Number(id)) ?? app.graph?.getNodeById(id) ?? null;
}

export function applyMpsVisibility(node) {
  if (!node.widgets) return;
  const hide = deviceType !== null && deviceType !== "mps";
  let changed = false;
  for (const widget of node.widgets) {
    if (widget.name?.endsWith(MPS_ONLY_SUFFIX) && Boolean(widget.hidden) !== hide) {
      widget.hidden = hide;
      changed = true;
    }
  }
  if (changed) {
    const height = node.computeSize?.()[1];
    if (height && !textWidgetOf(node)) node.setSize?.([node.size[0], height]);
    node.setDirtyCanvas?.(true, true);
  }
}

export function fitWidth(node) {
  let width = MIN_WIDTH[node.comfyClass] ?? DEFAULT_MIN_WIDTH;
  for (const widget of node.widgets ?? []) {
    if (widget.hidden || widget.name === TEXT_WIDGET || typeof widget.value === "object") continue;
    // label, value, the arrows and the margins around a combo or number widget
    width = Math.max(width, textWidth(`${widget.label ?? widget.name}`) + textWidth(`${widget.value ?? ""}`) + 90);
  }
  if (node.size[0] < width) node.setSize?.([width, node.size[1]]);
}

// H3 References: the connected sockets of each kind, and the first free one while the model takes more; the rest go.
// Sockets keep the request's order (images, videos, audios, each by number); links follow their socket.
export function growSockets(node) {
  if (!node.inputs) return;
  const isGrowing = (input) => !input.widget && GROWING.some(([prefix]) => input.name.startsWith(prefix));
  for (const [prefix, count, type] of GROWING) {
    const connected = new Set(node.inputs.filter((i) => i.name.startsWith(prefix) && i.link != null).map((i) => i.name));
    let free = null;
    for (let n = 1; n <= count && free === null; n++) if (!connected.has(`${prefix}${n}`)) free = `${prefix}${n}`;
    for (let index = node.inputs.length - 1; index >= 0; index--) {
      const input = node.inputs[index];
      if (input.name.startsWith(prefix) && !input.widget && input.link == null && input.name !== free) {
        node.removeInput(index);
      }
    }
    if (free && !node.inputs.some((i) => i.name === free)) node.addInput(free, type);
  }
  const order = (name) => {
    let rank = 0;
    for (const [prefix, count] of GROWING) {
      if (name.startsWith(prefix)) return rank + Number(name.slice(prefix.length));
      rank += count + 1;
    }
    return 0;
  };
  const others = node.inputs.filter((i) => !isGrowing(i));
  const sockets = node.inputs.filter(isGrowing).sort((a, b) => order(a.name) - order(b.name));
  node.inputs.splice(0, node.inputs.length, ...others, ...sockets);
  node.inputs.forEach((input, slot) => {
    if (input.link == null) return;
    const link = app.graph?.links?.get?.(input.link) ?? app.graph?.links?.[input.link];
    if (link) link.target_slot = slot;
  });
  const height = node.computeSize?.()[1];
  if (height && !textWidgetOf(node)) node.setSize?.([node.size[0], height]);
  node.setDirtyCanvas?.(true, true);
}

function watchNode(node) {
  // H3 Loader's plan: its UI output, sent on every run (again while the loader is cached).
  const executed = node.onExecuted;
  node.onExecuted = function (output) {
    executed?.apply(this, arguments);
    const plan = output?.h3_stream_preflight?.[0];
    if (plan) showText(this, plan);
  };
  // Widgets a dynamic combo adds after creation (the custom memory profile's) are checked when the node is drawn.
  const draw = node.onDrawForeground;
  node.onDrawForeground = function () {
    draw?.apply(this, arguments);
    applyMpsVisibility(this);
  };
  if (GROWING_NODES.has(node.comfyClass)) {
    const configured = node.onConfigure;
    node.onConfigure = function () {
      configured?.apply(this, arguments);
      growSockets(this);
    };
    const connections = node.onConnectionsChange;
    node.onConnectionsChange = function (type) {
      connections?.apply(this, arguments);
      // after the connection is complete (a link being made still points at its slot)
      if (type === (globalThis.LiteGraph?.INPUT ?? 1)) setTimeout(() => growSockets(this), 0);
    };
  }
}

app.registerExtension({
  name: "h3_stream.node_text",
  async setup() {
    try {
      const stats = await (await api.fetchApi("/system_stats")).json();
      deviceType = stats?.devices?.[0]?.type ?? null;
    } catch (error) {
      console.warn("h3-stream: /system_stats unavailable, MPS-only options stay visible", error);
    }
    for (const node of ourNodes()) applyMpsVisibility(node);
    // Every server text for our nodes: made unbreakable and fitted once the frontend has put it in its box.
    api.addEventListener("progress_text", ({ detail }) => {
      const node = nodeById(detail?.nodeId);
      if (!node || !NODE_IDS.has(node.comfyClass)) return;
      setTimeout(() => {
        const widget = textWidgetOf(node);
        if (!widget?.value) return;
        const text = unbreakable(String(widget.value).replaceAll("\u2060", ""));
        if (widget.value !== text) widget.value = text;
        fitText(node);
      }, 0);
    });
    // A node's text belongs to the run that wrote it: cleared when a run starts, given back to the nodes that run
    // takes from ComfyUI's cache (same inputs, same result; they send nothing new).
    let previous = new Map();
    api.addEventListener("execution_start", () => {
      previous = new Map();
      for (const node of ourNodes()) {
        const text = textWidgetOf(node)?.value;
        if (text) previous.set(String(node.id), String(text).replaceAll("\u2060", ""));
        clearText(node);
      }
    });
    api.addEventListener("execution_cached", ({ detail }) => {
      for (const id of detail?.nodes ?? []) {
        const node = nodeById(id);
        const text = previous.get(String(id));
        if (node && text && !textWidgetOf(node)) showText(node, text);
      }
    });
    for (const [event, words] of [["execution_error", "failed: see the error message"],
                                  ["execution_interrupted", "cancelled"]]) {
      api.addEventListener(event, ({ detail }) => {
        const node = nodeById(detail?.node_id);
        if (node && NODE_IDS.has(node.comfyClass)) showText(node, words);
      });
    }
  },
  nodeCreated(node) {
    if (!NODE_IDS.has(node.comfyClass)) return;
    watchNode(node);
    applyMpsVisibility(node);
    if (GROWING_NODES.has(node.comfyClass)) growSockets(node);
    fitWidth(node); // a loaded workflow's saved size replaces this when the node is configured
  },
});
