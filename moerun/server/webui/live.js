/* The live view: GET /v1/moerun/state once a second while it is shown (every 5 s behind the chat, for the
   tok/s history; not while the page is hidden), drawn as a heat map of the
   experts (layers x experts, by recent use, cache residents marked), the expert-cache hit rate per layer for
   prefill and decode, tokens per second over time, the slots and the placement. */
"use strict";

const MoerunLive = (() => {
  const $ = (id) => document.getElementById(id);
  const PERIOD_MS = 1000;
  const HIDDEN_PERIOD_MS = 5000;  /* while the chat is shown: the tok/s history only */
  const HISTORY = 180;  /* seconds of the tok/s chart */
  const RAMP = [[24, 28, 52], [44, 92, 170], [80, 170, 190], [230, 180, 60], [228, 80, 56]];
  let timer = null, started = false, shown = false, last = null, heat = null;
  let prev = null;  /* the last sample: {t, prompt, generated} */
  const rates = [];  /* {t, prompt, gen}: tok/s since the sample before */

  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function colour(v) {  /* v in [0, 1] -> rgb along the ramp */
    const x = Math.max(0, Math.min(1, v)) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(x));
    const f = x - i;
    const c = RAMP[i].map((a, k) => Math.round(a + f * (RAMP[i + 1][k] - a)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function cell(tag, text, cls) {
    const td = document.createElement(tag);
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }

  function fillBody(table, rows) {
    const body = $(table).tBodies[0];
    body.textContent = "";
    for (const r of rows) body.append(r);
  }

  /* ---------------------------------------------------------------- heat map */

  function drawHeat(experts) {
    const canvas = $("heatmap");
    const ctx = canvas.getContext("2d");
    if (!experts || !experts.layers.length) {
      $("heat-note").textContent = "— no expert cache: start the server with --expert-cache-mib or " +
        "--expert-cache-slots to count each expert's use (resident experts run in C, uncounted)";
      canvas.width = canvas.width;  /* clears it */
      heat = null;
      return;
    }
    $("half-life").textContent = experts.half_life_steps;
    const layers = experts.layers;
    const n = Math.max(...layers.map((l) => l.recent.length));
    const label = 34;
    const avail = Math.max(200, canvas.parentElement.clientWidth - 4);
    const w = Math.max(3, Math.floor((avail - label) / n));
    const h = Math.max(8, Math.min(22, Math.floor(360 / layers.length)));
    canvas.width = label + w * n;
    canvas.height = h * layers.length + 14;
    let top = 0;
    for (const l of layers) for (const v of l.recent) top = Math.max(top, v);
    ctx.fillStyle = "#0f1117";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.font = "10px sans-serif";
    ctx.textBaseline = "middle";
    layers.forEach((l, row) => {
      const y = row * h;
      ctx.fillStyle = "#9aa3b2";
      ctx.fillText(String(l.layer), 4, y + h / 2);
      const resident = new Set(l.resident);
      l.recent.forEach((v, e) => {
        ctx.fillStyle = colour(top > 0 ? Math.sqrt(v / top) : 0);
        ctx.fillRect(label + e * w, y, Math.max(1, w - (w > 4 ? 1 : 0)), h - 1);
        if (resident.has(e)) {
          ctx.fillStyle = "#ffffff";
          ctx.fillRect(label + e * w, y + h - 3, Math.max(1, w - 1), 2);
        }
      });
    });
    ctx.fillStyle = "#9aa3b2";
    ctx.fillText(`experts 0-${n - 1}   layers ${layers[0].layer}-${layers[layers.length - 1].layer}`, label,
      h * layers.length + 7);
    const steps = layers.reduce((s, l) => s + l.steps, 0);
    canvas.dataset.steps = steps;
    $("heat-note").textContent = `— ${layers.length} layers × ${n} experts, ${steps} layer steps counted`;
    heat = {layers, w, h, label};
  }

  function heatTip(ev) {
    const tip = $("heat-tip");
    if (!heat) { tip.hidden = true; return; }
    const rect = ev.target.getBoundingClientRect();
    const x = (ev.clientX - rect.left) * (ev.target.width / rect.width);
    const y = (ev.clientY - rect.top) * (ev.target.height / rect.height);
    const row = Math.floor(y / heat.h), e = Math.floor((x - heat.label) / heat.w);
    const l = heat.layers[row];
    if (!l || e < 0 || e >= l.recent.length) { tip.hidden = true; return; }
    tip.hidden = false;
    tip.textContent = `layer ${l.layer}, expert ${e}: recent ${l.recent[e].toFixed(2)}, since start ${l.total[e]} ` +
      `steps${l.resident.includes(e) ? ", in the cache" : ""}`;
    tip.style.left = `${ev.clientX - rect.left + 12}px`;
    tip.style.top = `${ev.clientY - rect.top + 12}px`;
  }

  /* ---------------------------------------------------------------- hit rates */

  function hitCell(layer, phase, c) {
    const td = document.createElement("td");
    td.className = "hit";
    td.dataset.layer = layer;
    td.dataset.phase = phase;
    td.dataset.hits = c.hits;
    td.dataset.queries = c.queries;
    const bar = document.createElement("div");
    bar.className = `bar ${phase}`;
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.width = c.queries ? `${(100 * c.hits / c.queries).toFixed(1)}%` : "0";
    bar.append(fill);
    const text = document.createElement("span");
    text.className = "figure";
    text.textContent = c.queries ? `${(100 * c.hits / c.queries).toFixed(1)}% (${c.hits}/${c.queries})` : "—";
    td.append(bar, text);
    return td;
  }

  function drawHits(cache) {
    if (!cache) {
      const tr = document.createElement("tr");
      tr.append(cell("td", "no expert cache", "muted"));
      fillBody("hits", [tr]);
      return;
    }
    fillBody("hits", cache.map((row) => {
      const tr = document.createElement("tr");
      tr.dataset.layer = row.layer;
      tr.append(cell("td", String(row.layer)), hitCell(row.layer, "prefill", row.prefill),
        hitCell(row.layer, "decode", row.decode));
      return tr;
    }));
  }

  /* ---------------------------------------------------------------- tok/s */

  function record(state) {
    const t = state.time;
    const s = {t, prompt: state.tokens.prompt, generated: state.tokens.generated};
    if (prev && t > prev.t) {
      rates.push({t, prompt: (s.prompt - prev.prompt) / (t - prev.t), gen: (s.generated - prev.generated) / (t - prev.t)});
      while (t - rates[0].t > HISTORY) rates.shift();
    }
    prev = s;
  }

  function drawRates() {
    const canvas = $("rate");
    const ctx = canvas.getContext("2d");
    canvas.width = Math.max(300, canvas.parentElement.clientWidth - 4);
    const W = canvas.width, H = canvas.height, pad = 28;
    ctx.fillStyle = "#0f1117";
    ctx.fillRect(0, 0, W, H);
    const top = Math.max(1, ...rates.map((r) => Math.max(r.gen, r.prompt)));
    ctx.strokeStyle = "#2a2f3a";
    ctx.fillStyle = "#9aa3b2";
    ctx.font = "10px sans-serif";
    for (let k = 0; k <= 4; k++) {
      const y = pad / 2 + (H - pad) * (1 - k / 4);
      ctx.beginPath(); ctx.moveTo(pad + 8, y); ctx.lineTo(W, y); ctx.stroke();
      ctx.fillText((top * k / 4).toFixed(top < 10 ? 1 : 0), 2, y + 3);
    }
    const now = rates.length ? rates[rates.length - 1].t : 0;
    const span = Math.round(Math.min(HISTORY, Math.max(60, rates.length ? now - rates[0].t : 0)));  /* seconds */
    const x = (t) => pad + 8 + (W - pad - 8) * (1 - (now - t) / span);
    const y = (v) => pad / 2 + (H - pad) * (1 - v / top);
    for (const [key, colourOf] of [["prompt", "#e3b341"], ["gen", "#50aabe"]]) {
      ctx.strokeStyle = colourOf;
      ctx.lineWidth = 2;
      ctx.beginPath();
      rates.forEach((r, i) => (i ? ctx.lineTo(x(r.t), y(r[key])) : ctx.moveTo(x(r.t), y(r[key]))));
      ctx.stroke();
    }
    ctx.lineWidth = 1;
    ctx.fillStyle = "#9aa3b2";
    ctx.fillText(`last ${span} s`, W - 60, H - 4);
    const latest = rates[rates.length - 1];
    $("rate-now").textContent = latest ? `now: generation ${latest.gen.toFixed(1)} tok/s, prompt `
      + `${latest.prompt.toFixed(1)} tok/s` : "";
  }

  /* ---------------------------------------------------------------- slots, placement */

  function drawSlots(slots) {
    fillBody("slots", slots.map((s) => {
      const tr = document.createElement("tr");
      tr.dataset.state = s.state;
      const r = s.request;
      tr.append(cell("td", String(s.id)), cell("td", s.state, `state ${s.state}`), cell("td", String(s.n_tokens)),
        cell("td", r ? String(r.n_prompt) : "—"), cell("td", r ? String(r.n_cached) : String(s.n_tokens)),
        cell("td", r ? String(r.n_generated) : "—"));
      return tr;
    }));
  }

  function drawPlacement(p) {
    fillBody("devices", p.devices.map((d) => {
      const tr = document.createElement("tr");
      const slots = [...new Set(d.expert_slots)].filter((s) => s > 0);
      tr.append(cell("td", d.device), cell("td", d.layers[1] > d.layers[0] ? `${d.layers[0]}-${d.layers[1] - 1}` : "—"),
        cell("td", fmtBytes(d.dense_bytes)), cell("td", fmtBytes(d.kv_bytes)), cell("td", fmtBytes(d.cache_bytes)),
        cell("td", slots.length ? slots.join("/") : "—"));
      return tr;
    }));
    const rows = p.tensors.map((t) => {
      const tr = document.createElement("tr");
      tr.append(cell("td", t.tensor, "mono"), cell("td", String(t.count)), cell("td", t.device),
        cell("td", t.tier + (t.cached ? " (through the cache)" : ""), `tier ${t.tier}`), cell("td", fmtBytes(t.bytes)));
      return tr;
    });
    const by = p.totals.bytes_by_tier;
    const tr = document.createElement("tr");
    tr.className = "total";
    tr.append(cell("td", `home of the routed experts: ${p.home}`), cell("td", ""), cell("td", ""),
      cell("td", Object.entries(by).filter(([, v]) => v).map(([k, v]) => `${k} ${fmtBytes(v)}`).join(", ")),
      cell("td", fmtBytes(p.totals.model_bytes)));
    rows.push(tr);
    fillBody("tensors", rows);
  }

  /* ---------------------------------------------------------------- polling */

  const drawn = {};  /* part -> the JSON it was last drawn from: an unchanged part is not drawn again */

  function redraw(part, data, fn) {
    const key = JSON.stringify(data === undefined ? null : data);
    if (drawn[part] === key) return;
    drawn[part] = key;
    fn(data);
  }

  function render() {
    if (!shown || !last) return;
    redraw("heat", last.experts, drawHeat);
    redraw("hits", last.cache, drawHits);
    drawRates();
    redraw("slots", last.slots, drawSlots);
    redraw("placement", last.placement, drawPlacement);
  }

  function draw(state) {
    last = state;
    record(state);
    render();
  }

  async function poll() {
    timer = null;
    if (document.visibilityState === "visible") {
      try {
        draw(await MoerunAPI.json("/v1/moerun/state"));
        $("view-live").dataset.polls = String(Number($("view-live").dataset.polls || 0) + 1);
      } catch (e) {
        if (e.status === 401) return;  /* the key dialog is open: boot() starts again */
      }
    }
    timer = setTimeout(poll, shown ? PERIOD_MS : HIDDEN_PERIOD_MS);
  }

  function start() {
    if (timer !== null) clearTimeout(timer);
    started = true;
    poll();
  }

  function visible(on) {
    shown = on;
    if (on) for (const part of Object.keys(drawn)) delete drawn[part];  /* sizes may have changed meanwhile */
    render();
    if (on && started && timer !== null) {  /* back from the chat: poll now, not at the slow pace */
      clearTimeout(timer);
      poll();
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("heatmap").addEventListener("mousemove", heatTip);
    $("heatmap").addEventListener("mouseleave", () => { $("heat-tip").hidden = true; });
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "visible" && started && timer === null) poll();
    });
  });

  return {start, visible, state: () => last};
})();
