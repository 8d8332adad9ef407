// How the status page keeps up with hal0d: one snapshot over the JSON API, then live from
// GET /api/events, each event handed to its handler. The event stream is read with fetch (not
// EventSource, which cannot send the key header).

import { NeedKey, api, authHeaders, hideNotice } from "./api.js";
import { renderHeader } from "./header.js";
import { refreshHourSoon, refreshListsSoon, refreshMetricsSoon, takeLists } from "./refresh.js";
import { renderRequests } from "./requests.js";
import { renderRoutes, renderSlots } from "./slots.js";
import { byName, state } from "./state.js";

const MAX_ROWS = 200;

export async function snapshot() {
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

export async function follow() {
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
