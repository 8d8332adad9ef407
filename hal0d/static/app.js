// hal0d's status page: one snapshot over the JSON API, then live from GET /api/events.
// The event stream is read with fetch (not EventSource, which cannot send the key header);
// the key, when hal0d asks for one, lives in this browser's localStorage and only ever travels
// in the Authorization header.

import { WINDOW_S, clock, drawMemory, drawSlotCharts, el, pickedText, timeline, windowOf } from "./charts.js";
import { followDevices } from "./devices.js";
import { drawGroups, waiting } from "./groups.js";
import { followKeys } from "./keys.js";

const KEY_STORE = "hal0d.api_key";
const MAX_ROWS = 200;
const RETRY_MAX_MS = 5000;

const state = {
  key: localStorage.getItem(KEY_STORE) || "",
  status: null, // GET /api/status, and when it was read
  statusAt: 0,
  slots: new Map(), // name -> the /api/slots view
  routes: [], // the /api/slots routes: each [[routes]] model, its state and slots
  slotsAt: 0,
  groups: [], // the /api/slots groups: turns, waits and swaps, and when they were read
  groupsAt: 0,
  metrics: new Map(), // name -> the /api/slots/metrics view
  loads: new Map(), // name -> the latest load event while a load lasts
  requests: [], // history rows, newest first
  errorTimes: [], // unix seconds of failed requests in the last hour
  timeline: null, // GET /api/timeline, and when it was read
  timelineAt: 0,
  picked: null, // the request row picked in the list: shown on the timeline
  minute: null, // {slot, ts}: the list shows that minute's requests (a chart's point)
  minuteRows: [],
};

class NeedKey extends Error {}

const $ = (id) => document.getElementById(id);
const byName = (views) => new Map(views.map((view) => [view.name, view]));

function authHeaders() {
  return state.key ? { Authorization: `Bearer ${state.key}` } : {};
}

async function api(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: { ...authHeaders(), ...options.headers } });
  if (resp.status === 401) throw new NeedKey();
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const message = body.error ? body.error.message : `${resp.status}`;
    throw Object.assign(new Error(message), { status: resp.status });
  }
  return body;
}

// -- formatting --

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  const h = Math.floor(s / 3600);
  return h < 48 ? `${h} h ${Math.floor((s % 3600) / 60)} min` : `${Math.floor(h / 24)} d`;
}

const ms = (value) => (value === null || value === undefined ? "–" : `${Math.round(value)} ms`);
const num = (value, digits = 1) => (value === null || value === undefined ? "–" : value.toFixed(digits));

function tokensPerSecond(row) {
  // A stream's tokens over the time after its first; a whole answer has no first token to time:
  // its tokens over the time it was served (its prompt's reading included).
  if (!row.completion_tokens || !row.total_ms) return null;
  const generating = (row.total_ms - (row.stream ? row.ttft_ms ?? row.total_ms : row.queue_ms || 0)) / 1000;
  return generating > 0 ? row.completion_tokens / generating : null;
}

const WHOLE = "a whole (not streamed) answer has no first token to time";

function outcome(row) {
  if (row.ok) return el("span", { class: "outcome-ok" }, "ok");
  const code = row.error_code || "error";
  if (code.startsWith("stream_stall_")) {
    return el("span", { class: "outcome-stall", title: "the stall guard ended this stream" },
      `stall guard: ${code.slice("stream_stall_".length)}`);
  }
  if (code === "client_disconnect" || code === "client_stalled") {
    return el("span", { class: "outcome-gone", title: code }, code === "client_disconnect"
      ? "client left" : "client stopped reading");
  }
  return el("span", { class: "outcome-bad" }, code);
}

// -- rendering --

function renderHeader() {
  const status = state.status;
  if (!status) return;
  const since = (Date.now() - state.statusAt) / 1000;
  $("version").textContent = status.version;
  $("uptime").textContent = duration(status.uptime_s + since);
  $("served").textContent = String(status.requests);
  const hourAgo = Date.now() / 1000 - 3600;
  state.errorTimes = state.errorTimes.filter((ts) => ts > hourAgo);
  $("errors").textContent = String(state.errorTimes.length);
  $("forget-key").hidden = !state.key;
}

// The MiB a group's loaded slots take; null where neither a budget nor a slot's memory_mib is
// configured (unknown, not "0 MiB in use").
function memoryInUse(group, budget) {
  const members = [...state.slots.values()].filter((view) => view.group === group);
  if (!budget && !members.some((view) => view.memory_mib)) return null;
  return members.filter((view) => !["stopped", "offline"].includes(view.state))
    .reduce((sum, view) => sum + (view.memory_mib || 0), 0);
}

function groupMemory(view) {
  const used = view.group ? memoryInUse(view.group, view.group_memory_mib) : null;
  if (used === null) return null;
  const budget = view.group_memory_mib ? ` of ${view.group_memory_mib}` : "";
  return `${view.group}: ${used}${budget} MiB in use`;
}

function lifecycleLine(view) {
  if (view.start !== "on_demand") return null;
  if (view.state === "ready" && view.idle_for_s !== null && view.idle_for_s !== undefined) {
    const since = (Date.now() - state.slotsAt) / 1000;
    const idle = `idle for ${duration(view.idle_for_s + since)}`;
    if (view.idle_unload_in_s === null || view.idle_unload_in_s === undefined) return idle;
    return `${idle}, unloads in ${duration(view.idle_unload_in_s - since)}`;
  }
  if (view.loaded_for_s !== null && view.loaded_for_s !== undefined) {
    return `loaded for ${duration(view.loaded_for_s + (Date.now() - state.slotsAt) / 1000)}`;
  }
  return "not loaded: the next request loads it";
}

function cacheShare(prompt) {
  // Of the prompt tokens whose upstream said how many came from its cache, since hal0d started.
  const total = prompt ? prompt.read + prompt.cached : 0;
  if (!total) return null;
  const title = `${prompt.cached} of ${total} prompt tokens came from the upstream's prompt cache`
    + " since hal0d started";
  return el("span", { title }, `${Math.round((100 * prompt.cached) / total)} % of prompt tokens`);
}

function warmLine(view) {
  // The conversations whose last turn the slot served, when the view says. Without a saved
  // prompt cache only the server's memory may hold them, and an unload drops them: said so.
  const n = view.conversations_warm;
  if (n === undefined || n === null || (!n && !view.prompt_cache)) return null;
  const count = n === 1 ? "1 conversation" : `${n} conversations`;
  return view.prompt_cache || view.prompt_cache === undefined ? count : el("span", {
    title: "their next turns come here; prompt_cache = \"save\" keeps them over an unload" },
  `${count} in the server's memory, not saved`);
}

function savedCacheLine(view) {
  // The slot's prompt cache saved to disk and restored; a view without it, or null: none kept.
  const saved = view.prompt_cache;
  if (!saved) return null;
  const parts = [];
  if (saved.saved_at) parts.push(`saved ${saved.saved_tokens} tokens at ${clock(saved.saved_at)}`);
  if (saved.restored_at) {
    parts.push(`restored ${saved.restored_tokens} at ${clock(saved.restored_at)}`);
  }
  if (saved.failures) parts.push(`${saved.failures} failed`);
  return parts.length ? parts.join(", ") : "nothing saved yet";
}

async function slotAction(name, action, force = false) {
  const query = action === "load" ? "?wait=false" : force ? "?force=true" : "";
  try {
    await api(`/api/slots/${encodeURIComponent(name)}/${action}${query}`, { method: "POST" });
  } catch (error) {
    if (error instanceof NeedKey) return askForKey();
    if (error.status === 409 && action === "unload" && !force
        && window.confirm(`${error.message}\n\nUnload anyway?`)) {
      return slotAction(name, action, true);
    }
    showNotice(`${action} ${name}: ${error.message}`, 5000);
  }
}

function card(view) {
  const metrics = state.metrics.get(view.name) || {};
  const ttft = metrics.ttft_ms || {};
  const load = state.loads.get(view.name);
  // Whole answers have a speed (the newest listed: tokensPerSecond) but no time to first token.
  const rows = state.requests.filter((row) => row.slot === view.name);
  const whole = rows.map(tokensPerSecond).find((speed, i) => speed && !rows[i].stream);
  const wholeOnly = !ttft.samples && rows.length && !rows.some((row) => row.stream);
  const facts = [
    ["in flight", `${view.in_flight} / ${view.max_concurrent}`],
    ["queued", String(view.queued)],
    ["tok/s", metrics.tokens_per_s || !whole ? num(metrics.tokens_per_s) : `${num(whole)} (whole answer)`],
    ["TTFT p50 / p95", wholeOnly ? el("span", { title: WHOLE }, "whole answers only")
      : `${ms(ttft.p50)} / ${ms(ttft.p95)}`],
  ];
  const share = cacheShare(metrics.prompt_tokens);
  if (share) facts.push(["cache", share]);
  const warm = warmLine(view);
  if (warm) facts.push(["warm", warm]);
  const saved = savedCacheLine(view);
  if (saved) facts.push(["saved cache", saved]);
  const lifecycle = lifecycleLine(view);
  if (lifecycle) facts.push(["model", el("span", { "data-tick": view.name }, lifecycle)]);
  if (view.load_s) facts.push(["load", `${num(view.load_s)} s (median of its last loads)`]);
  const memory = groupMemory(view);
  if (memory) facts.push(["memory", memory]);
  if (load) facts.push(["loading", `${load.phase.replaceAll("_", " ")}, ${num(load.elapsed_s)} s`]);
  const loaded = !["stopped", "offline", "stopping"].includes(view.state);
  return el("article", { class: "card", "data-state": view.state, "data-slot": view.name },
    el("h3", {}, el("span", {}, view.name), el("span", { class: "state" }, view.state)),
    view.reason ? el("p", { class: "reason" }, view.reason) : null,
    el("p", { class: "models" }, view.models.join(", ")),
    el("dl", {}, facts.map(([term, value]) => [el("dt", {}, term), el("dd", {}, value)])),
    view.start === "on_demand" ? el("div", { class: "actions" },
      el("button", { type: "button", "data-action": "load", disabled: loaded,
        onclick: () => slotAction(view.name, "load") }, "Load"),
      el("button", { type: "button", "data-action": "unload", disabled: !loaded,
        onclick: () => slotAction(view.name, "unload") }, "Unload")) : null);
}

function renderSlots() {
  // Cards are updated in place: a button under the pointer is kept (only whether it is enabled
  // changes), so a click is never lost to a redraw while the slot is busy.
  const container = $("slots");
  const names = [...state.slots.keys()];
  for (const view of state.slots.values()) {
    const fresh = card(view);
    const old = container.querySelector(`article[data-slot="${CSS.escape(view.name)}"]`);
    if (!old) {
      container.append(fresh);
      continue;
    }
    old.dataset.state = view.state;
    const kept = old.querySelector(".actions");
    const made = fresh.querySelector(".actions");
    if (kept && made) {
      for (const button of kept.querySelectorAll("button")) {
        button.disabled = made.querySelector(`[data-action="${button.dataset.action}"]`).disabled;
      }
      made.replaceWith(kept);
    }
    old.replaceChildren(...fresh.childNodes);
  }
  for (const stale of container.querySelectorAll("article[data-slot]")) {
    if (!state.slots.has(stale.dataset.slot)) stale.remove();
  }
  const select = $("filter-slot");
  const listed = [...select.options].slice(1).map((option) => option.value);
  if (listed.join("\n") !== names.join("\n")) {
    const chosen = select.value;
    select.replaceChildren(el("option", { value: "" }, "all"),
      ...names.map((name) => el("option", { value: name }, name)));
    select.value = chosen;
  }
}

function routeCard(route) {
  // A route is shown in its best slot's state (the one /v1/models lists), its slots in order.
  const settings = [route.prefer_loaded ? "prefer_loaded" : null,
    route.spill_when_busy ? "spill_when_busy" : null,
    route.first_byte_timeout_s ? `first byte within ${route.first_byte_timeout_s} s` : null]
    .filter(Boolean);
  return el("article", { class: "card route", "data-state": route.state, "data-route": route.model },
    el("h3", {}, el("span", {}, route.model), el("span", { class: "state" }, route.state)),
    el("p", { class: "reason" }, `best slot: ${route.slot}; its slots in order:`),
    el("ol", { class: "members" }, route.slots.map((member) => el("li",
      { "data-state": member.state, "data-slot": member.name },
      el("span", { class: "state" }, member.state), " ", el("b", {}, member.name),
      member.served !== route.model ? el("span", { class: "muted" }, ` as ${member.served}`) : null))),
    settings.length ? el("p", { class: "models" }, settings.join(", ")) : null);
}

function renderRoutes() {
  $("routes-section").hidden = state.routes.length === 0;
  $("routes").replaceChildren(...state.routes.map(routeCard));
}

function renderGroups() {
  // Re-drawn every second too: the turns' countdowns and the waits move between two reads.
  $("groups-section").hidden = state.groups.length === 0;
  const up = state.status ? state.status.uptime_s + (Date.now() - state.statusAt) / 1000 : 0;
  drawGroups($("groups"), state.groups, (Date.now() - state.groupsAt) / 1000, up,
    (group) => memoryInUse(group.name, group.memory_mib));
}

function renderRequests() {
  const slot = $("filter-slot").value;
  const errorsOnly = $("filter-errors").checked;
  const source = state.minute ? state.minuteRows : state.requests;
  const pickedId = state.picked && state.picked.request_id;
  const rows = source
    .filter((row) => (!slot || row.slot === slot) && (!errorsOnly || !row.ok))
    .map((row) => el("tr", { "data-request-id": row.request_id, tabindex: "0",
      class: row.request_id === pickedId ? "picked" : null, "aria-selected": row.request_id === pickedId,
      onclick: () => pick(row), onkeydown: (event) => event.key === "Enter" && pick(row) },
      el("td", {}, clock(row.ts)),
      el("td", {}, row.model || "–"),
      el("td", row.failover ? { title: `handed on by ${row.failover.replaceAll(",", ", ")}` } : {},
        row.slot || "–", row.failover ? el("span", { class: "failover" },
          ` after ${row.failover.split(",").map((tried) => tried.split("=")[0]).join(", ")}`)
          : null),
      el("td", {}, `${row.stream ? "stream " : ""}${row.endpoint}`),
      el("td", { class: "num" }, String(row.status || "–")),
      el("td", {}, outcome(row)),
      el("td", { class: "num" }, `${ms(row.queue_ms)} / ${ms(row.load_ms)}`),
      el("td", { class: "num" }, row.stream || row.ttft_ms ? ms(row.ttft_ms)
        : el("span", { class: "muted", title: WHOLE }, "whole answer")),
      el("td", { class: "num" }, num(tokensPerSecond(row))),
      el("td", { class: "num" }, ms(row.total_ms))));
  $("requests").tBodies[0].replaceChildren(...rows);
  const filter = $("minute-filter");
  filter.hidden = !state.minute;
  if (state.minute) {
    filter.querySelector("span").textContent = `${state.minute.slot}: the requests that ended `
      + `${clock(state.minute.ts).slice(0, 5)}–${clock(state.minute.ts + 60).slice(0, 5)}`;
  }
}

// -- the last hour --

const timelineNow = () => state.timeline.now + (Date.now() - state.timelineAt) / 1000;

function renderHour() {
  const data = state.timeline;
  if (!data || $("live").hidden) return;
  const now = timelineNow();
  const start = now - windowOf(data, now);
  $("hour-title").textContent = now - start < WINDOW_S ? "Since hal0d started" : "The last hour";
  const box = $("timeline");
  box.replaceChildren(timeline(data, start, now, box.clientWidth, state.picked));
  const charts = $("charts");
  const names = data.slots.map((slot) => slot.name);
  for (const stale of charts.querySelectorAll("article[data-slot]")) {
    if (!names.includes(stale.dataset.slot)) stale.remove();
  }
  for (const name of names) {
    let card = charts.querySelector(`article[data-slot="${CSS.escape(name)}"]`);
    if (!card) charts.append(card = el("article", { class: "chart-card", "data-slot": name }));
    drawSlotCharts(card, name, data, start, now);
  }
  // Only the groups with memory configured (a budget, a slot's memory_mib, free_memory_command).
  const sized = data.groups.filter((group) => group.memory_mib || group.free_mib !== null
    || data.slots.some((slot) => slot.memory_mib && group.members.includes(slot.name)));
  const memory = $("memory");
  memory.replaceChildren(...sized.map((group) => el("article", { class: "chart-card", "data-group": group.name })));
  sized.forEach((group, i) => drawMemory(memory.children[i], group, data, start, now));
  $("memory-title").hidden = sized.length === 0;
}

function pick(row) {
  state.picked = state.picked && state.picked.request_id === row.request_id ? null : row;
  $("timeline-detail").textContent = state.picked ? pickedText(row) : "";
  renderRequests();
  renderHour();
}

async function pickMinute(slot, ts) {
  try {
    const rows = await api(`/api/requests?limit=1000&since=${ts}&until=${ts + 60}`);
    state.minute = { slot, ts };
    state.minuteRows = rows.requests;
    $("filter-slot").value = slot;
    renderRequests();
    $("requests-title").scrollIntoView({ block: "nearest" });
  } catch (error) {
    if (error instanceof NeedKey) return askForKey();
    showNotice(`the requests of ${clock(ts)}: ${error.message}`, 5000);
  }
}

function clearMinute() {
  state.minute = null;
  state.minuteRows = [];
  $("filter-slot").value = "";
  renderRequests();
}

function render() {
  renderHeader();
  renderSlots();
  renderRoutes();
  renderGroups();
  renderRequests();
  renderHour();
}

// -- data --

async function snapshot() {
  const [status, slots, metrics, requests, hour] = await Promise.all([
    api("/api/status"), api("/api/slots"), api("/api/slots/metrics"),
    api(`/api/requests?limit=${MAX_ROWS}`), api("/api/timeline"),
  ]);
  state.timeline = hour;
  state.timelineAt = Date.now();
  state.status = status;
  state.statusAt = Date.now();
  state.errorTimes = (status.error_times || []).slice();
  state.slots = byName(slots.slots);
  state.slotsAt = Date.now();
  takeLists(slots);
  state.metrics = byName(metrics.slots);
  state.requests = requests.requests;
}

let metricsPending = null;
function refreshMetricsSoon() {
  // Figures that change with every request (TTFT percentiles) are re-read at most once a second.
  if (metricsPending) return;
  metricsPending = setTimeout(async () => {
    metricsPending = null;
    try {
      const metrics = await api("/api/slots/metrics");
      state.metrics = byName(metrics.slots);
      renderSlots();
    } catch { /* the event stream's own reconnect reports trouble */ }
  }, 1000);
}

// A route's state is its slots' (and another hal0d's report of its model), a group's turns and
// swaps are the lifecycle's, both judged by hal0d and not on the feed: /api/slots is re-read
// after a slot changes state, a load or a swap moves, a queue changes (groups only) or a reload,
// soon but at most once a second, so a burst of events costs one read.
let listsPending = null;
let listsReadAt = 0;
function takeLists(lists) {
  state.routes = lists.routes || [];
  state.groups = lists.groups || [];
  state.groupsAt = Date.now();
}
function refreshListsSoon(reloaded) {
  if (listsPending || (!reloaded && !state.routes.length && !state.groups.length)) return;
  listsPending = setTimeout(async () => {
    listsPending = null;
    listsReadAt = Date.now();
    try {
      takeLists(await api("/api/slots"));
      renderRoutes();
      renderGroups();
    } catch { /* as above */ }
  }, Math.max(150, listsReadAt + 1000 - Date.now()));
}

// The last hour is re-read, not rebuilt from the feed: after a load or an unload all of it (the
// lifecycle's part is in memory), after requests only the minutes since the last one began, and
// at most every TIMELINE_EVERY_MS, so a busy hal0d costs the page one small query now and then.
const TIMELINE_EVERY_MS = 5000;
let hourPending = null;
let hourWhole = false;
function refreshHourSoon(whole) {
  hourWhole = hourWhole || whole;
  if (hourPending) return;
  hourPending = setTimeout(async () => {
    hourPending = null;
    const partial = !hourWhole && state.timeline;
    hourWhole = false;
    const since = partial ? Math.floor(timelineNow() / 60) * 60 - 60 : null;
    try {
      const fresh = await api(since === null ? "/api/timeline" : `/api/timeline?since=${since}`);
      if (since !== null) {
        const kept = state.timeline.minutes.filter((m) => m.ts < since && m.ts >= fresh.now - WINDOW_S - 60);
        fresh.minutes = [...kept, ...fresh.minutes];
        fresh.spans = state.timeline.spans;
        fresh.events = state.timeline.events;
        fresh.since = state.timeline.since;
        fresh.kept_since = state.timeline.kept_since;
      }
      state.timeline = fresh;
      state.timelineAt = Date.now();
      renderHour();
    } catch { /* as above */ }
  }, whole ? 300 : TIMELINE_EVERY_MS);
}

const handlers = {
  hello(data) {
    if (data.slots) {
      state.slots = byName(data.slots);
      state.slotsAt = Date.now();
    }
    if (data.routes) state.routes = data.routes;
    renderSlots();
    renderRoutes();
  },
  slot(data) {
    const view = data.view;
    state.slots.set(view.name, view);
    state.slotsAt = Date.now();
    if (!["starting", "stopped"].includes(view.state)) state.loads.delete(view.name);
    renderSlots();
    if (data.old !== data.new || data.reason === "reloaded") refreshListsSoon(data.reason === "reloaded");
  },
  counts(data) {
    const view = state.slots.get(data.slot);
    if (!view) return;
    view.in_flight = data.in_flight;
    view.queued = data.queued;
    renderSlots();
    if (state.groups.length) refreshListsSoon(false);
  },
  swap() {
    // Its wait is told on its group's card, re-read every second.
    refreshHourSoon(true);
    refreshListsSoon(false);
  },
  load(data) {
    if (!["waiting_for_room", "starting", "probing"].includes(data.phase)) {
      state.loads.delete(data.slot);
      refreshHourSoon(true);
    } else {
      if (!state.loads.has(data.slot)) refreshHourSoon(true);
      state.loads.set(data.slot, data);
    }
    renderSlots();
    refreshListsSoon(false);
  },
  unload() {
    refreshHourSoon(true);
  },
  request(data) {
    const row = data;
    state.requests.unshift(row);
    state.requests.length = Math.min(state.requests.length, MAX_ROWS);
    if (state.status) state.status.requests += 1;
    if (!row.ok) state.errorTimes.push(row.ts);
    if (state.minute && row.ts >= state.minute.ts && row.ts < state.minute.ts + 60) state.minuteRows.unshift(row);
    renderHeader();
    renderRequests();
    refreshMetricsSoon();
    refreshHourSoon(false);
  },
};

function dispatch(frame) {
  let name = "message";
  const data = [];
  for (const line of frame.split(/\r\n|\r|\n/)) {
    if (line.startsWith(":")) continue;
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length || !handlers[name]) return;
  handlers[name](JSON.parse(data.join("\n")));
}

async function follow() {
  const resp = await fetch("/api/events", { headers: { ...authHeaders(), Accept: "text/event-stream" } });
  if (resp.status === 401) throw new NeedKey();
  if (!resp.ok || !resp.body) throw new Error(`/api/events answered ${resp.status}`);
  hideNotice();
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const frames = buffer.split(/\r\n\r\n|\n\n|\r\r/);
    buffer = frames.pop();
    frames.forEach(dispatch);
  }
}

// -- life --

let noticeTimer = null;
function showNotice(text, forMs = 0) {
  $("notice").textContent = text;
  $("notice").hidden = false;
  clearTimeout(noticeTimer);
  if (forMs) noticeTimer = setTimeout(hideNotice, forMs);
}
function hideNotice() {
  $("notice").hidden = true;
}

function askForKey() {
  $("live").hidden = true;
  $("key-form").hidden = false;
  $("key").focus();
}

let panelsFollowed = false;
async function run() {
  let delay = 500;
  for (;;) {
    try {
      await snapshot();
      $("key-form").hidden = true;
      $("live").hidden = false;
      render();
      if (!panelsFollowed) {
        panelsFollowed = true; // after the first snapshot: the key, when asked for, is known
        followDevices($("devices-section"), () => api("/api/devices"), () => [...state.slots.keys()]);
        followKeys($("keys-section"), () => api("/api/keys"));
      }
      delay = 500;
      await follow();
    } catch (error) {
      if (error instanceof NeedKey) {
        if (state.key) showNotice("hal0d refused the key; enter another one.");
        return askForKey();
      }
    }
    showNotice("Connection to hal0d lost: reconnecting…");
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, RETRY_MAX_MS);
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  localStorage.setItem(KEY_STORE, state.key);
  $("key").value = "";
  hideNotice();
  run();
});
$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(KEY_STORE);
  state.key = "";
  location.reload();
});
$("filter-slot").addEventListener("change", renderRequests);
$("minute-filter").querySelector("button").addEventListener("click", clearMinute);
$("timeline").addEventListener("click", (event) => {
  // Marks a few pixels apart (a swap's unload and load) are told together, oldest first.
  const mark = event.target.closest("[data-detail]");
  if (!mark) return;
  const near = mark.dataset.x === undefined ? [mark]
    : [...$("timeline").querySelectorAll(`.mark[data-slot="${CSS.escape(mark.dataset.slot)}"]`)]
      .filter((other) => Math.abs(other.dataset.x - mark.dataset.x) <= 8);
  $("timeline-detail").textContent = near.map((other) => other.dataset.detail).join("\n");
});
$("charts").addEventListener("click", (event) => {
  const point = event.target.closest("[data-minute]");
  const card = event.target.closest("article[data-slot]");
  if (point && card) pickMinute(card.dataset.slot, Number(point.dataset.minute));
});
let resizing = null;
window.addEventListener("resize", () => {
  clearTimeout(resizing);
  resizing = setTimeout(renderHour, 150);
});
$("filter-errors").addEventListener("change", renderRequests);
let ticks = 0;
function tick() {
  // Once a second: the clocks on the page (uptime, idle for, unloads in), not the server; the
  // pictures of the hour slide every 15 s.
  if ($("live").hidden) return;
  if (++ticks % 15 === 0) renderHour();
  renderHeader();
  renderGroups();
  if (waiting(state.groups)) refreshListsSoon(false);
  for (const span of document.querySelectorAll("[data-tick]")) {
    const view = state.slots.get(span.dataset.tick);
    if (view) span.textContent = lifecycleLine(view) || "";
  }
}
setInterval(tick, 1000);
run();
