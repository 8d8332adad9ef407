// The status page's header: hal0d's version and uptime, the requests it served and the last
// hour's failures, from GET /api/status, counted on by the feed's requests and the page's clock.

import { duration } from "./format.js";
import { $, state } from "./state.js";

export function renderHeader() {
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
