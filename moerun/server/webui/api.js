/* The page's calls to its own server: the API key (asked once, kept in sessionStorage, or localStorage when
   the user says so, sent as "Authorization: Bearer", never in a URL), JSON calls, and a reader of the
   server-sent events of /v1/chat/completions. */
"use strict";

const MoerunAPI = (() => {
  const KEY = "moerun.apiKey";
  const listeners = [];

  function key() {
    return sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "";
  }

  function setKey(value, remember) {
    sessionStorage.removeItem(KEY);
    localStorage.removeItem(KEY);
    if (value) (remember ? localStorage : sessionStorage).setItem(KEY, value);
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = key();
    if (k) h.Authorization = `Bearer ${k}`;
    return h;
  }

  class APIError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function failure(resp) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body && body.error) message = body.error.message || message;
    } catch (e) { /* not JSON */ }
    if (resp.status === 401) listeners.forEach((fn) => fn(message));
    return new APIError(resp.status, message);
  }

  async function json(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.body ? {"Content-Type": "application/json"} : {});
    const resp = await fetch(path, opts);
    if (!resp.ok) throw await failure(resp);
    return resp.json();
  }

  /* POST body to path and call onEvent(obj) for each `data:` object of the stream until [DONE]. */
  async function stream(path, body, onEvent, signal) {
    const resp = await fetch(path, {method: "POST", body: JSON.stringify(body), signal,
      headers: headers({"Content-Type": "application/json", Accept: "text/event-stream"})});
    if (!resp.ok) throw await failure(resp);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const ev of events) {
        const data = ev.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new APIError(obj.error.code || 500, obj.error.message || "the generation failed");
        onEvent(obj);
      }
    }
  }

  /* fn(message) is called whenever the server refuses a call for want of the key (401). */
  function onUnauthorized(fn) {
    listeners.push(fn);
  }

  return {key, setKey, json, stream, onUnauthorized, APIError};
})();
