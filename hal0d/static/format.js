// The status page's figures in words: durations, milliseconds, tokens per second and a
// request's outcome, written the same on the slot cards and in the requests table.

import { el } from "./charts.js";

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  const h = Math.floor(s / 3600);
  return h < 48 ? `${h} h ${Math.floor((s % 3600) / 60)} min` : `${Math.floor(h / 24)} d`;
}

export const ms = (value) => (value === null || value === undefined ? "–" : `${Math.round(value)} ms`);
export const num = (value, digits = 1) => (value === null || value === undefined ? "–" : value.toFixed(digits));

export function tokensPerSecond(row) {
  // A stream's tokens over the time after its first; a whole answer has no first token to time:
  // its tokens over the time it was served (its prompt's reading included).
  if (!row.completion_tokens || !row.total_ms) return null;
  const generating = (row.total_ms - (row.stream ? row.ttft_ms ?? row.total_ms : row.queue_ms || 0)) / 1000;
  return generating > 0 ? row.completion_tokens / generating : null;
}

export const WHOLE = "a whole (not streamed) answer has no first token to time";

export function outcome(row) {
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
