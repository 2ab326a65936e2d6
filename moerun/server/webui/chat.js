/* The chat: conversations kept in localStorage, each reply streamed from /v1/chat/completions (its reasoning
   folded, its tool calls as cards, its timings and expert-cache hit rate below it), stop, regenerate,
   edit-and-resend; the system prompt and sampling settings; the API key dialog; the tabs. */
"use strict";

const MoerunChat = (() => {
  const $ = (id) => document.getElementById(id);
  const STORE = "moerun.chats.v1";
  const SETTINGS = "moerun.settings.v1";
  const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_tokens"];
  const md = MoerunMarkdown;

  let store = load(STORE, {current: null, list: []});
  if (!Array.isArray(store.list)) store = {current: null, list: []};
  for (const conv of store.list) {  /* a reply that was streaming when the page went away */
    for (const m of conv.messages) {
      if (m.pending) { delete m.pending; delete m.t0; m.stopped = true; }
    }
  }
  let settings = load(SETTINGS, {system: "", tools: ""});
  let running = null;  /* {conv, msg, controller} while a reply streams */
  let painting = false;

  function load(name, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(name));
      return v && typeof v === "object" ? v : fallback;
    } catch (e) {
      return fallback;
    }
  }

  function save() {
    localStorage.setItem(STORE, JSON.stringify(store));
  }

  const uid = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

  function current() {
    let conv = store.list.find((c) => c.id === store.current);
    if (!conv) {
      conv = store.list[0];
      if (!conv) {
        conv = {id: uid(), title: "New conversation", messages: [], updated: Date.now()};
        store.list.unshift(conv);
      }
      store.current = conv.id;
    }
    return conv;
  }

  /* ---------------------------------------------------------------- conversations */

  function renderSidebar() {
    const ul = $("conversations");
    ul.textContent = "";
    const active = current();
    for (const conv of store.list) {
      const li = document.createElement("li");
      li.className = conv.id === active.id ? "active" : "";
      li.dataset.id = conv.id;
      const title = document.createElement("span");
      title.className = "title";
      title.textContent = conv.title || "New conversation";
      const del = document.createElement("button");
      del.type = "button";
      del.className = "plain delete";
      del.title = "Delete this conversation";
      del.textContent = "×";
      li.append(title, del);
      ul.append(li);
    }
  }

  function select(id) {
    store.current = id;
    save();
    renderAll();
  }

  function remove(id) {
    if (running && running.conv.id === id) stop();
    store.list = store.list.filter((c) => c.id !== id);
    if (store.current === id) store.current = store.list.length ? store.list[0].id : null;
    save();
    renderAll();
  }

  function newConversation() {
    const conv = {id: uid(), title: "New conversation", messages: [], updated: Date.now()};
    store.list.unshift(conv);
    store.current = conv.id;
    save();
    renderAll();
    $("input").focus();
  }

  /* ---------------------------------------------------------------- messages */

  function pct(hits, queries) {
    return queries ? `${(100 * hits / queries).toFixed(1)}%` : "n/a";
  }

  function timingsEl(msg) {
    const t = msg.timings;
    const div = document.createElement("div");
    div.className = "timings";
    const parts = [];
    if (msg.ttft_ms != null) parts.push(["ttft", `TTFT ${Math.round(msg.ttft_ms)} ms`]);
    if (t) {
      parts.push(["prompt", `prompt ${t.prompt_n} tok (${t.cache_n} cached), ${t.prompt_per_second.toFixed(1)} tok/s`]);
      parts.push(["gen", `generated ${t.predicted_n} tok, ${t.predicted_per_second.toFixed(1)} tok/s`]);
      const q = t.expert_cache_queries || 0;
      parts.push(["hit", q ? `expert cache ${pct(t.expert_cache_hits, q)} (${t.expert_cache_hits}/${q})`
        : "expert cache: no lookups"]);
      if (msg.finish_reason) parts.push(["finish", `finish: ${msg.finish_reason}`]);
      div.dataset.cached = t.cache_n;
      div.dataset.hits = t.expert_cache_hits;
      div.dataset.queries = q;
    }
    for (const [cls, text] of parts) {
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      div.append(span);
    }
    return div;
  }

  function toolCard(call) {
    const card = document.createElement("div");
    card.className = "tool-call";
    const head = document.createElement("div");
    head.className = "tool-name";
    head.textContent = `tool call: ${(call.function && call.function.name) || "?"}`;
    const pre = document.createElement("pre");
    let args = (call.function && call.function.arguments) || "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch (e) { /* still streaming, or not JSON: as it came */ }
    pre.textContent = args;
    card.append(head, pre);
    return card;
  }

  function button(cls, text, title) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = `plain ${cls}`;
    b.textContent = text;
    if (title) b.title = title;
    return b;
  }

  function fillMessage(el, msg) {
    el.textContent = "";
    el.className = `msg ${msg.role}${msg.pending ? " pending" : ""}`;
    if (msg.role === "user") {
      const body = document.createElement("div");
      body.className = "content plain-text";
      body.textContent = msg.content;
      el.append(body, actions([button("edit", "Edit", "Edit and send again")]));
      return;
    }
    if (msg.reasoning) {
      const details = document.createElement("details");
      details.className = "reasoning";
      details.open = !!msg.reasoningOpen;
      const summary = document.createElement("summary");
      summary.textContent = msg.pending && !msg.content ? "Reasoning…" : `Reasoning (${msg.reasoning.length} characters)`;
      const body = document.createElement("div");
      body.className = "content";
      body.innerHTML = md.render(msg.reasoning);
      details.append(summary, body);
      details.addEventListener("toggle", () => { msg.reasoningOpen = details.open; });
      el.append(details);
    }
    const body = document.createElement("div");
    body.className = "content";
    body.innerHTML = md.render(msg.content || "");
    el.append(body);
    for (const call of msg.tool_calls || []) el.append(toolCard(call));
    if (!msg.pending && !msg.content && !(msg.tool_calls || []).length && !msg.error && !msg.stopped) {
      el.append(note("empty muted", "(the model ended its reply at once)"));
    }
    if (msg.stopped) el.append(note("stopped", "stopped"));
    if (msg.error) el.append(note("error", msg.error));
    if (!msg.pending) {
      el.append(timingsEl(msg));
      el.append(actions([button("regenerate", "Regenerate"), button("copy-msg", "Copy")]));
    }
  }

  function note(cls, text) {
    const p = document.createElement("p");
    p.className = `note ${cls}`;
    p.textContent = text;
    return p;
  }

  function actions(buttons) {
    const div = document.createElement("div");
    div.className = "actions";
    div.append(...buttons);
    return div;
  }

  function renderMessages() {
    const box = $("messages");
    box.textContent = "";
    const conv = current();
    conv.messages.forEach((msg, i) => {
      const el = document.createElement("div");
      el.dataset.index = i;
      fillMessage(el, msg);
      box.append(el);
    });
    if (!conv.messages.length) box.append(note("empty muted", "Send a message to start."));
    box.scrollTop = box.scrollHeight;
  }

  function renderAll() {
    renderSidebar();
    renderMessages();
    const busy = running !== null;
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  function paint() {  /* the streaming message, at most once a frame */
    if (painting) return;
    painting = true;
    requestAnimationFrame(() => {
      painting = false;
      if (!running || running.conv.id !== current().id) return;
      const box = $("messages");
      const i = running.conv.messages.indexOf(running.msg);
      const el = box.querySelector(`.msg[data-index="${i}"]`) || box.children[i];
      const follow = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
      if (el) fillMessage(el, running.msg);
      if (follow) box.scrollTop = box.scrollHeight;
    });
  }

  /* ---------------------------------------------------------------- generation */

  function requestBody(conv) {
    const messages = [];
    if (settings.system && settings.system.trim()) messages.push({role: "system", content: settings.system});
    for (const m of conv.messages) {
      if (m.pending) continue;
      if (m.role === "user") messages.push({role: "user", content: m.content});
      else if (m.content || (m.tool_calls && m.tool_calls.length)) {
        const out = {role: "assistant", content: m.content || ""};
        if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
        messages.push(out);
      }
    }
    const body = {messages, stream: true};
    for (const name of NUMBERS) {
      const v = settings[name];
      if (v !== undefined && v !== null && v !== "") body[name] = Number(v);
    }
    if (settings.tools && settings.tools.trim()) body.tools = JSON.parse(settings.tools);
    return body;
  }

  function absorb(msg, chunk) {
    const choice = chunk.choices && chunk.choices[0];
    const delta = choice && choice.delta;
    if (delta) {
      if (delta.reasoning_content) msg.reasoning = (msg.reasoning || "") + delta.reasoning_content;
      if (delta.content) msg.content += delta.content;
      for (const tc of delta.tool_calls || []) {
        msg.tool_calls = msg.tool_calls || [];
        const at = tc.index || 0;
        const call = msg.tool_calls[at] || (msg.tool_calls[at] = {id: "", type: "function",
          function: {name: "", arguments: ""}});
        if (tc.id) call.id = tc.id;
        if (tc.function && tc.function.name) call.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
      }
      if ((delta.content || delta.reasoning_content || delta.tool_calls) && msg.ttft_ms == null) {
        msg.ttft_ms = performance.now() - msg.t0;
      }
    }
    if (choice && choice.finish_reason) msg.finish_reason = choice.finish_reason;
    if (chunk.timings) msg.timings = chunk.timings;
  }

  async function generate(conv) {
    let body;
    try {
      body = requestBody(conv);
    } catch (e) {
      $("settings-error").textContent = `Tools: ${e.message}`;
      return;
    }
    const msg = {role: "assistant", content: "", pending: true, t0: performance.now()};
    conv.messages.push(msg);
    conv.updated = Date.now();
    running = {conv, msg, controller: new AbortController()};
    renderAll();
    try {
      await MoerunAPI.stream("/v1/chat/completions", body, (chunk) => { absorb(msg, chunk); paint(); },
        running.controller.signal);
    } catch (e) {
      if (e.name === "AbortError") msg.stopped = true;
      else msg.error = e.status === 401 ? `refused: ${e.message}` : `error: ${e.message}`;
    }
    delete msg.pending;
    delete msg.t0;
    running = null;
    save();
    renderAll();
  }

  function send(text) {
    if (running || !text.trim()) return;
    const conv = current();
    if (!conv.messages.length) conv.title = text.trim().split("\n")[0].slice(0, 48);
    conv.messages.push({role: "user", content: text});
    save();
    generate(conv);
  }

  function stop() {
    if (running) running.controller.abort();
  }

  function regenerate(index) {
    if (running) return;
    const conv = current();
    conv.messages = conv.messages.slice(0, index);
    generate(conv);
  }

  function edit(index) {
    if (running) return;
    const conv = current();
    const el = $("messages").querySelector(`.msg[data-index="${index}"]`);
    el.textContent = "";
    const area = document.createElement("textarea");
    area.className = "edit-area";
    area.value = conv.messages[index].content;
    area.rows = Math.min(12, area.value.split("\n").length + 1);
    const go = button("resend", "Send", "Replace the message and send again from here");
    const cancel = button("cancel", "Cancel");
    go.addEventListener("click", () => {
      if (!area.value.trim()) return;
      conv.messages = conv.messages.slice(0, index);
      conv.messages.push({role: "user", content: area.value});
      save();
      generate(conv);
    });
    cancel.addEventListener("click", renderMessages);
    el.append(area, actions([go, cancel]));
    area.focus();
  }

  /* ---------------------------------------------------------------- settings, key, tabs */

  function loadSettings(defaults) {
    $("set-system").value = settings.system || "";
    $("set-tools").value = settings.tools || "";
    for (const name of NUMBERS) {
      const input = $(`set-${name}`);
      input.value = settings[name] == null ? "" : settings[name];
      if (defaults && defaults[name] !== undefined) {
        input.placeholder = name === "max_tokens" && defaults.n_predict < 0 ? "until the end" : String(defaults[name]);
      }
    }
  }

  function storeSettings() {
    settings.system = $("set-system").value;
    settings.tools = $("set-tools").value;
    for (const name of NUMBERS) settings[name] = $(`set-${name}`).value;
    $("settings-error").textContent = "";
    if (settings.tools.trim()) {
      try {
        if (!Array.isArray(JSON.parse(settings.tools))) $("settings-error").textContent = "Tools: not a JSON list";
      } catch (e) {
        $("settings-error").textContent = `Tools: ${e.message}`;
      }
    }
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  }

  function askKey(why) {
    const dialog = $("key-dialog");
    $("key-why").textContent = why || "This server asks for an API key.";
    $("key-input").value = "";
    if (!dialog.open) dialog.showModal();
    $("key-input").focus();
  }

  function show(view) {
    for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
    $("view-chat").hidden = view !== "chat";
    $("view-live").hidden = view !== "live";
    if (typeof MoerunLive !== "undefined") MoerunLive.visible(view === "live");
  }

  async function boot() {
    $("status").textContent = "connecting…";
    try {
      const props = await MoerunAPI.json("/props");
      $("model-name").textContent = props.model_alias || "";
      document.title = `moerun: ${props.model_alias}`;
      const params = Object.assign({n_predict: props.default_generation_settings.params.n_predict},
        props.default_generation_settings.params);
      loadSettings(params);
      $("status").textContent = `context ${props.n_ctx}, ${props.total_slots} slots`;
      if (typeof MoerunLive !== "undefined") MoerunLive.start();
    } catch (e) {
      if (e.status === 503) {
        $("status").textContent = "loading the model…";
        setTimeout(boot, 1000);
      } else {
        $("status").textContent = e.status === 401 ? "API key needed" : `error: ${e.message}`;
        if (e.status !== 401) setTimeout(boot, 3000);
      }
    }
  }

  function wire() {
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("input").value;
      if (!text.trim() || running) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", newConversation);
    $("conversations").addEventListener("click", (ev) => {
      const li = ev.target.closest("li");
      if (!li) return;
      if (ev.target.classList.contains("delete")) remove(li.dataset.id);
      else select(li.dataset.id);
    });
    $("messages").addEventListener("click", (ev) => {
      const t = ev.target;
      const el = t.closest(".msg");
      if (t.classList.contains("copy")) {
        navigator.clipboard && navigator.clipboard.writeText(t.closest(".code").querySelector("code").textContent);
      } else if (el && t.classList.contains("regenerate")) {
        regenerate(Number(el.dataset.index));
      } else if (el && t.classList.contains("edit")) {
        edit(Number(el.dataset.index));
      } else if (el && t.classList.contains("copy-msg")) {
        const msg = current().messages[Number(el.dataset.index)];
        navigator.clipboard && navigator.clipboard.writeText(msg.content);
      }
    });
    $("settings-button").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
    $("settings").addEventListener("input", storeSettings);
    for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
    $("key-button").addEventListener("click", () => askKey("The key this page sends to the server."));
    $("key-form").addEventListener("submit", () => {
      MoerunAPI.setKey($("key-input").value.trim(), $("key-remember").checked);
      boot();
    });
    $("key-clear").addEventListener("click", () => {
      MoerunAPI.setKey("", false);
      $("key-dialog").close();
    });
    MoerunAPI.onUnauthorized((message) => askKey(`The server refused the call: ${message}`));
  }

  document.addEventListener("DOMContentLoaded", () => {
    wire();
    loadSettings(null);
    renderAll();
    show(location.hash === "#live" ? "live" : "chat");
    boot();
  });

  return {send, stop, regenerate, current, show};
})();
