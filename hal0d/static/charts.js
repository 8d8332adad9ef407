// The status page's pictures of the last hour, hand-written SVG drawn from GET /api/timeline:
// the timeline of each group's slots, per-slot charts, each group's memory. Every mark and point
// carries its value in data-* attributes and a <title>, so what is drawn can be read back as text.

const NS = "http://www.w3.org/2000/svg";
export const WINDOW_S = 3600;
const MIN_WINDOW_S = 180;

// Seconds the pictures span: the hour, or (at least MIN_WINDOW_S) since hal0d started when that
// is shorter and no older minute is kept, so a young hal0d's minutes fill the width.
export function windowOf(data, now) {
  const first = Math.min(data.kept_since, ...data.minutes.map((m) => m.ts));
  return Math.min(WINDOW_S, Math.max(MIN_WINDOW_S, now - first));
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  return fill(node, attrs, children);
}

export function svg(tag, attrs = {}, ...children) {
  return fill(document.createElementNS(NS, tag), attrs, children);
}

function fill(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.setAttribute("class", value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

const title = (text) => svg("title", {}, text);
export const clock = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
const hhmm = (ts) => clock(ts).slice(0, 5);
const fixed = (v) => (Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1).replace(/\.0$/, "")
  : v.toFixed(2).replace(/\.?0+$/, ""));

export function formatMs(v) {
  if (v === null || v === undefined) return "–";
  return v < 1000 ? `${fixed(v)} ms` : `${fixed(v / 1000)} s`;
}

export function span(seconds) {
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${fixed(seconds)} s`;
  return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
}

function niceMax(value, counts = false) {
  if (!(value > 0)) return counts ? 2 : 1;
  if (counts && value <= 2) return 2;
  const power = 10 ** Math.floor(Math.log10(value));
  return (counts ? [1, 2, 4, 6, 10] : [1, 2, 2.5, 5, 10]).map((m) => m * power).find((top) => value <= top);
}

// The x ticks on round minutes of the clock, as many as fit with room between their labels.
function timeTicks(start, end, width) {
  const step = 60 * ([1, 2, 5, 10, 20, 30].find((m) => (end - start) / (60 * m) <= width / 100) || 60);
  const ticks = [];
  for (let t = Math.ceil(start / step) * step; t <= end; t += step) ticks.push(t);
  return ticks;
}

// -- the timeline --

const ROW = 26;
const TOP = 4;

function describe(event) {
  const at = clock(event.ts);
  switch (event.kind) {
    case "load": return `${event.slot}: load began at ${at}`;
    case "loaded": return `${event.slot}: loaded at ${at}, in ${span(event.elapsed_s || 0)}`;
    case "load_failed": return `${event.slot}: load failed at ${at} after ${span(event.elapsed_s || 0)}: ${event.reason}`;
    case "unload": return `${event.slot}: unloaded at ${at} (${event.reason})`
      + (event.loaded_s ? ` after ${span(event.loaded_s)} loaded` : "");
    case "stopped": return `${event.slot}: stopped at ${at}${event.reason ? `: ${event.reason}` : ""}`;
    case "error": return `${event.slot}: in error from ${at}${event.reason ? `: ${event.reason}` : ""}`;
    case "recovered": return `${event.slot}: answering again at ${at}`;
    case "swap": return `${event.group}: swap ${event.phase} at ${at}, ${event.victim || "–"} for ${event.slot}`
      + (event.reason ? ` (${event.reason})` : "");
    default: return `${event.slot}: ${event.kind.replaceAll("_", " ")} at ${at}`;
  }
}

function spanText(item, now) {
  const end = item.to === null ? now : item.to;
  const what = item.state === "loading" ? (item.outcome === "failed" ? "a failed load" : "loading")
    : item.state === "error" ? "in error" : "loaded";
  return `${item.slot}: ${what} from ${clock(item.from)} to ${item.to === null ? "now" : clock(item.to)} (${span(end - item.from)})`;
}

// The rows: each group's slots under the group's name, then the slots of no group.
export function rowsOf(data) {
  const groups = new Map();
  for (const slot of data.slots) {
    const key = slot.group || "";
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(slot.name);
  }
  const rows = [];
  const named = [...groups.keys()].filter(Boolean).sort();
  for (const group of named) {
    rows.push({ group });
    for (const name of groups.get(group)) rows.push({ slot: name });
  }
  if (groups.has("")) {
    if (named.length) rows.push({ group: "" });
    for (const name of groups.get("")) rows.push({ slot: name });
  }
  return rows;
}

// A swap planned or started, with no `done` after it: drawn as waiting at the right edge.
function pendingSwaps(events) {
  const open = new Map();
  for (const event of events) {
    if (event.kind !== "swap") continue;
    if (event.phase === "done") open.delete(event.group);
    else open.set(event.group, event);
  }
  return [...open.values()];
}

export function timeline(data, start, now, width, picked) {
  const labelW = width < 500 ? 70 : 120;
  const x = (ts) => labelW + ((Math.max(ts, start) - start) / (now - start)) * (width - labelW - 8);
  const rows = rowsOf(data);
  const height = TOP + rows.length * ROW + 20;
  const root = svg("svg", { class: "timeline", width, height, viewBox: `0 0 ${width} ${height}`,
    role: "img", "aria-label": "loads and unloads of the last hour, per slot" });
  const rowOf = new Map();
  rows.forEach((row, i) => {
    const y = TOP + i * ROW;
    if (row.group !== undefined) {
      root.append(svg("text", { class: "group-label", x: 0, y: y + 17 }, row.group ? `group ${row.group}` : "no group"));
      return;
    }
    rowOf.set(row.slot, y);
    const label = row.slot.length > labelW / 7.5 ? `${row.slot.slice(0, Math.floor(labelW / 7.5) - 1)}…` : row.slot;
    root.append(svg("rect", { class: "lane", "data-slot": row.slot, x: labelW, y: y + 4, width: width - labelW - 8, height: ROW - 8 }),
      svg("text", { class: "slot-label", x: 6, y: y + 17 }, label, title(row.slot)));
  });
  if (data.kept_since > start + 30) {
    // Before hal0d started (or past what it keeps), no load or unload is known: said, not blank.
    const known = `nothing known of loads before ${clock(data.kept_since)}, when hal0d started`;
    root.append(svg("rect", { class: "unknown", x: labelW, y: TOP, width: x(data.kept_since) - labelW,
      height: rows.length * ROW, "data-detail": known }, title(known)));
  }
  for (const tick of timeTicks(start, now, width).filter((t) => x(t) < width - 18)) {
    root.append(svg("line", { class: "grid", x1: x(tick), x2: x(tick), y1: TOP, y2: height - 18 }),
      svg("text", { class: "axis", x: x(tick), y: height - 4, "text-anchor": "middle" }, hhmm(tick)));
  }
  for (const item of data.spans) {
    const y = rowOf.get(item.slot);
    if (y === undefined) continue;
    const x0 = x(item.from);
    const x1 = x(item.to === null ? now : item.to);
    const kind = item.state === "loading" && item.outcome === "failed" ? "failed" : item.state;
    root.append(svg("rect", { class: `span ${kind}`, x: x0, y: y + 6, width: Math.max(2, x1 - x0), height: ROW - 12,
      "data-slot": item.slot, "data-state": item.state, "data-from": item.from, "data-to": item.to ?? "",
      "data-detail": spanText(item, now) }, title(spanText(item, now))));
  }
  // A mark's word goes where it covers neither another word nor another mark of its row.
  const labels = new Map();
  const shown = data.events.filter((event) => rowOf.has(event.slot) && event.kind !== "load");
  for (const event of shown) labels.set(event.slot, [...labels.get(event.slot) || [], [x(event.ts) - 5, x(event.ts) + 5, event]]);
  for (const event of shown) {
    const y = rowOf.get(event.slot);
    const at = x(event.ts);
    const attrs = { "data-x": at.toFixed(1), "data-slot": event.slot, "data-kind": event.kind, "data-reason": event.reason ?? "",
      "data-ts": event.ts, "data-detail": describe(event) };
    const cls = { load_failed: "failed", unload: "unload", loaded: "loaded", recovered: "loaded", swap: "swap",
      error: "error" }[event.kind] || "other";
    const shape = event.kind === "load_failed"
      ? svg("path", { d: `M${at - 4},${y + 5}l8,8m0,-8l-8,8` })
      : event.kind === "swap" ? svg("path", { d: `M${at},${y + 4}l4,5l-4,5l-4,-5z` })
        : ["loaded", "recovered"].includes(event.kind) ? svg("path", { d: `M${at},${y + 4}l4,6h-8z` })
          : svg("path", { d: `M${at},${y + ROW - 4}l4,-6h-8z` });
    const mark = svg("g", { class: `mark ${cls}`, ...attrs }, title(describe(event)),
      svg("rect", { class: "hit", x: at - 7, y: y + 2, width: 14, height: ROW - 4 }), shape);
    const word = event.kind === "unload" ? event.reason
      : { load_failed: "failed", error: "error" }[event.kind] || null;
    if (word) {
      // Right of the mark, or left of it near the window's end; none where it would overlap.
      const wide = word.length * 6;
      const left = at + 6 + wide > width - 8;
      const from = left ? at - 6 - wide : at + 6;
      const taken = labels.get(event.slot);
      if (from > labelW && !taken.some(([a, b, other]) => other !== event && from < b + 3 && from + wide > a - 3)) {
        mark.append(svg("text", { class: "mark-label", x: left ? at - 6 : at + 6, y: y + 17,
          "text-anchor": left ? "end" : "start" }, word));
        labels.set(event.slot, [...taken, [from, from + wide]]);
      }
    }
    root.append(mark);
  }
  for (const swap of pendingSwaps(data.events)) {
    const y = rowOf.get(swap.slot);
    if (y === undefined) continue;
    root.append(svg("g", { class: "mark pending", "data-kind": "swap_pending", "data-slot": swap.slot,
      "data-detail": `${describe(swap)}: waiting` }, title(`${describe(swap)}: waiting`),
    svg("line", { x1: x(swap.ts), x2: x(now), y1: y + ROW / 2, y2: y + ROW / 2 })));
  }
  if (picked) root.append(pickedMarks(picked, rowOf, x, height));
  return root;
}

// Where a request sat: queued, loading (its slot's load), serving; at least a few pixels wide.
function pickedMarks(row, rowOf, x, height) {
  const end = row.ts;
  const queued = (row.queue_ms || 0) / 1000;
  const loading = Math.min(queued, (row.load_ms || 0) / 1000);
  const begin = end - Math.max(queued, (row.total_ms || 0) / 1000);
  const y = rowOf.get(row.slot);
  const group = svg("g", { class: "picked", "data-request-id": row.request_id, "data-slot": row.slot, "data-ts": row.ts },
    svg("line", { class: "guide", x1: x(end), x2: x(end), y1: TOP, y2: height - 18 }));
  if (y === undefined) return group;
  const parts = [["queued", begin, begin + queued - loading], ["loading", begin + queued - loading, begin + queued],
    ["serving", begin + queued, end]];
  for (const [phase, from, to] of parts) {
    if (to <= from) continue;
    group.append(svg("rect", { class: `part ${phase}`, "data-phase": phase, x: x(from), y: y + 2,
      width: Math.max(1, x(to) - x(from)), height: ROW - 4 }));
  }
  group.append(svg("rect", { class: "halo", x: x(begin) - 3, y: y + 1, width: Math.max(6, x(end) - x(begin) + 6), height: ROW - 2 }));
  return group;
}

export function pickedText(row) {
  const queued = (row.queue_ms || 0) - (row.load_ms || 0);
  const serving = (row.total_ms || 0) - (row.queue_ms || 0);
  const begin = row.ts - (row.total_ms || 0) / 1000;
  return `request ${row.request_id} (${row.model || "–"} on ${row.slot || "no slot"}): ${clock(begin)} to ${clock(row.ts)}; `
    + `queued ${formatMs(queued)}, loading ${formatMs(row.load_ms || 0)}, serving ${formatMs(serving)}`;
}

// -- the charts --

const CHARTS = [
  // Only a stream has a first token, and a speed after it: a minute of whole answers has none.
  { key: "tokens_per_s", name: "tokens per second", unit: "tok/s", format: (v) => `${fixed(v)}`, streamsOnly: true },
  { key: "ttft_ms", name: "time to first token", unit: "", format: formatMs, streamsOnly: true },
  { key: "requests", name: "requests per minute", unit: "ok / errors", format: (v) => `${fixed(v)}` },
  { key: "queue_ms", name: "queue wait", unit: "", format: formatMs },
];

function frame(width, height, start, now, top, format) {
  const left = 52;
  const bottom = height - 18;
  // Inside the frame: a minute's point (its middle) is at now while the minute lasts.
  const x = (ts) => left + ((Math.min(Math.max(ts, start), now) - start) / (now - start)) * (width - left - 6);
  const y = (v) => bottom - (v / top) * (bottom - 8);
  const root = svg("svg", { class: "chart", width, height, viewBox: `0 0 ${width} ${height}` });
  for (const v of [0, top / 2, top]) {
    root.append(svg("line", { class: "grid", x1: left, x2: width - 6, y1: y(v), y2: y(v) }),
      svg("text", { class: "axis y", x: left - 4, y: y(v) + 3, "text-anchor": "end" }, format(v)));
  }
  for (const tick of timeTicks(start, now, width).filter((t) => x(t) > left + 16 && x(t) < width - 18)) {
    root.append(svg("text", { class: "axis", x: x(tick), y: height - 4, "text-anchor": "middle" }, hhmm(tick)));
  }
  root.append(svg("line", { class: "axis-line", x1: left, x2: left, y1: 8, y2: bottom }),
    svg("line", { class: "axis-line", x1: left, x2: width - 6, y1: bottom, y2: bottom }));
  return { root, x, y, bottom };
}

function lineChart(chart, minutes, start, now, width, height) {
  const values = minutes.flatMap((m) => [m[chart.key].p50, m[chart.key].p95]).filter((v) => v !== null);
  const top = niceMax(Math.max(0, ...values));
  const { root, x, y } = frame(width, height, start, now, top, chart.format);
  for (const series of ["p95", "p50"]) {
    const points = minutes.filter((m) => m[chart.key][series] !== null);
    if (points.length > 1) {
      root.append(svg("polyline", { class: `line ${series}`,
        points: points.map((m) => `${x(m.ts + 30).toFixed(1)},${y(m[chart.key][series]).toFixed(1)}`).join(" ") }));
    }
    for (const m of points) {
      const value = m[chart.key][series];
      const text = `${hhmm(m.ts)}: ${series} ${chart.format(value)}${chart.unit ? ` ${chart.unit}` : ""}`;
      root.append(svg("circle", { class: `point ${series}`, cx: x(m.ts + 30), cy: y(value), r: series === "p50" ? 3 : 2.5,
        "data-minute": m.ts, "data-series": series, "data-value": value }, title(text)));
    }
  }
  return root;
}

function barChart(chart, minutes, start, now, width, height) {
  const top = niceMax(Math.max(0, ...minutes.map((m) => m.requests)), true);
  const { root, x, y, bottom } = frame(width, height, start, now, top, chart.format);
  for (const m of minutes) {
    const barW = Math.max(2, x(m.ts + 60) - x(m.ts) - 1);
    const text = `${hhmm(m.ts)}: ${m.ok} ok, ${m.errors} ${m.errors === 1 ? "error" : "errors"}`;
    root.append(svg("rect", { class: "bar ok", x: x(m.ts), y: y(m.ok), width: barW, height: bottom - y(m.ok),
      "data-minute": m.ts, "data-series": "ok", "data-value": m.ok }, title(text)),
    svg("rect", { class: "bar errors", x: x(m.ts), y: y(m.ok + m.errors), width: barW, height: y(m.ok) - y(m.ok + m.errors),
      "data-minute": m.ts, "data-series": "errors", "data-value": m.errors }, title(text)));
  }
  return root;
}

// Each minute with requests as one tall target: a finger finds it, and so does a pointer.
function hits(root, minutes, start, now, width) {
  const x = (ts) => 52 + ((Math.min(ts, now) - start) / (now - start)) * (width - 58);
  const w = Math.max(6, x(start + 60) - x(start));
  for (const m of minutes) {
    root.append(svg("rect", { class: "hit", x: x(m.ts + 30) - w / 2, y: 0, width: w, height: "100%", "data-minute": m.ts },
      title(`${hhmm(m.ts)}: ${m.requests} requests; show them`)));
  }
}

function latest(chart, minutes) {
  const last = minutes[minutes.length - 1];
  if (!last) return "none";
  if (chart.key === "requests") {
    return `${hhmm(last.ts)}: ${last.ok} ok, ${last.errors} ${last.errors === 1 ? "error" : "errors"}`;
  }
  const v = last[chart.key];
  if (chart.streamsOnly && v.p50 === null) return `${hhmm(last.ts)}: streams only`;
  const unit = chart.unit ? ` ${chart.unit}` : "";
  return `${hhmm(last.ts)}: p50 ${v.p50 === null ? "–" : chart.format(v.p50) + unit}, p95 ${v.p95 === null ? "–" : chart.format(v.p95) + unit}`;
}

// One slot's four charts into `card` (already in the page, so its width is known).
export function drawSlotCharts(card, name, data, start, now) {
  const minutes = data.minutes.filter((m) => m.slot === name && m.ts >= start - 60);
  const total = minutes.reduce((sum, m) => sum + m.requests, 0);
  const errors = minutes.reduce((sum, m) => sum + m.errors, 0);
  const when = now - start < WINDOW_S ? "since hal0d started" : "in the last hour";
  card.replaceChildren(el("h3", {}, name, el("span", { class: "muted" },
    total ? ` ${total} requests, ${errors} error${errors === 1 ? "" : "s"} ${when}` : ` no requests ${when}`)));
  if (!total) return;
  const grid = el("div", { class: "quad" });
  card.append(grid);
  // Every cell is placed before any is drawn: the grid's columns, and so each width, are final.
  const cells = CHARTS.map((chart) => {
    const cell = el("figure", { class: "chart-cell", "data-chart": chart.key });
    const legend = chart.key === "requests"
      ? [el("span", { class: "key ok" }, "ok"), el("span", { class: "key errors" }, "errors")]
      : [el("span", { class: "key p50" }, "p50"), el("span", { class: "key p95" }, "p95")];
    cell.append(el("figcaption", {}, el("b", {}, chart.name), chart.unit && chart.key !== "requests" ? ` (${chart.unit})` : "",
      " ", legend, el("span", { class: "latest" }, latest(chart, minutes))));
    grid.append(cell);
    return cell;
  });
  CHARTS.forEach((chart, i) => {
    const width = Math.max(200, cells[i].clientWidth);
    const drawn = chart.key === "requests" ? barChart(chart, minutes, start, now, width, 120)
      : lineChart(chart, minutes, start, now, width, 120);
    hits(drawn, minutes, start, now, width);
    cells[i].append(drawn);
  });
}

// -- memory --

export function drawMemory(card, group, data, start, now) {
  const sizes = new Map(data.slots.map((slot) => [slot.name, slot.memory_mib || 0]));
  const spans = data.spans.filter((s) => group.members.includes(s.slot));
  const cuts = [...new Set([start, now, ...spans.flatMap((s) => [s.from, s.to ?? now])])]
    .filter((t) => t >= start && t <= now).sort((a, b) => a - b);
  const steps = cuts.slice(0, -1).map((from, i) => {
    const to = cuts[i + 1];
    const loaded = group.members.filter((name) => spans.some((s) => s.slot === name && s.from <= from && (s.to ?? now) >= to));
    return { from, to, loaded };
  });
  const peak = Math.max(0, ...steps.map((step) => step.loaded.reduce((sum, name) => sum + sizes.get(name), 0)));
  const top = niceMax(Math.max(group.memory_mib || 0, group.free_mib || 0, peak));
  // "25000 MiB" is wider than the axis's margin.
  const format = (v) => (v >= 10000 ? `${fixed(v / 1000)}k MiB` : `${Math.round(v)} MiB`);
  const budget = group.memory_mib ? `, budget ${group.memory_mib} MiB` : "";
  const free = group.free_mib === null ? "" : `; ${group.free_mib} MiB free at ${clock(group.free_at)} by free_memory_command`;
  card.replaceChildren(el("h3", {}, `group ${group.name}`),
    el("p", { class: "memory-now", "data-used": group.used_mib, "data-budget": group.memory_mib ?? "", "data-free": group.free_mib ?? "" },
      `now ${group.used_mib} MiB loaded (${group.loaded.map((item) => `${item.slot} ${item.memory_mib ?? "?"}`).join(", ") || "none"})${budget}${free}`));
  const cell = el("figure", { class: "chart-cell", "data-chart": "memory" });
  card.append(cell);
  const width = Math.max(200, cell.clientWidth);
  const { root, x, y } = frame(width, 120, start, now, top, format);
  const order = group.members;
  steps.forEach((step) => {
    let base = 0;
    for (const name of order) {
      if (!step.loaded.includes(name)) continue;
      const mib = sizes.get(name);
      root.append(svg("rect", { class: `mem m${order.indexOf(name) % 4}`, x: x(step.from), y: y(base + mib),
        width: Math.max(1, x(step.to) - x(step.from)), height: y(base) - y(base + mib), "data-slot": name },
      title(`${name}: ${mib} MiB, ${clock(step.from)} to ${clock(step.to)}`)));
      base += mib;
    }
  });
  if (group.memory_mib) {
    root.append(svg("line", { class: "budget", x1: x(start), x2: x(now), y1: y(group.memory_mib), y2: y(group.memory_mib) },
      title(`budget: ${group.memory_mib} MiB`)));
  }
  if (group.free_mib !== null) {
    root.append(svg("circle", { class: "free", cx: x(Math.min(now, group.free_at)), cy: y(group.free_mib), r: 4 },
      title(`free by free_memory_command: ${group.free_mib} MiB at ${clock(group.free_at)}`)));
  }
  cell.append(el("figcaption", {}, el("b", {}, "memory"), " ",
    order.map((name, i) => el("span", { class: `key m${i % 4}` }, `${name} ${sizes.get(name)} MiB`)),
    group.memory_mib ? el("span", { class: "key budget" }, "budget") : null,
    group.free_mib !== null ? el("span", { class: "key free" }, "free") : null), root);
}
