// The status page's cards of GET /api/slots and the feed's slot views: a card per slot (its
// state and why, its figures, its prompt cache, its lifecycle, Load and Unload for an
// on-demand slot), a card per route (its slots in order), and the Groups section (groups.js
// draws its cards; a group's memory in use is counted here, from its slots).

import { NeedKey, api, askForKey, showNotice } from "./api.js";
import { clock, el } from "./charts.js";
import { WHOLE, duration, ms, num, tokensPerSecond } from "./format.js";
import { drawGroups } from "./groups.js";
import { $, state } from "./state.js";

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

export function lifecycleLine(view) {
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

export function renderSlots() {
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

export function renderRoutes() {
  $("routes-section").hidden = state.routes.length === 0;
  $("routes").replaceChildren(...state.routes.map(routeCard));
}

export function renderGroups() {
  // Re-drawn every second too: the turns' countdowns and the waits move between two reads.
  $("groups-section").hidden = state.groups.length === 0;
  const up = state.status ? state.status.uptime_s + (Date.now() - state.statusAt) / 1000 : 0;
  drawGroups($("groups"), state.groups, (Date.now() - state.groupsAt) / 1000, up,
    (group) => memoryInUse(group.name, group.memory_mib));
}
