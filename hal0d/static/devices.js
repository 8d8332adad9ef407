// The status page's Devices section: each GPU of GET /api/devices as a card with one bar of its
// memory (what each slot's processes hold, what other programs hold, what is free, and the
// margin a load leaves spare), the same in words, and its free memory over the last hour.
// /api/devices is not on the event feed (a reading is not an event): it is read every POLL_MS
// while the page is in view. A hal0d that reads no devices (no GPU, no devices_command) says
// source: null, and the section stays hidden.

import { clock, el, svg } from "./charts.js";

const POLL_MS = 5000;
const NBSP = "\u00a0";
// The sparkline spans the hour, or what was read of it when that is shorter (at least 30 s); hal0d
// keeps an hour of reads, so a first read within FULL_S of the hour's start means the whole hour.
const HOUR_S = 3600;
const FULL_S = HOUR_S - 180;
const MIN_SPAN_S = 30;
const GAP_MIN_S = 15;
const SOURCES = { nvml: "NVML", amdsmi: "amdsmi", command: "devices_command" };

const gib = (mib) => `${(mib / 1024).toFixed(1)}${NBSP}GiB`;
const mib = (value) => `${value}${NBSP}MiB`;
const share = (part, whole) => `${((100 * part) / whole).toFixed(3)}%`;

// The MiB each slot's processes hold on `device`, in the page's order of slots (so a slot keeps
// its colour on every device and across reads), then any slot the page does not know.
function slotsOn(device, order) {
  const held = new Map();
  for (const process of device.processes || []) {
    if (process.slot) held.set(process.slot, (held.get(process.slot) || 0) + process.used_mib);
  }
  const rank = (name) => (order.includes(name) ? order.indexOf(name) : order.length);
  return [...held].sort(([a], [b]) => rank(a) - rank(b) || a.localeCompare(b))
    .map(([name, used]) => ({ name, used, colour: `m${rank(name) % 4}` }));
}

function otherTitle(device) {
  // The processes the driver names that are no slot's, and what it names no process for.
  const named = (device.processes || []).filter((process) => !process.slot);
  const unnamed = device.other_mib - named.reduce((sum, process) => sum + process.used_mib, 0);
  const parts = named.map((process) => `pid ${process.pid}: ${mib(process.used_mib)}`);
  if (unnamed > 0) parts.push(`${mib(unnamed)} the driver names no process for`);
  return `other programs (no slot's): ${parts.join(", ") || mib(0)}`;
}

// One bar of the device's total: the slots, other programs, free; the margin hatched over its
// right end, where it lies whatever holds that memory now.
function bar(device, slots, margin) {
  const total = device.total_mib;
  const part = (cls, used, title, attrs = {}, label = null) => el("div", { class: `part ${cls}`,
    title, "data-mib": used, style: `width: ${share(used, total)}`, ...attrs },
  label ? el("span", { class: "label" }, label) : null);
  return el("div", { class: "device-bar", role: "img",
    "aria-label": `memory of device ${device.index}: ${slots.map((s) => `${s.name} ${mib(s.used)}`)
      .concat([`other programs ${mib(device.other_mib)}`, `free ${mib(device.free_mib)}`]).join(", ")}` },
  slots.map((slot) => part(`slot ${slot.colour}`, slot.used, `${slot.name}: ${mib(slot.used)}`,
    { "data-slot": slot.name }, slot.name)),
  device.other_mib ? part("other", device.other_mib, otherTitle(device), {}, "other") : null,
  part("free", device.free_mib, `free: ${mib(device.free_mib)}`),
  margin ? el("div", { class: "margin", style: `width: ${share(Math.min(margin, total), total)}`,
    title: `margin: placement keeps ${mib(margin)} free` }) : null);
}

function legend(device, slots, margin) {
  const key = (cls, text, attrs = {}) => el("span", { class: `key ${cls}`, ...attrs }, text);
  return el("p", { class: "device-legend" },
    slots.map((slot) => key(`slot ${slot.colour}`, `${slot.name} ${mib(slot.used)}`,
      { "data-slot": slot.name })),
    device.other_mib ? key("other", `other programs ${mib(device.other_mib)}`,
      { title: otherTitle(device) }) : null,
    key("free", `free ${mib(device.free_mib)}`),
    margin ? key("margin", `margin ${mib(margin)}`,
      { title: "placement starts a model on a device only where this much stays free" }) : null);
}

function figures(device, margin) {
  const room = Math.max(0, device.free_mib - margin);
  const used = (part, whole) => `used ${(part / 1024).toFixed(1)} of ${gib(whole)}`;
  return el("p", { class: "device-figures" },
    `${used(device.used_mib, device.total_mib)}, ${gib(device.free_mib)} free`,
    margin ? el("span", { class: "muted" }, ` (a new model may take ${gib(room)})`) : null,
    device.gtt ? `; GTT ${used(device.gtt.used_mib, device.gtt.total_mib)}` : null);
}

// The free MiB of `history` ([unix s, MiB], oldest first) as a filled line from 0 to the total,
// broken where reads failed (a step three times the usual one, and at least GAP_MIN_S: a read
// slowed by a busy box is no gap), over the window from `start` to `end`.
function sparkline(history, total, start, end) {
  const W = 300;
  const H = 40;
  const x = (ts) => (((Math.max(ts, start) - start) / (end - start)) * W).toFixed(1);
  const y = (free) => (H - 1 - (Math.min(free, total) / total) * (H - 2)).toFixed(1);
  const steps = history.slice(1).map(([ts], i) => ts - history[i][0]).sort((a, b) => a - b);
  const gap = Math.max(GAP_MIN_S, 3 * (steps[Math.floor(steps.length / 2)] || Infinity));
  const runs = [];
  history.forEach(([ts, free], i) => {
    if (!i || ts - history[i - 1][0] > gap) runs.push([]);
    runs[runs.length - 1].push([x(ts), y(free)]);
  });
  const drawn = runs.map((run) => {
    // A lone read (between two failed stretches) as a short dash, so it shows at all.
    const points = run.length > 1 ? run : [run[0], [Math.min(W, Number(run[0][0]) + 3), run[0][1]]];
    const line = points.map((point) => point.join(",")).join(" ");
    const first = points[0][0];
    const last = points[points.length - 1][0];
    return [svg("polygon", { class: "area", points: `${first},${H - 1} ${line} ${last},${H - 1}` }),
      svg("polyline", { points: line })];
  });
  return svg("svg", { class: "sparkline", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
    role: "img", "aria-label": `free memory since ${clock(start)}` },
  svg("line", { class: "base", x1: 0, x2: W, y1: H - 0.5, y2: H - 0.5 }), drawn);
}

function history(device, end) {
  const samples = device.history || [];
  const read = end - (samples.length ? samples[0][0] : end);
  const span = read >= FULL_S ? HOUR_S : Math.max(MIN_SPAN_S, read);
  const low = samples.reduce((least, sample) => (!least || sample[1] < least[1] ? sample : least), null);
  const when = span >= HOUR_S ? "over the last hour" : `since ${clock(end - span).slice(0, 5)}`;
  return el("figure", { class: "device-history" },
    el("figcaption", {}, el("b", {}, "free memory"), ` ${when}`,
      low ? el("span", { class: "latest" }, `lowest ${gib(low[1])} at ${clock(low[0]).slice(0, 5)}`)
        : null),
    sparkline(samples, device.total_mib, end - span, end));
}

function deviceCard(device, order, margin, end) {
  const slots = slotsOn(device, order);
  return el("article", { class: "card device", "data-device": device.index },
    el("h3", {}, el("span", {}, `GPU ${device.index}`, el("span", { class: "muted" }, ` ${device.name}`))),
    figures(device, margin), bar(device, slots, margin), legend(device, slots, margin),
    history(device, end));
}

// The section from one /api/devices view; `order`: the slots' names as the page lists them.
export function drawDevices(section, view, order) {
  section.hidden = !view.source;
  if (!view.source) return;
  const when = view.read_at ? `, read at ${clock(view.read_at)}` : "";
  section.querySelector(".device-source").textContent = `from ${SOURCES[view.source] || view.source}${when}`;
  const error = section.querySelector(".device-error");
  error.hidden = !view.error;
  error.textContent = view.error ? `The devices could not be read: ${view.error}` : "";
  const end = view.read_at || Date.now() / 1000;
  section.querySelector(".devices").replaceChildren(
    ...(view.devices || []).map((device) => deviceCard(device, order, view.margin_mib || 0, end)));
  fitLabels(section);
}

// A name in the bar only where it fits whole at the bar's width now (the legend names every part).
function fitLabels(section) {
  for (const label of section.querySelectorAll(".device-bar .label")) {
    label.hidden = false;
    label.hidden = label.scrollWidth > label.parentNode.clientWidth;
  }
}

// Reads `read()` (the page's keyed fetch of /api/devices) now and every POLL_MS while the page
// is visible; a failed read keeps what is shown (the page's event stream reports a lost hal0d).
export function followDevices(section, read, order) {
  let timer = null;
  let reading = false;
  async function poll() {
    clearTimeout(timer);
    timer = null;
    if (reading || document.hidden) return;
    reading = true;
    try {
      drawDevices(section, await read(), order());
    } catch { /* as above */ } finally {
      reading = false;
    }
    if (!document.hidden) timer = setTimeout(poll, POLL_MS);
  }
  document.addEventListener("visibilitychange", poll);
  window.addEventListener("resize", () => fitLabels(section));
  poll();
}
