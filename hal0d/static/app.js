// hal0d's status page: one snapshot over the JSON API, then live from GET /api/events (feed.js),
// reconnecting when hal0d goes away; the key form, the page's controls and its once-a-second
// clock. Each section's drawing is its own module's.

import { NeedKey, api, askForKey, hideNotice, showNotice } from "./api.js";
import { followDevices } from "./devices.js";
import { follow, snapshot } from "./feed.js";
import { waiting } from "./groups.js";
import { renderHeader } from "./header.js";
import { renderHour } from "./hour.js";
import { followKeys } from "./keys.js";
import { refreshListsSoon } from "./refresh.js";
import { clearMinute, pickMinute, renderRequests } from "./requests.js";
import { lifecycleLine, renderGroups, renderRoutes, renderSlots } from "./slots.js";
import { $, KEY_STORE, state } from "./state.js";

const RETRY_MAX_MS = 5000;

function render() {
  renderHeader();
  renderSlots();
  renderRoutes();
  renderGroups();
  renderRequests();
  renderHour();
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
