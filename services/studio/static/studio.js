// grpo-mesh studio: one page, no build step, no third-party code. It polls the studio's JSON API
// (services/studio/app.py) every 2 s: the run's state and the metrics rows that landed since the
// last poll (a byte offset into metrics.jsonl), and redraws the curves as SVG. No page reload.
"use strict";

const POLL_MS = 2000;
const $ = (sel) => document.querySelector(sel);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
};
const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "–"
  : (typeof v === "number" ? (Math.abs(v) >= 1000 ? v.toFixed(0) : Number(v.toPrecision(digits)).toString()) : String(v));

async function api(path, options = {}) {
  const response = await fetch(path, {headers: {"content-type": "application/json"}, ...options});
  let body = null;
  try { body = await response.json(); } catch (_) { body = {}; }
  if (!response.ok) { const err = new Error(body.error || response.statusText); err.status = response.status; err.body = body; throw err; }
  return body;
}

const state = {run: null, offset: 0, steps: [], evals: [], lastStepSeen: -1, timer: null};

// ---- curves ---------------------------------------------------------------------------------------
const CHARTS = [
  {id: "reward", title: "train reward (mean)", series: [["reward_mean", "#2e9b55"]]},
  {id: "eval", title: "held-out accuracy", series: [["eval/accuracy", "#3467d6"]], rows: "evals"},
  {id: "loss", title: "loss", series: [["loss", "#c8372d"]]},
  {id: "staleness", title: "staleness (versions)", series: [["staleness_mean", "#7a6bd1"], ["staleness_max", "#c9c1f2"]]},
  {id: "sync", title: "weight sync ms", series: [["sync_ms", "#c48a12"]]},
  {id: "tps", title: "tokens / s", series: [["tokens_per_s", "#1c8ea8"]]},
  {id: "idle", title: "learner idle (fraction of step wall time)", series: [["learner_idle", "#555"]]},
  {id: "align", title: "max |learner − rollout| logprob (alignment probe)", series: [["logprob_abs_diff_max", "#b0417a"]]},
];

function curriculumChart() {
  const keys = new Set();
  for (const row of state.steps) for (const k of Object.keys(row)) if (/^curriculum\/.*success/.test(k)) keys.add(k);
  if (!keys.size) return null;
  const palette = ["#2e9b55", "#3467d6", "#c48a12", "#c8372d", "#7a6bd1", "#1c8ea8"];
  return {id: "curriculum", title: "curriculum: success rate by level", series: [...keys].sort().map((k, i) => [k, palette[i % palette.length]])};
}

function drawChart(spec) {
  const rows = spec.rows === "evals" ? state.evals : state.steps;
  let card = document.getElementById("chart-" + spec.id);
  if (!card) {
    card = el("div", {class: "chart", id: "chart-" + spec.id, "data-testid": "chart-" + spec.id});
    $("#charts").append(card);
  }
  const points = spec.series.map(([key]) => rows.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]));
  const all = points.flat();
  const W = 380, H = 160, L = 40, B = 18;
  const last = points[0].length ? points[0][points[0].length - 1][1] : null;
  let svg = `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none"><line class="axis" x1="${L}" y1="${H - B}" x2="${W}" y2="${H - B}"/><line class="axis" x1="${L}" y1="0" x2="${L}" y2="${H - B}"/>`;
  if (all.length) {
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y1 += 0.5; y0 -= 0.5; }
    const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - 4), Y = (y) => (H - B) - (y - y0) / (y1 - y0) * (H - B - 6);
    spec.series.forEach(([key, colour], i) => {
      svg += `<polyline stroke="${colour}" points="${points[i].map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ")}"><title>${key}</title></polyline>`;
      if (points[i].length <= 40) for (const [x, y] of points[i]) svg += `<circle cx="${X(x).toFixed(1)}" cy="${Y(y).toFixed(1)}" r="2.2" fill="${colour}"/>`;
    });
    svg += `<text x="2" y="10">${fmt(y1)}</text><text x="2" y="${H - B}">${fmt(y0)}</text><text x="${L}" y="${H - 4}">step ${x0}</text><text x="${W - 50}" y="${H - 4}">${x1}</text>`;
  } else {
    svg += `<text x="${L + 10}" y="${H / 2}">no data yet</text>`;
  }
  card.innerHTML = `<h3>${spec.title}<span class="last">${fmt(last)}</span></h3>${svg}</svg>`;
}

function drawCharts() {
  const specs = [...CHARTS];
  const cur = curriculumChart();
  if (cur) specs.push(cur);
  specs.forEach(drawChart);
}

// A restarted scheduler may log a step again (it re-trains what its ledger had not acknowledged): the
// latest row of a step wins, and the curves are drawn in step order.
function upsert(list, row) {
  let i = list.length;
  while (i > 0 && list[i - 1].step >= row.step) i--;
  if (i < list.length && list[i].step === row.step) list[i] = row; else list.splice(i, 0, row);
}

function takeRows(rows) {
  for (const row of rows) {
    if (row.eval_only) { upsert(state.evals, row); continue; }
    if (typeof row.step !== "number" || row.step <= 0 || !("reward_mean" in row)) continue;
    upsert(state.steps, row);
  }
  state.steps.forEach((row, i) => {
    const prev = state.steps[i - 1];
    if (prev && prev.step === row.step - 1 && typeof row.time === "number" && typeof row.train_ms === "number") {
      const wall = (row.time - prev.time) * 1000;
      if (wall > 0) row.learner_idle = Math.max(0, 1 - row.train_ms / wall);
    }
  });
}

// ---- run state ------------------------------------------------------------------------------------
function showState(s) {
  const phase = $("#run-phase");
  phase.textContent = s.phase; phase.className = "phase " + s.phase;
  $("#run-why").textContent = s.live ? "" : (s.why || "");
  const st = s.status || {};
  const rows = [["directory", s.dir], ["step", `${st.step ?? "–"} / ${st.max_steps || "∞"}`], ["learner version", st.learner_version],
    ["reward (last step)", fmt(st.reward_mean)], ["loss", fmt(st.loss)], ["staleness (mean)", fmt(st.staleness_mean)],
    ["steps / s", fmt(st.steps_per_second)], ["tokens / s", fmt(st.tokens_per_second)], ["transport", st.weight_transport],
    ["alignment |Δ| max", fmt(st.logprob_abs_diff_max)], ["error", st.error || ""]];
  const levels = Object.entries(st.level_success || {}).sort(([a], [b]) => a.localeCompare(b, undefined, {numeric: true}));
  if (levels.length) rows.push(["level success", levels.map(([k, v]) => `${k}: ${fmt(v, 2)}`).join(" · ")]);
  if (s.process) rows.push(["started here", `pid ${s.process.pid}` + (s.process.exit_code === null ? "" : `, exited ${s.process.exit_code}`)]);
  const table = $("#state-table"); table.innerHTML = "";
  for (const [k, v] of rows) table.append(el("tr", {}, el("td", {text: k}), el("td", {text: v ?? "–"})));
  const sv = $("#service-table"); sv.innerHTML = "<tr><th>service</th><th>pid</th><th>running</th></tr>";
  for (const m of (s.services || [])) sv.append(el("tr", {}, el("td", {text: m.role}), el("td", {text: m.pid}), el("td", {text: m.running ? "yes" : "NO"})));
  const rt = $("#rollout-table"); rt.innerHTML = "<tr><th>rollout</th><th>address</th><th>version</th><th>load</th><th>healthy</th></tr>";
  for (const r of (st.rollouts || [])) {
    rt.append(el("tr", {}, el("td", {text: r.rollout_id}), el("td", {text: r.address}), el("td", {text: r.weight_version}),
      el("td", {text: `${r.in_flight}/${r.max_in_flight}`}), el("td", {text: r.healthy ? "yes" : "NO"})));
  }
}

async function pollEvents() {
  try {
    const {events} = await api(`/api/runs/${state.run}/events`);
    const list = $("#events"); list.innerHTML = "";
    for (const e of events.slice(-40)) {
      list.append(el("li", {text: `${new Date(e.at * 1000).toLocaleTimeString()} ${e.kind} ${JSON.stringify(e.detail)}`}));
    }
  } catch (_) { /* shown by the state line */ }
}

async function poll() {
  if (!state.run) return;
  const run = state.run;
  try {
    const s = await api(`/api/runs/${run}/state`);
    if (run === state.run) {
      if (s.phase !== state.phase) { state.phase = s.phase; pollEvents(); }
      showState(s);
    }
  } catch (err) { $("#run-phase").textContent = "studio: " + err.message; }
  try {
    const m = await api(`/api/runs/${run}/metrics?offset=${state.offset}`);
    if (run !== state.run) return;
    if (m.offset < state.offset) { state.steps = []; state.evals = []; }  // the file started over
    state.offset = m.offset;
    if (m.rows.length) { takeRows(m.rows); drawCharts(); }
    const lastStep = state.steps.length ? state.steps[state.steps.length - 1].step : -1;
    if (lastStep !== state.lastStepSeen) { state.lastStepSeen = lastStep; await refreshSteps(); await pollEvents(); }
  } catch (_) { /* the run dir may not have metrics yet */ }
}

function selectRun(id) {
  state.run = id; state.offset = 0; state.steps = []; state.evals = []; state.lastStepSeen = -2;
  $("#charts").innerHTML = ""; $("#groups").innerHTML = ""; drawCharts();
  localStorage.setItem("grpo-studio-run", id);
  refreshSources();
  poll();
}

async function refreshRuns(select) {
  const {runs} = await api("/api/runs");
  const sel = $("#run-select"); sel.innerHTML = "";
  for (const r of runs) sel.append(el("option", {value: r.id, text: r.id + (r.started_here ? " ●" : "")}));
  const want = select || state.run || localStorage.getItem("grpo-studio-run");
  const pick = runs.find((r) => r.id === want) ? want : (runs[0] && runs[0].id);
  if (pick) { sel.value = pick; if (pick !== state.run) selectRun(pick); }
}

// ---- start form -----------------------------------------------------------------------------------
async function submitForm(event) {
  event.preventDefault();
  const form = new FormData(event.target);
  const body = {};
  for (const [k, v] of form.entries()) {
    if (v === "") continue;
    if (k === "env_args") body[k] = v.split(/\s+/).filter(Boolean);
    else if (["steps", "group_size", "groups_per_batch", "seed", "eval_every"].includes(k)) body[k] = Number(v);
    else if (k === "lr") body[k] = Number(v);
    else if (k === "curriculum") body[k] = true;
    else body[k] = v;
  }
  const out = $("#form-errors"); out.textContent = "";
  try {
    const {id} = await api("/api/runs", {method: "POST", body: JSON.stringify(body)});
    out.textContent = "";
    await refreshRuns(id);
  } catch (err) {
    const errors = (err.body && err.body.errors) || {};
    out.textContent = Object.keys(errors).length ? Object.entries(errors).map(([k, v]) => `${k}: ${v}`).join("\n") : err.message;
  }
}

async function control(action) {
  const msg = $("#control-msg"); msg.textContent = action + ": sending (a restarting scheduler is waited for)";
  try { await api(`/api/runs/${state.run}/${action}`, {method: "POST"}); msg.textContent = action + ": sent"; poll(); }
  catch (err) { msg.textContent = err.message; }
}

// ---- trajectories ---------------------------------------------------------------------------------
const VERSION_COLOURS = ["#d7ecff", "#ffe3c2", "#d9f5d9", "#f3d9f5", "#fff4b8", "#d4f1f4", "#ffd6d6", "#e4dcff"];

async function refreshSteps() {
  try {
    const {steps} = await api(`/api/runs/${state.run}/steps`);
    const sel = $("#step-select");
    const keep = sel.value;
    sel.innerHTML = "";
    for (const s of steps.slice().reverse()) sel.append(el("option", {value: s.step, text: `batch ${s.step} · trains v${s.train_version} · reward ${fmt(s.reward_mean)}`}));
    if (keep && steps.some((s) => String(s.step) === keep)) sel.value = keep;
    if (!$("#groups").children.length && steps.length) showGroups();
  } catch (_) { /* no ledger yet */ }
}

function tokenSpan(t) {
  if (t.version === null) return el("span", {class: "tok env", text: t.text, title: "environment token (not trained)"});
  const span = el("span", {class: "tok", text: t.text});
  span.style.background = VERSION_COLOURS[t.version % VERSION_COLOURS.length];
  let title = `v${t.version} · rollout logprob ${fmt(t.logprob)}`;
  if (t.learner_logprob !== null) {
    const d = Math.abs(t.learner_logprob - t.logprob);
    span.style.borderBottomColor = `rgba(200, 30, 30, ${Math.min(1, d / 0.5).toFixed(3)})`;
    title += ` · learner ${fmt(t.learner_logprob)} · |Δ| ${fmt(d)}`;
  }
  span.title = title;
  return span;
}

async function showGroups() {
  const step = $("#step-select").value;
  if (!step) return;
  const q = new URLSearchParams();
  const minR = $("#f-min-reward").value, maxR = $("#f-max-reward").value, fail = $("#f-failure").value, stale = $("#f-staleness").value;
  if (minR !== "") q.set("min_reward", minR); if (maxR !== "") q.set("max_reward", maxR);
  if (fail) q.set("failure", fail); if (stale) q.set("min_staleness", stale);
  const box = $("#groups");
  try {
    const data = await api(`/api/runs/${state.run}/steps/${step}?${q}`);
    if ($("#step-select").value !== step) return;  // another step was chosen meanwhile: its answer wins
    box.innerHTML = "";
    box.dataset.step = step;
    box.append(el("p", {class: "legend", text: `${data.groups.length} of ${data.total_groups} groups shown`}));
    for (const g of data.groups) {
      const card = el("div", {class: "group", "data-testid": "group"});
      card.append(el("div", {class: "legend", text: `${g.group_id} · trained at v${g.train_version} · ${g.rollout_id} · answer ${g.reference_answer}`}));
      card.append(el("div", {class: "prompt", text: g.prompt}));
      for (const c of g.completions) {
        const adv = el("b", {class: c.advantage >= 0 ? "pos" : "neg", text: fmt(c.advantage)});
        const meta = el("div", {class: "meta"}, `#${c.index} reward ${fmt(c.reward)} · advantage `, adv,
          ` · staleness ${c.staleness}` + (c.failure ? ` · failure ${c.failure}` : "") + (c.max_abs_diff !== null ? ` · max|Δ| ${fmt(c.max_abs_diff)}` : ""));
        const tokens = el("div", {class: "tokens", "data-testid": "completion"});
        c.tokens.forEach((t) => tokens.append(tokenSpan(t)));
        card.append(el("div", {class: "completion"}, meta, tokens));
      }
      box.append(card);
    }
  } catch (err) { box.textContent = err.message; }
}

// ---- policy ---------------------------------------------------------------------------------------
function askBody() {
  return {prompt: $("#chat-prompt").value, chat: $("#chat-template").checked,
    temperature: Number($("#chat-temp").value || 1), max_tokens: Number($("#chat-max").value || 16)};
}

async function chat() {
  const log = $("#chat-log");
  const body = askBody();
  log.append(el("div", {class: "q", text: "› " + body.prompt}));
  try {
    const a = await api(`/api/runs/${state.run}/chat`, {method: "POST", body: JSON.stringify(body)});
    log.append(el("div", {class: "a", "data-testid": "chat-answer", text: a.text + `\n(v${a.version}, ${a.tokens} tokens)`}));
  } catch (err) { log.append(el("div", {class: "a", text: "error: " + err.message})); }
  log.scrollTop = log.scrollHeight;
}

async function refreshSources() {
  try {
    const {sources} = await api(`/api/runs/${state.run}/checkpoints`);
    for (const [id, pick] of [["#cmp-left", "base"], ["#cmp-right", sources[sources.length - 1]]]) {
      const sel = $(id); const keep = sel.value; sel.innerHTML = "";
      for (const s of sources) sel.append(el("option", {value: s, text: s}));
      sel.value = sources.includes(keep) ? keep : pick;
    }
  } catch (_) { /* no run */ }
}

async function compare() {
  const out = $("#compare-out"); out.innerHTML = "comparing …";
  try {
    const r = await api(`/api/runs/${state.run}/compare`, {method: "POST", body: JSON.stringify({...askBody(), left: $("#cmp-left").value, right: $("#cmp-right").value})});
    out.innerHTML = "";
    for (const a of [r.left, r.right]) out.append(el("div", {}, el("b", {text: a.source + (a.version !== null ? ` (v${a.version})` : "")}), el("div", {class: "answer", "data-testid": "compare-answer", text: a.text})));
  } catch (err) { out.textContent = err.message; }
}

// ---- wiring ---------------------------------------------------------------------------------------
document.querySelectorAll("header nav button").forEach((b) => b.addEventListener("click", () => {
  document.querySelectorAll("header nav button").forEach((x) => x.classList.toggle("active", x === b));
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t.id === "tab-" + b.dataset.tab));
  if (b.dataset.tab === "watch") drawCharts();
  if (b.dataset.tab === "trajectories") showGroups();
  if (b.dataset.tab === "policy") refreshSources();
}));
$("#run-select").addEventListener("change", (e) => selectRun(e.target.value));
$("#start-form").addEventListener("submit", submitForm);
$("#btn-pause").addEventListener("click", () => control("pause"));
$("#btn-resume").addEventListener("click", () => control("resume"));
$("#btn-stop").addEventListener("click", () => control("stop"));
$("#btn-filter").addEventListener("click", showGroups);
$("#step-select").addEventListener("change", showGroups);
$("#btn-chat").addEventListener("click", chat);
$("#btn-compare").addEventListener("click", compare);
refreshRuns().catch((err) => { $("#run-phase").textContent = "studio: " + err.message; });
state.timer = setInterval(() => { poll(); }, POLL_MS);
setInterval(() => { refreshRuns().catch(() => {}); }, 10 * POLL_MS);
