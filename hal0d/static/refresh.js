// What the event feed does not carry, re-read soon after it says it moved and at most so
// often: the slots' metrics, the routes and groups of GET /api/slots, and the last hour.

import { api } from "./api.js";
import { WINDOW_S } from "./charts.js";
import { renderHour, timelineNow } from "./hour.js";
import { renderGroups, renderRoutes, renderSlots } from "./slots.js";
import { byName, state } from "./state.js";

let metricsPending = null;
export function refreshMetricsSoon() {
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
export function takeLists(lists) {
  state.routes = lists.routes || [];
  state.groups = lists.groups || [];
  state.groupsAt = Date.now();
}
export function refreshListsSoon(reloaded) {
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
export function refreshHourSoon(whole) {
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
