// What the status page knows of hal0d and what its reader picked, in one object every module
// shares: filled by the snapshot and the event feed (feed.js, refresh.js), drawn by each section.

export const KEY_STORE = "hal0d.api_key";

export const state = {
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

// Every module's two look-ups: the page's elements by id, and a list of views by name.
export const $ = (id) => document.getElementById(id);
export const byName = (views) => new Map(views.map((view) => [view.name, view]));
