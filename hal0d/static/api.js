// The status page's calls to hal0d's JSON API, and what the page shows when one fails: a notice,
// or the key form when hal0d asks for a key. The key lives in this browser's localStorage
// (state.js) and only ever travels in the Authorization header.

import { $, state } from "./state.js";

export class NeedKey extends Error {}

export function authHeaders() {
  return state.key ? { Authorization: `Bearer ${state.key}` } : {};
}

export async function api(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: { ...authHeaders(), ...options.headers } });
  if (resp.status === 401) throw new NeedKey();
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const message = body.error ? body.error.message : `${resp.status}`;
    throw Object.assign(new Error(message), { status: resp.status });
  }
  return body;
}

let noticeTimer = null;
export function showNotice(text, forMs = 0) {
  $("notice").textContent = text;
  $("notice").hidden = false;
  clearTimeout(noticeTimer);
  if (forMs) noticeTimer = setTimeout(hideNotice, forMs);
}
export function hideNotice() {
  $("notice").hidden = true;
}

export function askForKey() {
  $("live").hidden = true;
  $("key-form").hidden = false;
  $("key").focus();
}
