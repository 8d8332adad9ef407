// The status page's Groups section: each swap group of GET /api/slots as a card that says whose
// turn it is, who waits for theirs and in what order, and what the group's swaps cost. Every key
// of a group's view is optional (an older or newer hal0d shows more or fewer of them): a card
// shows what is there and leaves the rest out, never throws on a missing one.

import { el } from "./charts.js";

const given = (value) => value !== null && value !== undefined;

// A figure and its unit joined by a no-break space, so a narrow card never wraps between them.
const NBSP = "\u00a0";

function seconds(value) {
  // Tenths while they matter (a turn that ends in 3.2 s), whole seconds and minutes after.
  if (value < 9.95) return `${Math.max(0, value).toFixed(1)}${NBSP}s`;
  const s = Math.round(value);
  if (s < 60) return `${s}${NBSP}s`;
  if (s < 3600) return `${Math.floor(s / 60)}${NBSP}min ${s % 60}${NBSP}s`;
  return `${Math.floor(s / 3600)}${NBSP}h ${Math.floor((s % 3600) / 60)}${NBSP}min`;
}

const percent = (share) => `${Math.round(share * 100)}${NBSP}%`;

const POLICY = {
  batch: "batch: a loaded model serves its queue for its turn before another model loads",
  fifo: "fifo: a model waiting for room unloads a busy one at once",
};

// How full the group is: models loaded of max_loaded, MiB in use of its budget (`used`: null
// where no memory is configured).
function roomFact(group, used) {
  const parts = [];
  if (given(group.max_loaded)) parts.push(`${(group.loaded || []).length} of ${group.max_loaded} loaded`);
  if (given(used)) parts.push(`${used}${given(group.memory_mib) ? ` of ${group.memory_mib}` : ""}${NBSP}MiB`);
  return parts.join(", ");
}

function limitsLine(group) {
  const parts = [];
  if (given(group.max_wait_s)) parts.push(`max_wait_s ${group.max_wait_s}${NBSP}s`);
  if (given(group.min_turn_loads)) parts.push(`min_turn_loads ${group.min_turn_loads}`);
  return parts.join(" · ");
}

function loadedFact(group, elapsed) {
  // Each loaded model and when its turn ends, counted down on the page between two reads.
  const loaded = group.loaded || [];
  if (!loaded.length) return "nothing loaded";
  const ends = group.turn_ends_in_s || {};
  return loaded.map((name) => {
    if (!given(ends[name])) return name;
    const left = ends[name] - elapsed;
    return `${name}: ${left > 0 ? `turn ends in ${seconds(left)}` : "turn over"}`;
  }).join("; ");
}

function swapsFact(group, windowText) {
  // The measured cost and the share of the hour spent swapping, against the target when the
  // group has one: a share above it is what an operator would act on.
  if (!given(group.swaps) && !given(group.swap_cost_s)) return null;
  if (!group.swaps || !given(group.swap_cost_s)) return "no swap measured yet";
  const cost = `${group.swaps} measured, ${seconds(group.swap_cost_s)} each (median)`;
  if (!given(group.swap_share)) return cost;
  const limit = group.max_swap_share;
  const target = given(limit) ? ` (target ≤ ${percent(limit)})` : "";
  const over = given(limit) && group.swap_share > limit;
  return [cost, el("br"), el("span", { class: over ? "over" : null },
    `swapping ${percent(group.swap_share)} ${windowText}${target}`)];
}

function waitsFact(group, elapsed) {
  const waits = Object.entries(group.longest_wait_s || {});
  if (!waits.length) return "no request waits";
  return waits.map(([name, waited]) => (given(waited)
    ? `${name} ${seconds(waited + elapsed)}` : name)).join(", ");
}

// `elapsed`: seconds since the view was read; `windowText`: what the swap share is a share of.
function groupCard(group, elapsed, windowText, used) {
  const pending = group.pending_swap;
  const room = roomFact(group, used);
  const facts = [...room ? [["in use", room]] : [], ["loaded", loadedFact(group, elapsed)]];
  if (given(group.turn_s)) facts.push(["turn", `${seconds(group.turn_s)} for a busy model`]);
  if (group.turn_order) {
    facts.push(["turn order", group.turn_order.length
      ? el("ol", { class: "turn-order" }, group.turn_order.map((name) => el("li", {}, name)))
      : "no load waits for its turn"]);
  }
  if (pending) {
    facts.push(["swap", pending.why || `${pending.waiting} waits for ${pending.victim}'s turn`]);
  }
  const swaps = swapsFact(group, windowText);
  if (swaps) facts.push(["swaps", swaps]);
  if (given(group.wait_bound_s)) {
    const bound = seconds(group.wait_bound_s);
    facts.push(["wait bound", `a request waits at most ${bound} for its model's turn`]);
  }
  if (group.longest_wait_s) facts.push(["longest wait", waitsFact(group, elapsed)]);
  const shown = pending ? "starting" : (group.loaded || []).length ? "ready" : "stopped";
  return el("article", { class: "card group", "data-group": group.name, "data-state": shown },
    el("h3", {}, el("span", {}, group.name || "?"),
      group.policy
        ? el("span", { class: "policy", title: POLICY[group.policy] }, group.policy) : null),
    limitsLine(group) ? el("p", { class: "models" }, limitsLine(group)) : null,
    el("dl", {}, facts.map(([term, value]) => [el("dt", {}, term), el("dd", {}, value)])));
}

// Each group's card into `container`; `uptime`: hal0d's, in seconds (the swap share is of the
// last hour, or of the time since hal0d started when that is shorter); `memoryOf(group)`: the
// MiB its loaded slots take, null where it has no memory configured.
export function drawGroups(container, groups, elapsed, uptime, memoryOf) {
  const windowText = uptime >= 3600 ? "of the last hour" : "since hal0d started";
  container.replaceChildren(...groups.map((group) => groupCard(group, elapsed, windowText, memoryOf(group))));
}

// Whether the page should read the groups again soon: something waits, and its figures move.
export const waiting = (groups) => groups.some((group) => group.pending_swap
  || (group.turn_order || []).length || Object.keys(group.longest_wait_s || {}).length);
