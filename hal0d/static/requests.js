// The status page's Recent requests table, filtered by slot, by errors, or to the minute
// picked on a chart; a request picked in it is shown on the timeline (hour.js).

import { NeedKey, api, askForKey, showNotice } from "./api.js";
import { clock, el, pickedText } from "./charts.js";
import { WHOLE, ms, num, outcome, tokensPerSecond } from "./format.js";
import { renderHour } from "./hour.js";
import { $, state } from "./state.js";

export function renderRequests() {
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

function pick(row) {
  state.picked = state.picked && state.picked.request_id === row.request_id ? null : row;
  $("timeline-detail").textContent = state.picked ? pickedText(row) : "";
  renderRequests();
  renderHour();
}

export async function pickMinute(slot, ts) {
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

export function clearMinute() {
  state.minute = null;
  state.minuteRows = [];
  $("filter-slot").value = "";
  renderRequests();
}
