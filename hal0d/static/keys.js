// The status page's Keys section: each key of GET /api/keys (each [[keys]] table, and the
// requests without a key as "anonymous") as a card: its class and weight, its tokens in each
// minute of the last hour, its tokens over the share window and their share of all keys', each
// quota as a bar with the time it resets, and its requests in flight and queued.
// A key's use is not on the event feed (the share book counts tokens, it sends no events):
// /api/keys is read every POLL_MS while the page is in view, as /api/devices is. It needs the
// admin scope; a page whose key has only `read` is answered 403 and shows no section at all
// (which keys there are and what each uses is the operator's to see, not a fault to report).

import { el, svg } from "./charts.js";

const POLL_MS = 5000;
const NBSP = "\u00a0";
const NEAR = 0.8; // a quota used this far is drawn in the warning colour: the operator's cue
const PERIODS = { hour: "this hour", day: "today" }; // the shorter first, as it runs out first

const tokens = (n) => Number(n || 0).toLocaleString();
const percent = (share) => `${Math.round(share * 100)}${NBSP}%`;

function period(seconds) {
  // The windows are configured in round figures: 600 s reads as 10 min, 86400 s as 24 h.
  if (seconds < 120) return `${Math.round(seconds)}${NBSP}s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)}${NBSP}min`;
  return `${Math.round(seconds / 3600)}${NBSP}h`;
}

// A reset as the clock on the wall says it (a day's quota resets at 00:00); not charts.js's
// `clock`, whose hour12: false writes midnight as 24:00 in some locales.
const resetsAt = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour: "2-digit",
  minute: "2-digit", hourCycle: "h23" });

function classBadge(key, view) {
  const title = key.class === "batch"
    ? `batch: waits behind interactive work, at most ${period(view.batch_max_wait_s)} before it goes first`
    : "interactive: served before batch work in a model's queue and in a group's turns";
  return el("span", { class: "key-class", title }, key.class);
}

// The tokens of each minute of the hour (oldest first, the last one the minute under way) as
// bars on `top`, one scale for every key's card so the cards compare at a glance. The minutes
// are hal0d's own (not the wall clock's), so a bar says how long ago, not at what time.
function hourBars(minutes, top) {
  const W = 300;
  const H = 36;
  const step = W / Math.max(1, minutes.length);
  const bars = minutes.map((count, i) => {
    if (!count) return null;
    const height = Math.max(1.5, (count / top) * (H - 2));
    const ago = minutes.length - 1 - i;
    const when = ago ? `${ago} min ago` : "this minute";
    return svg("rect", { x: (i * step).toFixed(1), y: (H - 1 - height).toFixed(1),
      width: (step * 0.8).toFixed(1), height: height.toFixed(1), "data-tokens": count },
    svg("title", {}, `${when}: ${tokens(count)} tokens`));
  });
  return svg("svg", { class: "sparkline key-spark", viewBox: `0 0 ${W} ${H}`,
    preserveAspectRatio: "none", role: "img", "aria-label": "tokens per minute over the last hour" },
  svg("line", { class: "base", x1: 0, x2: W, y1: H - 0.5, y2: H - 0.5 }), bars);
}

function hour(key, top) {
  const minutes = key.last_hour_tokens || [];
  const total = minutes.reduce((sum, count) => sum + count, 0);
  return el("figure", { class: "key-hour" },
    el("figcaption", {}, el("b", {}, "last hour"), " tokens per minute",
      el("span", { class: "latest" }, total ? `${tokens(total)} tokens` : "none")),
    hourBars(minutes, top));
}

function shareFact(key, view) {
  const title = `its tokens over the last ${period(view.share_window_s)} (share_window_s), and`
    + " their part of every key's";
  if (!key.window_tokens) return el("span", { title }, "no tokens");
  return el("span", { title }, el("b", {}, percent(key.window_share || 0)),
    ` · ${tokens(key.window_tokens)} tokens`);
}

// One quota: its figures and reset on a line, under them a bar of what its window used.
function quota(per, limits) {
  const used = limits.used / limits.limit;
  const state = used >= 1 ? "full" : used >= NEAR ? "near" : "";
  const reset = used >= 1 ? `used up until ${resetsAt(limits.resets_at)}`
    : `resets ${resetsAt(limits.resets_at)}`;
  return el("div", { class: `quota ${state}`, "data-per": per },
    el("p", {}, el("span", { class: "muted" }, `${per} quota`),
      el("span", { class: "quota-figures" }, `${tokens(limits.used)} / ${tokens(limits.limit)}`,
        el("span", { class: "muted" }, ` · ${reset}`))),
    el("div", { class: "meter", role: "img",
      "aria-label": `${tokens(limits.used)} of ${tokens(limits.limit)} tokens ${PERIODS[per] || per}` },
    el("div", { class: "fill", style: `width: ${Math.min(100, used * 100).toFixed(2)}%` })));
}

function requestsFact(key) {
  return `${key.in_flight || 0} in flight, ${key.queued || 0} queued`;
}

function keyCard(key, view, top) {
  const quotas = key.quotas || {};
  const periods = [...Object.keys(PERIODS), ...Object.keys(quotas)]
    .filter((per, i, all) => quotas[per] && all.indexOf(per) === i);
  return el("article", { class: "card key-card", "data-key": key.name, "data-class": key.class },
    el("h3", {}, el("span", {}, key.name), classBadge(key, view)),
    el("p", { class: "models" }, key.anonymous ? "requests without a key · " : "",
      el("span", { title: "its share among the keys of its class, weighed by tokens" },
        `weight ${key.weight}`)),
    hour(key, top),
    el("dl", {}, el("dt", {}, "share"), el("dd", {}, shareFact(key, view)),
      el("dt", {}, "requests"), el("dd", {}, requestsFact(key))),
    periods.map((per) => quota(per, quotas[per])));
}

// The section from one /api/keys view: hidden while hal0d has no keys.
export function drawKeys(section, view) {
  const keys = view.keys || [];
  section.hidden = !keys.length;
  if (!keys.length) return;
  section.querySelector(".keys-window").textContent = "shares of the tokens used in the last "
    + `${period(view.share_window_s)}; batch work goes first after waiting ${period(view.batch_max_wait_s)}`;
  const top = Math.max(1, ...keys.flatMap((key) => key.last_hour_tokens || []));
  section.querySelector(".cards").replaceChildren(...keys.map((key) => keyCard(key, view, top)));
}

// Reads `read()` (the page's keyed fetch of /api/keys) now and every POLL_MS while the page is
// visible; a failed read keeps what is shown (the page's event stream reports a lost hal0d).
// A 403 ends the reads: a key's scopes change only with hal0d's config, and another key is
// another load of the page; asking again would only add a refusal to hal0d's log every 5 s.
export function followKeys(section, read) {
  let timer = null;
  let reading = false;
  let refused = false;
  async function poll() {
    clearTimeout(timer);
    timer = null;
    if (refused || reading || document.hidden) return;
    reading = true;
    try {
      drawKeys(section, await read());
    } catch (error) {
      refused = error.status === 403;
      if (refused) section.hidden = true;
    } finally {
      reading = false;
    }
    if (!refused && !document.hidden) timer = setTimeout(poll, POLL_MS);
  }
  document.addEventListener("visibilitychange", poll);
  poll();
}
