// The status page's last hour: the timeline, each slot's charts and each group's memory, drawn
// by charts.js from GET /api/timeline (as state.js holds it) on the clock the page keeps of it.

import { WINDOW_S, drawMemory, drawSlotCharts, el, timeline, windowOf } from "./charts.js";
import { $, state } from "./state.js";

export const timelineNow = () => state.timeline.now + (Date.now() - state.timelineAt) / 1000;

export function renderHour() {
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
