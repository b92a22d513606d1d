// The farm's web monitor. Everything a batch supplies (names, prompts, sweep values, errors,
// tracebacks, paths) reaches the page as text nodes or DOM properties, never as HTML.
"use strict";

const TOKEN_KEY = "pan2-render-farm-token";
const MAX_JOB_ROWS = 1000;  // a 20,000-job batch: the first rows, and a note
const EVENTS_SHOWN = 40;
const RECONNECT_MS = 1000;
const CELL_PX = 160;  // a grid cell's widest poster or placeholder
const DETAIL_CHARS = 300;  // an event's detail beyond this is cut (a traceback's is in the job's row)

const state = {
  snapshot: null,
  selected: null,  // the batch whose jobs are shown
  view: null,  // its /view answer
  viewKey: "",  // what the view was fetched for (a change fetches it again)
  fetching: false,
  blobs: new Map(),  // file path -> object URL (videos and posters, fetched with the token)
  previews: new Map(),  // job id -> {path, url}: its newest live preview's object URL (older ones revoked)
};

// ---------------------------------------------------------------- the token
// Given once in the page or as the fragment #token=... (a fragment never reaches the server or its
// logs), kept in sessionStorage (this tab only), and sent in the Authorization header alone.
function token() {
  const m = /^#token=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);  // out of the address bar and the history
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

function askToken(why) {
  sessionStorage.removeItem(TOKEN_KEY);
  $("token-form").hidden = false;
  $("forget").hidden = true;
  if (why) say(why, true);
  setConn("no token", "off");
}

async function api(path, {method = "GET", body} = {}) {
  const t = token();
  if (!t) throw new Refused(401, "no token");
  const opts = {method, cache: "no-store", headers: {"Authorization": "Bearer " + t}};
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  if (r.status === 401) {
    askToken("The farm refused the token: enter the one in ROOT/token.");
    throw new Refused(401, "the farm refused the token");
  }
  if (!r.ok) {
    let text = r.statusText;
    try { text = (await r.json()).error || text; } catch (e) { /* not JSON */ }
    throw new Refused(r.status, text);
  }
  return r;
}

class Refused extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// ---------------------------------------------------------------- small helpers
function $(id) { return document.getElementById(id); }

// An element from properties and children; a string child becomes a text node.
// Text from a ledger or the queue is shown as text (never markup), and its control and bidi
// characters as escapes: a name cannot reorder what follows it ("gnp.exe" shown as "exe.png").
const UNSHOWN = /[\u0000-\u001f\u007f-\u009f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
function shown(v) {
  return typeof v === "string" ? v.replace(UNSHOWN, c => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0")) : v;
}

function el(tag, props = {}, ...kids) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v === undefined || v === null) continue;
    if (k === "class") n.className = v;
    else if (k === "dataset") Object.assign(n.dataset, v);
    else if (k === "style") Object.assign(n.style, v);  // CSSOM, which the CSP allows (a style attribute it does not)
    else if (k.includes("-")) n.setAttribute(k, shown(v));  // aria-*: names fixed here, values text
    else if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
    else n[k] = shown(v);
  }
  for (const kid of kids.flat()) if (kid !== null && kid !== undefined && kid !== false) n.append(shown(kid));
  return n;
}

// Rebuild a cell only when what it shows changed, so an open traceback, a playing video or a
// number being typed survive the next snapshot.
function setCell(node, key, build) {
  if (node._key === key) return;
  node._key = key;
  node.replaceChildren(...[build()].flat().filter(x => x !== null && x !== undefined).map(shown));
}

function duration(s) {  // as the CLI prints it: 42s, 3m05s, 2h10m
  if (s === null || s === undefined) return "?";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}

function clock(at) { return new Date(at * 1000).toLocaleTimeString(); }

function say(text, bad = false) {
  const m = $("message");
  m.textContent = text;
  m.className = bad ? "bad" : "";
  m.hidden = !text;
}

function setConn(text, cls) {
  const c = $("conn");
  c.textContent = text;
  c.className = "conn " + cls;
}

function batchSeq(id) { return Number(id.replace(/^b/, "")); }

// ---------------------------------------------------------------- the live stream
// fetch() reads the server-sent events so the stream carries the token in its header like every
// other request (EventSource cannot send one): the events are parsed here and the stream
// reconnected after a drop.
async function follow() {
  for (;;) {
    if (!token()) { askToken(); return; }
    try {
      const r = await api("/api/stream");
      setConn("live", "on");
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += value;
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          onEvent(buf.slice(0, end));
          buf = buf.slice(end + 2);
        }
      }
    } catch (e) {
      if (e instanceof Refused && e.status === 401) return;
    }
    setConn("reconnecting", "off");
    await new Promise(done => setTimeout(done, RECONNECT_MS));
  }
}

function onEvent(block) {
  let kind = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;  // a keep-alive comment
    if (line.startsWith("event:")) kind = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (kind === "snapshot" && data.length) onSnapshot(JSON.parse(data.join("\n")));
}

function onSnapshot(snap) {
  state.snapshot = snap;
  $("farm").textContent = `${snap.host} · ${snap.gpus} GPU(s) on ${snap.cluster} · queue ${snap.queue_depth} job(s)`;
  const batches = ordered(snap.batches || []);
  if (!batches.some(b => b.id === state.selected)) state.selected = batches.length ? batches[0].id : null;
  renderQueue(batches);
  renderGroups(snap.groups || []);
  renderBatch();
  renderEvents();
  refreshView();
}

// The order jobs start in: batches not ended by priority (higher first), then submission; then the
// ended ones, newest first.
function ordered(batches) {
  const ended = b => !["active", "paused"].includes(b.state);
  return [...batches].sort((a, b) =>
    (ended(a) - ended(b)) ||
    (ended(a) ? batchSeq(b.id) - batchSeq(a.id) : (b.priority - a.priority) || (batchSeq(a.id) - batchSeq(b.id))));
}

// ---------------------------------------------------------------- the queue
function renderQueue(batches) {
  const body = $("batches").tBodies[0];
  $("no-batches").hidden = batches.length > 0;
  const rows = new Map([...body.rows].map(r => [r.dataset.batch, r]));
  batches.forEach((b, i) => {
    let row = rows.get(b.id);
    if (!row) row = queueRow(b);
    rows.delete(b.id);
    if (body.rows[i] !== row) body.insertBefore(row, body.rows[i] || null);
    updateQueueRow(row, b);
  });
  for (const gone of rows.values()) gone.remove();
}

function queueRow(b) {
  const input = el("input", {type: "number", step: 1, value: b.priority, "aria-label": "priority of " + b.id});
  const set = el("button", {type: "button", dataset: {action: "priority"}, onclick: () => {
    const p = Number(input.value);
    if (!Number.isInteger(p)) { say("A priority is a whole number.", true); return; }
    act(b.id, "priority", {priority: p});
  }}, "set");
  input.addEventListener("keydown", e => { if (e.key === "Enter") set.click(); });
  const row = el("tr", {dataset: {batch: b.id}, id: "batch-" + b.id},
    el("td", {class: "id"}), el("td", {class: "owner"}), el("td", {class: "priority"}, input, set),
    el("td", {class: "state"}), el("td", {class: "counts"}), el("td", {class: "eta"}),
    el("td", {class: "actions"}));
  row._input = input;
  return row;
}

function updateQueueRow(row, b) {
  const c = b.counts || {};
  const [idCell, owner, , st, counts, eta, actions] = row.cells;
  row.classList.toggle("selected", b.id === state.selected);
  setCell(idCell, b.id, () => el("button", {type: "button", class: "link", title: b.out_dir,
                                              onclick: () => select(b.id)}, b.id));
  setCell(owner, b.owner, () => b.owner);
  if (document.activeElement !== row._input) row._input.value = b.priority;
  setCell(st, b.state + (b.reason || ""), () => el("span", {class: "badge " + b.state, title: b.reason || ""}, b.state));
  setCell(counts, JSON.stringify(c), () => [
    el("b", {}, String(c.done || 0)), " / ", el("span", {class: (c.failed ? "bad" : "")}, String(c.failed || 0)),
    " / " + (c.total || 0)]);
  const left = b.state === "active" || b.state === "paused";
  eta.textContent = left ? (b.eta_s === null ? "?" : duration(b.eta_s)) : "-";
  setCell(actions, b.state, () => {
    const button = (action, label) => el("button", {type: "button", dataset: {action},
                                                    onclick: () => act(b.id, action)}, label);
    if (b.state === "active") return [button("pause", "pause"), button("cancel", "cancel")];
    if (b.state === "paused") return [button("unpause", "unpause"), button("cancel", "cancel")];
    return [button("retry", "retry")];
  });
}

async function act(batch, action, body = {}) {
  if (action === "cancel" && !confirm(`Cancel ${body.job ? "job " + body.job + " of " : ""}batch ${batch}?`)) return;
  try {
    await api(`/api/batches/${encodeURIComponent(batch)}/${action}`, {method: "POST", body});
    say(`${batch}: ${action} done`);
  } catch (e) {
    say(`${batch}: ${action} refused: ${e.message}`, true);
  }
}

function select(id) {
  state.selected = id;
  state.view = null;
  state.viewKey = "";
  onSnapshot(state.snapshot);
}

// ---------------------------------------------------------------- GPU groups
function renderGroups(groups) {
  $("no-groups").hidden = groups.length > 0;
  const now = Date.now() / 1000;
  $("groups").tBodies[0].replaceChildren(...groups.map(g => el("tr", {class: g.state.replace(/ /g, "-")},
    el("td", {}, g.id), el("td", {}, String(g.gpus)), el("td", {}, g.models.join(", ") || "-"),
    el("td", {}, el("span", {class: "badge " + g.state.replace(/ /g, "-")}, g.state)),
    el("td", {}, g.since ? duration(now - g.since) : "-"), el("td", {}, g.jobs.join(", ") || "-"),
    el("td", {}, String(g.faults)))));
}

// ---------------------------------------------------------------- one batch: its jobs and grids
function selectedBatch() {
  return (state.snapshot && state.snapshot.batches || []).find(b => b.id === state.selected) || null;
}

function runningOf(batchId) {
  return new Map((state.snapshot.running || []).filter(r => r.batch === batchId).map(r => [r.job, r]));
}

// The view is fetched again when the batch's counts, state or running jobs (and their stages) change.
async function refreshView() {
  const b = selectedBatch();
  if (!b || state.fetching) return;
  const stages = [...runningOf(b.id).values()].map(r => r.job + ":" + r.stage);
  const key = JSON.stringify([b.id, b.state, b.counts, b.running, b.priority, stages]);
  if (key === state.viewKey) return;
  state.fetching = true;
  try {
    const view = await (await api(`/api/batches/${encodeURIComponent(b.id)}/view`)).json();
    if (view.batch.id === state.selected) {
      state.view = view;
      state.viewKey = key;
      renderBatch();
      renderEvents();
    }
  } catch (e) {
    say(`${b.id}: ${e.message}`, true);
  } finally {
    state.fetching = false;
  }
  if (state.viewKey !== key) setTimeout(refreshView, 200);
}

function renderBatch() {
  const b = selectedBatch();
  const section = $("batch-section");
  section.hidden = !b;
  if (!b) return;
  setCell($("batch-title"), b.id + b.out_dir, () => ["Batch " + b.id + " ", el("small", {class: "muted"}, b.out_dir)]);
  const view = state.view && state.view.batch.id === b.id ? state.view : null;
  setCell($("batch-links"), JSON.stringify([b.out_dir, view && view.report]), () => links(b, view));
  if (!view) return;
  const live = runningOf(b.id);
  renderGrids(view, live);
  renderJobs(view, b, live);
}

function fileUrl(path) { return "file://" + encodeURI(path); }

// A browser opens file:// links from an http page only when asked directly (middle click, copy),
// so the paths are shown too.
function links(b, view) {
  const parts = [el("a", {href: fileUrl(b.out_dir), title: "the batch's folder"}, "folder"), " ",
                 el("code", {}, b.out_dir)];
  if (view && view.report) parts.push(" · ", el("a", {href: fileUrl(view.report), title: "the batch's report"}, "report"),
                                      " ", el("code", {}, view.report));
  else parts.push(" · ", el("span", {class: "muted"}, "report: written when a job ends"));
  return parts;
}

function liveText(job, live) {
  const r = live.get(job.id);
  if (!r && job.after) return "after: " + job.after.join(", ");  // a pending job waiting for the jobs it runs after
  if (!r) return {done: "", pending: "waiting", cancelled: ""}[job.state] ?? (job.stage || "");
  if (r.step !== null && r.total) {
    return `${r.stage} ${r.step}/${r.total}` + (r.rate ? ` · ${r.rate.toFixed(2)} step/s` : "");
  }
  return `${r.stage} ${duration(r.stage_s)}`;
}

function stateOf(job, live) { return live.has(job.id) ? "running" : job.state; }

function renderJobs(view, b, live) {
  const body = $("jobs").tBodies[0];
  const jobs = view.jobs.slice(0, MAX_JOB_ROWS);
  $("jobs-more").hidden = view.jobs.length <= MAX_JOB_ROWS;
  $("jobs-more").textContent = `… and ${view.jobs.length - MAX_JOB_ROWS} more job(s): see the report.`;
  const rows = new Map([...body.querySelectorAll("tr[data-job]")].map(r => [r.dataset.job, r]));
  const errors = new Map([...body.querySelectorAll("tr[data-error-of]")].map(r => [r.dataset.errorOf, r]));
  const wanted = [];
  for (const job of jobs) {
    const row = rows.get(job.id) || el("tr", {dataset: {job: job.id}}, ...[0, 1, 2, 3, 4, 5, 6].map(() => el("td")));
    updateJobRow(row, job, b, live);
    wanted.push(row);
    if (job.error) wanted.push(errorRow(job, errors.get(job.id)));
  }
  const keep = new Set(wanted);
  [...body.rows].forEach(r => { if (!keep.has(r)) r.remove(); });
  wanted.forEach((row, i) => { if (body.rows[i] !== row) body.insertBefore(row, body.rows[i] || null); });
}

function updateJobRow(row, job, b, live) {
  const [name, st, now, secs, attempts, media, actions] = row.cells;
  const shown = stateOf(job, live);
  row.className = shown + (job.superseded_by ? " superseded" : "");
  setCell(name, job.name + job.label + job.prompt + (job.long_video || ""), () => [
    el("span", {class: "name", title: job.id}, job.name), job.label ? el("span", {class: "label"}, " " + job.label) : null,
    el("div", {class: "prompt"}, job.prompt),
    job.long_video ? el("div", {class: "long-video muted"}, job.long_video) : null]);
  setCell(st, shown, () => el("span", {class: "badge " + shown}, shown));
  now.textContent = liveText(job, live);
  setCell(secs, JSON.stringify(job.seconds), () => stageSeconds(job.seconds));
  attempts.textContent = String(job.attempts);
  const preview = (live.get(job.id) || {}).preview || null;
  setCell(media, JSON.stringify([job.video, job.poster, preview && preview.url]), () => mediaOf(b.id, job, preview));
  const cancellable = ["pending", "running"].includes(shown) && ["active", "paused"].includes(b.state);
  setCell(actions, String(cancellable), () => cancellable
    ? el("button", {type: "button", dataset: {action: "cancel-job"},
                    onclick: () => act(b.id, "cancel", {job: job.id})}, "cancel") : null);
}

function errorRow(job, row) {
  row = row || el("tr", {class: "error-row", dataset: {errorOf: job.id}}, el("td", {colSpan: 7}));
  setCell(row.cells[0], JSON.stringify([job.stage, job.error, job.traceback]), () => [
    el("p", {class: "error"}, (job.stage ? job.stage + ": " : "") + (job.error || "").split("\n")[0]),
    job.traceback ? el("details", {class: "traceback"}, el("summary", {}, "traceback"), el("pre", {}, job.traceback)) : null]);
  return row;
}

function stageSeconds(seconds) {
  const parts = Object.entries(seconds || {}).filter(([, s]) => s !== null && s !== undefined);
  return parts.length ? parts.map(([stage, s]) => `${stage} ${s < 10 ? s.toFixed(1) : Math.round(s)}`).join(" · ") : "";
}

// ---------------------------------------------------------------- videos and posters
// An <img> or <video> cannot send the token, so the file is fetched with it and shown from a blob.
async function blobUrl(batch, path) {
  const key = batch + "/" + path;
  if (!state.blobs.has(key)) {
    const promise = api(`/api/batches/${encodeURIComponent(batch)}/files/${path.split("/").map(encodeURIComponent).join("/")}`)
      .then(r => r.blob()).then(blob => URL.createObjectURL(blob));
    promise.catch(() => state.blobs.delete(key));
    state.blobs.set(key, promise);
  }
  return state.blobs.get(key);
}

// A running job's newest live preview: a strip of a few of its predicted frames, replaced as the
// snapshot names a newer one (the step rides in the URL's query, so each is fetched once).
function previewUrl(job, path) {
  const had = state.previews.get(job);
  if (had && had.path === path) return had.url;
  const url = api(path).then(r => r.blob()).then(blob => URL.createObjectURL(blob));
  state.previews.set(job, {path, url});
  if (had) had.url.then(old => setTimeout(() => URL.revokeObjectURL(old), 10000), () => {});
  return url;
}

function previewImg(job, preview) {
  const img = el("img", {class: "preview", alt: `live preview of ${job.name}`, dataset: {step: String(preview.step)},
                         title: `live preview: the frames predicted at step ${preview.step} of ${preview.steps}`});
  previewUrl(job.id, preview.url).then(url => { img.src = url; }, () => img.remove());
  return img;
}

function mediaOf(batch, job, preview) {
  if (!job.video) {
    return preview ? el("div", {class: "media"}, previewImg(job, preview),
                        el("span", {class: "muted"}, `preview at step ${preview.step}/${preview.steps}`)) : null;
  }
  const box = el("div", {class: "media"});
  const play = el("button", {type: "button", class: "play", dataset: {action: "play"}, title: "play " + job.name,
                             onclick: async () => {
    play.disabled = true;
    try {
      const video = el("video", {controls: true, muted: true, loop: true, playsInline: true, autoplay: true,
                                 width: job.width, height: job.height, src: await blobUrl(batch, job.video)});
      box.replaceChildren(video);
    } catch (e) {
      play.disabled = false;
      say(`${job.name}: the video could not be fetched: ${e.message}`, true);
    }
  }}, "▶ play");
  if (job.poster) {
    const img = el("img", {alt: "poster of " + job.name, width: job.width, height: job.height});
    blobUrl(batch, job.poster).then(url => { img.src = url; }, () => img.remove());
    play.prepend(img, el("br"));
  }
  box.append(play);
  return box;
}

// ---------------------------------------------------------------- a swept batch's grids
function renderGrids(view, live) {
  const byId = new Map(view.jobs.map(j => [j.id, j]));
  const key = JSON.stringify([view.grids, view.jobs.map(j => [j.id, stateOf(j, live), liveText(j, live), j.poster,
                                                            ((live.get(j.id) || {}).preview || {}).url])]);
  setCell($("grids"), key, () => view.grids.map(g => gridTable(g, byId, live, view.batch.id)));
}

function gridTable(g, byId, live, batch) {
  const head = [];
  if (g.col_axis) {
    head.push(el("tr", {}, ...g.row_axes.map(a => el("th", {class: "axis"}, a)),
                 el("th", {class: "axis", colSpan: g.col_values.length}, g.col_axis)));
    head.push(el("tr", {}, ...g.row_axes.map(() => el("th")), ...g.col_values.map(v => el("th", {class: "col"}, v))));
  }
  const rows = g.rows.map(r => el("tr", {},
    ...r.headers.map(h => el("th", {class: "row", rowSpan: h.rowspan}, h.text)),
    ...r.cells.map(ids => el("td", {}, ids.length ? gridCell(byId.get(ids[0]), live, batch) : null))));
  return el("section", {class: "grid"},
    el("h3", {}, g.name), el("p", {class: "prompt"}, g.caption),
    g.fixed.length ? el("p", {class: "fixed muted"}, g.fixed.map(([k, v]) => `${k} ${v}`).join(" · ")) : null,
    el("div", {class: "scroll"}, el("table", {class: "grid"}, el("thead", {}, ...head), el("tbody", {}, ...rows))));
}

function gridCell(job, live, batch) {
  if (!job) return null;
  const shown = stateOf(job, live);
  const figure = el("figure", {class: "cell " + shown, dataset: {job: job.id}, title: job.name + " " + job.label});
  const preview = (live.get(job.id) || {}).preview;
  if (job.poster) {
    const img = el("img", {alt: job.name, width: job.width, height: job.height});
    blobUrl(batch, job.poster).then(url => { img.src = url; }, () => img.remove());
    figure.append(img);
  } else if (preview) {
    figure.append(previewImg(job, preview));
  } else {
    const scale = Math.min(1, CELL_PX / job.width);
    figure.append(el("div", {class: "placeholder",
                             style: {width: job.width * scale + "px", height: job.height * scale + "px"}},
                     shown, el("br"), liveText(job, live)));
  }
  figure.append(el("figcaption", {}, el("span", {class: "badge " + shown}, shown), " " + (job.label || job.name)));
  return figure;
}

// ---------------------------------------------------------------- events
function renderEvents() {
  const snap = state.snapshot;
  if (!snap) return;
  const farm = (snap.events || []).map(e => ({at: e.at, who: e.batch || "farm", kind: e.kind, detail: e.detail}));
  const view = state.view && state.view.batch.id === state.selected ? state.view : null;
  const ledger = view ? view.events.map(e => ({at: e.at, who: e.job || view.batch.id, kind: e.kind, detail: e.detail})) : [];
  const all = [...farm, ...ledger].sort((a, b) => b.at - a.at).slice(0, EVENTS_SHOWN);
  setCell($("events"), JSON.stringify(all), () => all.map(e => el("li", {},
    el("time", {}, clock(e.at)), " ", el("b", {}, e.who), " ", el("span", {class: "kind"}, e.kind), " ",
    el("span", {class: "detail", title: e.detail}, cut(e.detail)))));
}

function cut(text) {
  const line = (text || "").split("\n")[0];
  return line.length > DETAIL_CHARS ? line.slice(0, DETAIL_CHARS) + "…" : line;
}

// ---------------------------------------------------------------- start
function start() {
  $("token-form").addEventListener("submit", e => {
    e.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
    $("token-input").value = "";
    $("token-form").hidden = true;
    say("");
    begin();
  });
  $("forget").addEventListener("click", () => { askToken(); location.reload(); });
  if (token()) begin(); else askToken();
}

function begin() {
  $("forget").hidden = false;
  follow();
}

start();
