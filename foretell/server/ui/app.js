// foretell playground: streams a completion or a chat turn from this server's OpenAI API with
// `return_token_origins`, colours each token by how speculation produced it, and charts the
// request's acceptance and speed beside the server's load (GET /stats). The Compare view runs one
// prompt with speculation and again without (`use_speculation: false`), one after the other.
// Plain DOM and SVG: no build step, no dependencies, nothing loaded from elsewhere.
"use strict";

const MAX_SHADES = 8; // accepted-draft shades p0..p7 in style.css; deeper positions share p7
const SVG_NS = "http://www.w3.org/2000/svg";
const KEY_STORAGE = "foretell-api-key";

const state = {
  apiKey: sessionStorage.getItem(KEY_STORAGE) || "",
  info: null, // GET /stats: model, speculative {method, model, num_speculative_tokens} | null
  k: 0,
  running: null, // AbortController of the run in flight
  lastStats: null, // [time ms, generation_tokens_total] for the server's tokens/s
};

const $ = (id) => document.getElementById(id);

function el(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "className") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("data-") || key.startsWith("aria-") || key === "role") node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function fmt(value, digits = 2) {
  return value === null || value === undefined || Number.isNaN(value) ? "–" : Number(value).toFixed(digits);
}

// ------------------------------------------------------------------------------ server and key

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  if (state.apiKey) headers.Authorization = `Bearer ${state.apiKey}`;
  return headers;
}

function drafterText(spec) {
  if (!spec) return "no drafter (the server runs without speculation)";
  const source = spec.model ? ` ${spec.model.split("/").filter(Boolean).pop()}` : "";
  return `drafter ${spec.method}${source}, k = ${spec.num_speculative_tokens}`;
}

async function loadInfo() {
  try {
    const response = await fetch("/stats", { cache: "no-store" });
    const info = await response.json();
    state.info = info;
    state.k = info.speculative ? info.speculative.num_speculative_tokens : 0;
    $("server-line").textContent = `model ${info.model} · ${drafterText(info.speculative)}` +
      (info.max_model_len ? ` · max_model_len ${info.max_model_len}` : "");
    buildLegend($("legend"), state.k);
    showRun(new RunStats(state.k).summary());
    setupCompare();
    updateServer(info);
  } catch (error) {
    $("server-line").textContent = `cannot reach the server: ${error}`;
  }
  await checkKey();
}

async function checkKey() {
  const response = await fetch("/v1/models", { headers: authHeaders() });
  const form = $("key-form");
  if (response.status === 401) {
    form.hidden = false;
    $("key-status").textContent = state.apiKey ? "that key was refused" : "";
    return false;
  }
  form.hidden = true;
  return true;
}

async function pollStats() {
  if (document.hidden) return;
  try {
    const response = await fetch("/stats", { cache: "no-store" });
    if (response.ok) updateServer(await response.json());
  } catch (error) {
    /* the next poll tries again */
  }
}

function updateServer(info) {
  const stats = info.stats || {};
  const now = performance.now();
  let rate = null;
  const generated = stats.generation_tokens_total || 0;
  if (state.lastStats && now > state.lastStats[0]) {
    rate = (generated - state.lastStats[1]) / ((now - state.lastStats[0]) / 1000);
  }
  state.lastStats = [now, generated];
  const rows = [
    ["Running", stats.num_requests_running ?? "–", "server-running"],
    ["Waiting", stats.num_requests_waiting ?? "–", "server-waiting"],
    ["Generation", rate === null ? "–" : `${fmt(rate, 1)} tok/s`, "server-rate"],
  ];
  if (info.speculative) {
    rows.push(["Mean acceptance length", fmt(stats.mean_acceptance_length), "server-mal"]);
    rows.push(["Acceptance rate", stats.num_draft_tokens ? `${fmt(100 * stats.acceptance_rate, 1)}%` : "–", "server-rate-accept"]);
  }
  const dl = $("server-numbers");
  dl.replaceChildren(...rows.flatMap(([label, value, id]) => [el("dt", { text: label }), el("dd", { id, text: String(value) })]));
  const usage = Math.round(1000 * (stats.kv_cache_usage || 0)) / 10;
  $("kv-fill").style.width = `${usage}%`;
  $("kv-meter").setAttribute("aria-valuenow", String(usage));
  $("kv-text").textContent = `${usage}%`;
}

// ------------------------------------------------------------------------------------- tokens

function describe(o) {
  const token = `token ${JSON.stringify(o.token)} (id ${o.token_id})`;
  switch (o.origin) {
    case "accepted":
      return `Accepted draft · step ${o.step}\ndraft position ${o.position + 1} of ${o.num_drafts}\n${token}`;
    case "corrected":
      return `Corrected by the target · step ${o.step}\nat draft position ${o.position + 1} of ${o.num_drafts}; ` +
        `the draft said ${JSON.stringify(o.replaced_draft_token)} (id ${o.replaced_draft})\n${token}`;
    case "bonus":
      return `Bonus token from the target · step ${o.step}\nall ${o.num_drafts} drafts accepted\n${token}`;
    default:
      return `Target token · step ${o.step}\nno drafts verified this step\n${token}`;
  }
}

function tokenSpan(o) {
  const shade = o.origin === "accepted" ? ` p${Math.min(o.position, MAX_SHADES - 1)}` : "";
  const span = el("span", {
    className: `tok o-${o.origin}${shade}${o.token ? "" : " empty"}`,
    text: o.token || "∅",
    tabIndex: -1,
    "data-origin": o.origin,
    "data-step": String(o.step),
    "data-position": String(o.position),
  });
  span.origin = o;
  return span;
}

function buildLegend(container, k) {
  const items = [];
  if (k > 0) {
    const ramp = el("span", { className: "ramp" });
    for (let p = 0; p < Math.min(k, MAX_SHADES); p++) {
      ramp.append(el("span", { className: `tok o-accepted p${p}`, text: String(p + 1), title: `draft position ${p + 1}` }));
    }
    items.push(el("span", { className: "item" }, [ramp, "accepted draft (by position)"]));
    items.push(el("span", { className: "item" }, [el("span", { className: "tok o-corrected", text: "x" }), "corrected by the target"]));
    items.push(el("span", { className: "item" }, [el("span", { className: "tok o-bonus", text: "+" }), "bonus (all drafts accepted)"]));
  }
  items.push(el("span", { className: "item" }, [el("span", { className: "tok o-target", text: "t" }), "target token, no drafts that step"]));
  container.replaceChildren(...items);
}

const tooltip = () => $("tooltip");

function showTooltip(span) {
  const tip = tooltip();
  tip.textContent = describe(span.origin);
  tip.hidden = false;
  const box = span.getBoundingClientRect();
  const left = Math.min(window.scrollX + box.left, window.scrollX + document.documentElement.clientWidth - tip.offsetWidth - 8);
  tip.style.left = `${Math.max(4, left)}px`;
  tip.style.top = `${window.scrollY + box.bottom + 6}px`;
  span.setAttribute("aria-describedby", "tooltip");
}

function hideTooltip(span) {
  tooltip().hidden = true;
  if (span) span.removeAttribute("aria-describedby");
}

function wireTokens(container) {
  container.addEventListener("mouseover", (event) => {
    const span = event.target.closest(".tok");
    if (span && span.origin) showTooltip(span);
  });
  container.addEventListener("mouseout", (event) => {
    const span = event.target.closest(".tok");
    if (span && span !== document.activeElement) hideTooltip(span);
  });
  container.addEventListener("focusin", (event) => {
    if (event.target.origin) showTooltip(event.target);
  });
  container.addEventListener("focusout", (event) => hideTooltip(event.target));
  container.addEventListener("keydown", (event) => {
    const tokens = [...container.querySelectorAll(".tok")];
    if (!tokens.length) return;
    const at = tokens.indexOf(document.activeElement);
    const moves = {
      ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1, Home: 0, End: tokens.length - 1,
    };
    if (event.key === "Escape") {
      hideTooltip(document.activeElement);
      container.focus();
      event.preventDefault();
      return;
    }
    if (!(event.key in moves)) return;
    const next = tokens[Math.max(0, Math.min(tokens.length - 1, at < 0 && event.key.startsWith("Arrow") ? 0 : moves[event.key]))];
    next.focus();
    event.preventDefault();
  });
}

// -------------------------------------------------------------------------------------- a run

// What one response showed: tokens, verify steps (by step index), times.
class RunStats {
  constructor(k) {
    this.k = k;
    this.tokens = 0;
    this.tokenIds = [];
    this.steps = new Map();
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.timeline = [[0, 0]];
  }

  add(origins) {
    if (!origins.length) return;
    const now = performance.now();
    for (const o of origins) {
      this.tokens += 1;
      this.tokenIds.push(o.token_id);
      let step = this.steps.get(o.step);
      if (!step) {
        step = { numDrafts: o.num_drafts, accepted: 0 };
        this.steps.set(o.step, step);
      }
      if (o.origin === "accepted") step.accepted += 1;
    }
    if (this.first === null) this.first = now;
    this.last = now;
    this.timeline.push([(now - this.start) / 1000, this.tokens]);
  }

  summary() {
    const verifies = [...this.steps.values()].filter((s) => s.numDrafts > 0);
    const k = Math.max(this.k, ...verifies.map((s) => s.numDrafts), 0);
    const perPosition = new Array(k).fill(0);
    const histogram = new Array(k + 1).fill(0);
    let draftTokens = 0;
    let accepted = 0;
    for (const s of verifies) {
      for (let p = 0; p < s.accepted; p++) perPosition[p] += 1;
      histogram[s.accepted] += 1;
      draftTokens += s.numDrafts;
      accepted += s.accepted;
    }
    const seconds = this.last === null ? null : (this.last - this.start) / 1000;
    return {
      tokens: this.tokens,
      verifies: verifies.length,
      draftTokens,
      accepted,
      perPosition,
      perPositionRate: perPosition.map((a) => (verifies.length ? a / verifies.length : 0)),
      histogram,
      meanAcceptanceLength: verifies.length ? 1 + accepted / verifies.length : null,
      acceptanceRate: draftTokens ? accepted / draftTokens : null,
      seconds,
      ttft: this.first === null ? null : (this.first - this.start) / 1000,
      tokensPerSecond: seconds ? this.tokens / seconds : null,
    };
  }
}

function requestBody(opts) {
  const body = {
    model: state.info ? state.info.model : undefined,
    max_tokens: opts.maxTokens,
    temperature: opts.temperature,
    stream: true,
    stream_options: { include_usage: true },
    return_token_origins: true,
    use_speculation: opts.speculate,
    ignore_eos: opts.ignoreEos,
  };
  if (opts.chat) body.messages = [{ role: "user", content: opts.prompt }];
  else body.prompt = opts.prompt;
  return body;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch (error) {
    return `HTTP ${response.status}`;
  }
}

// Streams one request into `container`, calling onUpdate(stats) after each chunk. Resolves with
// {stats, usage, finishReason}; throws on an HTTP or stream error.
async function streamRun(opts, container, onUpdate, signal) {
  const stats = new RunStats(state.k);
  container.replaceChildren();
  hideTooltip();
  const path = opts.chat ? "/v1/chat/completions" : "/v1/completions";
  const response = await fetch(path, {
    method: "POST", headers: authHeaders(), body: JSON.stringify(requestBody(opts)), signal,
  });
  if (response.status === 401) {
    $("key-form").hidden = false;
    $("api-key").focus();
    throw new Error("this server needs an API key: enter it above");
  }
  if (!response.ok) throw new Error(await errorMessage(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let usage = null;
  let finishReason = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const origins = choice.token_origins || [];
        if (origins.length) {
          container.append(...origins.map(tokenSpan));
          stats.add(origins);
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
      onUpdate(stats);
    }
  }
  const first = container.querySelector(".tok");
  if (first) first.tabIndex = 0;
  return { stats, usage, finishReason };
}

function readOptions(prefix) {
  const chat = prefix === "compare" ? $("compare-chat").checked
    : document.querySelector('input[name="mode"]:checked').value === "chat";
  const id = (name) => (prefix === "compare" ? `compare-${name}` : name);
  const maxTokens = Number.parseInt($(id("max-tokens")).value, 10);
  const temperature = Number.parseFloat($(id("temperature")).value);
  const prompt = $(id("prompt")).value;
  if (!prompt.trim()) throw new Error("write a prompt first");
  if (!Number.isInteger(maxTokens) || maxTokens < 1) throw new Error("max tokens must be a whole number >= 1");
  if (!(temperature >= 0)) throw new Error("temperature must be a number >= 0");
  return { chat, maxTokens, temperature, prompt, ignoreEos: $(id("ignore-eos")).checked, speculate: true };
}

// ------------------------------------------------------------------------------------- charts

function barChart(node, values, labels, opts) {
  const width = 320;
  const height = 130;
  const pad = { left: 28, right: 6, top: 14, bottom: 20 };
  node.setAttribute("viewBox", `0 0 ${width} ${height}`);
  node.replaceChildren();
  const max = opts.max ?? Math.max(1, ...values);
  node.append(svg("line", { class: "axis", x1: pad.left, y1: height - pad.bottom, x2: width - pad.right, y2: height - pad.bottom }));
  node.append(svg("text", { class: "label", x: 2, y: pad.top + 4 }, opts.maxLabel ?? String(max)));
  node.append(svg("text", { class: "label", x: 2, y: height - pad.bottom }, "0"));
  if (!values.length) {
    node.append(svg("text", { class: "empty-label", x: pad.left + 8, y: height / 2 }, opts.empty || "no data"));
    return;
  }
  const slot = (width - pad.left - pad.right) / values.length;
  const inner = height - pad.top - pad.bottom;
  values.forEach((value, i) => {
    const h = max ? (inner * value) / max : 0;
    const x = pad.left + i * slot + slot * 0.15;
    const rect = svg("rect", {
      class: "bar", x, y: height - pad.bottom - h, width: slot * 0.7, height: Math.max(h, 0),
      "data-index": i, "data-value": value,
    });
    rect.append(svg("title", {}, `${labels[i]}: ${opts.format(value)}`));
    node.append(rect);
    node.append(svg("text", { class: "value-label", x: x + slot * 0.35, y: height - pad.bottom - h - 3, "text-anchor": "middle" }, opts.format(value)));
    node.append(svg("text", { class: "label", x: x + slot * 0.35, y: height - 6, "text-anchor": "middle" }, labels[i]));
  });
  node.setAttribute("aria-label", `${opts.title}: ${values.map((v, i) => `${labels[i]} ${opts.format(v)}`).join(", ")}`);
}

function lineChart(node, series) {
  const width = 320;
  const height = 110;
  const pad = { left: 28, right: 6, top: 10, bottom: 18 };
  node.setAttribute("viewBox", `0 0 ${width} ${height}`);
  node.replaceChildren();
  const points = series.flatMap((s) => s.points);
  const maxT = Math.max(0.001, ...points.map((p) => p[0]));
  const maxN = Math.max(1, ...points.map((p) => p[1]));
  node.append(svg("line", { class: "axis", x1: pad.left, y1: height - pad.bottom, x2: width - pad.right, y2: height - pad.bottom }));
  node.append(svg("text", { class: "label", x: 2, y: pad.top + 4 }, String(maxN)));
  node.append(svg("text", { class: "label", x: width - pad.right, y: height - 4, "text-anchor": "end" }, `${fmt(maxT, 1)} s`));
  for (const s of series) {
    const coords = s.points.map(([t, n]) => {
      const x = pad.left + ((width - pad.left - pad.right) * t) / maxT;
      const y = height - pad.bottom - ((height - pad.top - pad.bottom) * n) / maxN;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    node.append(svg("polyline", { class: `line ${s.className || ""}`, points: coords.join(" ") }));
  }
}

function numberTiles(container, items) {
  container.replaceChildren(...items.map(([label, value, key]) => el("div", { className: "num" }, [
    el("span", { className: "label", text: label }),
    el("span", { className: "value", text: value, "data-key": key }),
  ])));
}

function showRun(summary) {
  numberTiles($("play-numbers"), [
    ["Mean acceptance length", fmt(summary.meanAcceptanceLength), "mean-acceptance-length"],
    ["Tokens/s", fmt(summary.tokensPerSecond, 1), "tokens-per-second"],
    ["Tokens", String(summary.tokens), "tokens"],
    ["Verify steps", String(summary.verifies), "verifies"],
    ["Accepted drafts", `${summary.accepted} / ${summary.draftTokens}`, "accepted"],
    ["Time to first token", summary.ttft === null ? "–" : `${fmt(summary.ttft * 1000, 0)} ms`, "ttft"],
  ]);
  const k = summary.perPosition.length;
  barChart($("chart-position"), summary.perPositionRate, summary.perPosition.map((_, i) => `pos ${i + 1}`), {
    max: 1, maxLabel: "1", format: (v) => `${Math.round(100 * v)}%`, title: "Acceptance per draft position",
    empty: k ? "no verify steps yet" : "no drafter on this server",
  });
  $("chart-position").dataset.accepted = JSON.stringify(summary.perPosition);
  $("chart-position").dataset.verifies = String(summary.verifies);
  barChart($("chart-histogram"), k ? summary.histogram : [], summary.histogram.map((_, i) => String(i)), {
    format: (v) => String(v), title: "Verify steps by accepted drafts",
    empty: k ? "no verify steps yet" : "no drafter on this server",
  });
}

// ---------------------------------------------------------------------------------- playground

async function runPlayground(event) {
  event.preventDefault();
  if (state.running) return;
  const status = $("play-status");
  status.classList.remove("error");
  let opts;
  try {
    opts = readOptions("play");
  } catch (error) {
    status.textContent = error.message;
    status.classList.add("error");
    return;
  }
  opts.speculate = $("speculate").checked;
  const controller = new AbortController();
  state.running = controller;
  $("run").disabled = true;
  $("stop").disabled = false;
  status.textContent = "Generating…";
  delete $("output").dataset.done; // set again when this run completes
  delete $("output").dataset.completionTokens;
  let latest = null;
  const draw = (stats) => {
    latest = stats.summary();
    showRun(latest);
    lineChart($("chart-timeline"), [{ points: stats.timeline }]);
  };
  try {
    const result = await streamRun(opts, $("output"), draw, controller.signal);
    draw(result.stats);
    const usage = result.usage ? result.usage.completion_tokens : result.stats.tokens;
    $("output").dataset.completionTokens = String(usage);
    status.textContent = `Done: ${result.stats.tokens} tokens, finish reason ${result.finishReason || "–"}` +
      (latest && latest.tokensPerSecond ? `, ${fmt(latest.tokensPerSecond, 1)} tokens/s` : "") + ".";
    $("output").dataset.done = "true";
  } catch (error) {
    status.textContent = error.name === "AbortError" ? "Stopped." : `Error: ${error.message}`;
    if (error.name !== "AbortError") status.classList.add("error");
  } finally {
    state.running = null;
    $("run").disabled = false;
    $("stop").disabled = true;
    pollStats();
  }
}

// ------------------------------------------------------------------------------------- compare

function setupCompare() {
  const note = $("compare-note");
  const button = $("compare-run");
  if (!state.info.speculative) {
    note.textContent = "This server runs without a drafter, so there is no speculation to compare: " +
      "start foretell serve with --speculative-config (or --method) to compare.";
    button.disabled = true;
    return;
  }
  note.textContent = `Runs the prompt with the server's drafter (${drafterText(state.info.speculative)}), then again ` +
    "without speculation (use_speculation: false), one after the other so neither slows the other. " +
    "A server holds one drafter: to compare two drafters, run two servers.";
  $("pane-a-title").textContent = `With speculation (${state.info.speculative.method}, k = ${state.k})`;
}

function paneNumbers(pane, summary, withDrafts) {
  const items = [
    ["Tokens/s", fmt(summary.tokensPerSecond, 1), "tokens-per-second"],
    ["Time", summary.seconds === null ? "–" : `${fmt(summary.seconds, 2)} s`, "seconds"],
    ["Tokens", String(summary.tokens), "tokens"],
  ];
  if (withDrafts) {
    items.push(["Mean acceptance length", fmt(summary.meanAcceptanceLength), "mean-acceptance-length"]);
    items.push(["Verify steps", String(summary.verifies), "verifies"]);
    items.push(["Acceptance rate", summary.acceptanceRate === null ? "–" : `${fmt(100 * summary.acceptanceRate, 1)}%`, "acceptance-rate"]);
  } else {
    items.push(["Target steps", String(summary.tokens), "steps"]);
  }
  numberTiles(pane.querySelector(".numbers"), items);
}

async function runCompare(event) {
  event.preventDefault();
  if (state.running) return;
  const summaryLine = $("compare-summary");
  summaryLine.classList.remove("error");
  let opts;
  try {
    opts = readOptions("compare");
  } catch (error) {
    summaryLine.textContent = error.message;
    summaryLine.classList.add("error");
    return;
  }
  const controller = new AbortController();
  state.running = controller;
  $("compare-run").disabled = true;
  const panes = [$("pane-a"), $("pane-b")];
  delete summaryLine.dataset.same;
  panes.forEach((pane) => pane.querySelector(".numbers").replaceChildren());
  const results = [];
  try {
    for (const [i, speculate] of [[0, true], [1, false]]) {
      summaryLine.textContent = speculate ? "Running with speculation…" : "Running without speculation…";
      const pane = panes[i];
      const result = await streamRun({ ...opts, speculate }, pane.querySelector(".tokens"),
        (stats) => paneNumbers(pane, stats.summary(), speculate), controller.signal);
      paneNumbers(pane, result.stats.summary(), speculate);
      results.push(result);
    }
    const [a, b] = results.map((r) => r.stats.summary());
    const same = results[0].stats.tokenIds.join(",") === results[1].stats.tokenIds.join(",");
    const speedup = a.tokensPerSecond && b.tokensPerSecond ? a.tokensPerSecond / b.tokensPerSecond : null;
    summaryLine.textContent = `Speculation: ${fmt(a.tokensPerSecond, 1)} tokens/s against ${fmt(b.tokensPerSecond, 1)} ` +
      `without (${fmt(speedup)}×), ${a.verifies} verify steps for ${a.tokens} tokens against ${b.tokens} target steps. ` +
      (opts.temperature === 0
        ? (same ? "Same tokens both ways, as exact speculative decoding promises."
          : "The tokens differ: with greedy decoding they should not; please report this.")
        : "Sampled output: the two runs draw different tokens (the distribution is the same).");
    summaryLine.dataset.same = String(same);
  } catch (error) {
    summaryLine.textContent = error.name === "AbortError" ? "Stopped." : `Error: ${error.message}`;
    summaryLine.classList.add("error");
  } finally {
    state.running = null;
    $("compare-run").disabled = false;
    pollStats();
  }
}

// ------------------------------------------------------------------------------------ the page

function selectTab(tab) {
  for (const other of document.querySelectorAll('[role="tab"]')) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    $(other.getAttribute("aria-controls")).hidden = !selected;
  }
  tab.focus();
}

function wireTabs() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const moves = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 };
      if (!(event.key in moves)) return;
      selectTab(tabs[(moves[event.key] + tabs.length) % tabs.length]);
      event.preventDefault();
    });
  });
}

function main() {
  wireTabs();
  for (const container of document.querySelectorAll(".tokens")) wireTokens(container);
  $("play-form").addEventListener("submit", runPlayground);
  $("compare-form").addEventListener("submit", runCompare);
  $("stop").addEventListener("click", () => state.running && state.running.abort());
  for (const id of ["prompt", "compare-prompt"]) {
    $(id).addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        event.target.form.requestSubmit();
      }
    });
  }
  $("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    state.apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORAGE, state.apiKey);
    $("key-status").textContent = (await checkKey()) ? "" : "that key was refused";
  });
  showRun(new RunStats(0).summary());
  lineChart($("chart-timeline"), [{ points: [[0, 0]] }]);
  loadInfo();
  setInterval(pollStats, 1000);
}

document.addEventListener("DOMContentLoaded", main);
