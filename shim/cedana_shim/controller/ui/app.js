// The dashboard: plain JavaScript, no dependency, served by the controller itself.
// Uses only the controller's JSON API (README "The dashboard"); the token stays in this
// tab's sessionStorage and goes with every call. Every element is built with
// createElement/textContent (never innerHTML): names and messages from the cluster
// cannot inject markup.
"use strict";

const TOKEN_KEY = "cedana.token";
const $ = (sel) => document.querySelector(sel);

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (v !== false && v !== null && v !== undefined) el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return i === 0 ? `${n} B` : `${v.toFixed(1)} ${units[i]}`;
}

function secs(s) { return s === null || s === undefined ? "" : `${Number(s).toFixed(2)} s`; }
function when(t) { return t ? new Date(t * 1000).toISOString().replace(".000", "") : ""; }

function say(message, error) {
  const box = $("#status");
  box.textContent = message || "";
  box.className = error ? "error" : "";
}

async function api(method, path, body) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const resp = await fetch(path, {
    method,
    headers: { "Authorization": `Bearer ${token}`, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const doc = await resp.json().catch(() => ({ error: `HTTP ${resp.status}` }));
  if (resp.status === 401) { signOut(doc.error); throw new Error(doc.error); }
  if (!resp.ok) throw new Error(doc.error || `HTTP ${resp.status}`);
  return doc;
}

// -- sign-in -----------------------------------------------------------------------------

let me = null;

function signOut(why) {
  sessionStorage.removeItem(TOKEN_KEY);
  me = null;
  $("#nav").hidden = true;
  $("#view").replaceChildren();
  $("#sign-in").hidden = false;
  say(why || "", Boolean(why));
  $("#token").focus();
}

async function signIn(event) {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
  $("#token").value = "";
  say("Signing in…");
  try {
    await start();
  } catch (err) {
    say(`Sign-in failed: ${err.message}`, true);
  }
}

async function start() {
  me = await api("GET", "/api/v1/whoami");
  $("#sign-in").hidden = true;
  $("#nav").hidden = false;
  $("#who").textContent = `signed in as ${me.user}`;
  const pick = $("#ns-pick");
  pick.replaceChildren(h("option", { value: "" }, "(choose)"),
    ...me.namespaces.map((ns) => h("option", { value: ns }, ns)));
  say("");
  if (!location.hash || location.hash === "#") location.hash = "#/cluster";
  else route();
}

// -- views -------------------------------------------------------------------------------

function table(caption, headers, rows, empty) {
  if (!rows.length) return h("p", { class: "muted" }, empty);
  return h("table", {},
    h("caption", { class: "muted", style: "text-align:left" }, caption),
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", { scope: "col" }, x)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, c))))));
}

function checkpointLink(id) { return h("a", { href: `#/checkpoint/${id}` }, id); }

function checkpointActions(c, after) {
  return h("span", {},
    h("button", {
      type: "button", "aria-label": `${c.pinned ? "Unpin" : "Pin"} checkpoint ${c.id}`,
      onclick: () => act(`${c.pinned ? "Unpinning" : "Pinning"} ${c.id}`,
        () => api("POST", `/api/v1/checkpoints/${c.id}/pin`, { pinned: !c.pinned }), after),
    }, c.pinned ? "Unpin" : "Pin"), " ",
    h("button", {
      type: "button", class: "danger", "aria-label": `Delete checkpoint ${c.id}`,
      onclick: () => {
        if (confirm(`Delete checkpoint ${c.id} from ${c.nodes.join(", ")}?`)) {
          act(`Deleting ${c.id}`, () => api("POST", `/api/v1/checkpoints/${c.id}/delete`), after);
        }
      },
    }, "Delete"));
}

function checkpointRows(list, after) {
  return list.map((c) => [
    checkpointLink(c.id), c.namespace, c.label, c.pod || "", c.created, bytes(c.size),
    secs(c.durationSeconds), c.nodes.join(", "),
    c.registry ? (c.pendingPush ? "push pending" : "pushed") : "none", c.pinned ? "pinned" : "",
    checkpointActions(c, after),
  ]);
}

const CHECKPOINT_HEADERS = ["Checkpoint", "Namespace", "Label", "Pod", "Created", "Size",
  "Took", "Nodes", "Registry", "Pin", "Actions"];

async function act(what, call, after) {
  say(`${what}…`);
  try {
    const result = await call();
    say(`${what}: done${result && result.id ? ` (${result.id})` : ""}`);
    if (after) await after();
    return result;
  } catch (err) {
    say(`${what} failed: ${err.message}`, true);
    return null;
  }
}

// Registry use: each blob counted once however many checkpoints share it.
function registrySection(uses) {
  const rows = [];
  for (const r of uses) {
    rows.push([h("b", {}, r.registry), "all you may see", r.checkpoints,
      r.bytes === null ? h("span", { class: "bad" }, "unreadable") : bytes(r.bytes)]);
    for (const n of r.namespaces) {
      rows.push([r.registry, n.namespace, n.checkpoints, bytes(n.bytes)]);
      for (const l of n.labels) {
        rows.push([r.registry, `${n.namespace} / ${l.label}`, l.checkpoints, bytes(l.bytes)]);
      }
    }
  }
  const out = [h("h2", {}, "Registry use"), table(
    "What each registry holds for your checkpoints (blobs shared by several counted once)",
    ["Registry", "Namespace / label", "Checkpoints", "Bytes"], rows,
    "No node pushes to a registry.")];
  for (const r of uses) for (const e of r.errors) out.push(h("p", { class: "bad" }, e));
  return h("section", { id: "registry-use" }, out);
}

async function clusterView() {
  const doc = await api("GET", "/api/v1/cluster");
  const view = $("#view");
  const refresh = () => clusterView();
  const parts = [h("h2", { id: "view-title", tabindex: "-1" }, "Cluster")];
  const total = doc.checkpoints.reduce((s, c) => s + (c.size || 0), 0);
  parts.push(h("div", { class: "cards" },
    h("div", { class: "card" }, h("b", {}, doc.workloads.length), "protected workloads"),
    h("div", { class: "card" }, h("b", {}, doc.checkpoints.length), "checkpoints"),
    h("div", { class: "card" }, h("b", {}, bytes(total)), "in stores"),
    h("div", { class: "card" }, h("b", {}, doc.failures.length), "recent failures")));
  parts.push(registrySection(doc.registryUse || []));
  if (doc.nodes) {
    parts.push(h("h2", {}, "Nodes"));
    parts.push(table("Nodes with cedana", ["Node", "State", "Checkpoints", "Store use",
      "Registry", "Pending pushes"], doc.nodes.map((n) => [
      n.node,
      n.taint ? (n.taint.tainted ? h("span", { class: "bad" }, `tainted: ${n.taint.reasons.join("; ")}`)
        : h("span", { class: "ok" }, "ready")) : "unknown",
      n.store.checkpoints, bytes(n.store.bytes), n.registry || "none", n.pendingPushes,
    ]), "No node agent answered."));
    for (const u of doc.unreachable) parts.push(h("p", { class: "bad" }, u));
  }
  parts.push(h("h2", {}, "Protected workloads"));
  parts.push(h("p", {}, h("input", { type: "checkbox", id: "avoid-node", checked: avoidNode,
    onchange: (e) => { avoidNode = e.target.checked; } }), " ",
  h("label", { for: "avoid-node" }, "Migrate off the current node (it is cordoned until the " +
    "replacement is scheduled)")));
  parts.push(table("Pods with containers that opt in", ["Namespace", "Pod", "Node", "Phase",
    "Containers", "Actions"], doc.workloads.map((w) => [
    w.namespace, w.pod, w.node, w.phase,
    w.containers.map((c) => `${c.name}${c.label ? ` (${c.label})` : ""}`).join(", "),
    h("span", {},
      h("button", {
        type: "button", "aria-label": `Checkpoint ${w.namespace}/${w.pod} now`,
        onclick: () => act(`Checkpointing ${w.namespace}/${w.pod}`,
          () => api("POST", `/api/v1/namespaces/${w.namespace}/pods/${w.pod}/checkpoint`, {}),
          refresh),
      }, "Checkpoint now"), " ",
      h("button", {
        type: "button", "aria-label": `Migrate ${w.namespace}/${w.pod}`,
        onclick: () => migrate(w.namespace, w.pod),
      }, "Migrate")),
  ]), "No pod in your namespaces opts in (CEDANA_CHECKPOINT or CEDANA_ENABLE)."));
  const newest = lastOperation || (doc.operations || [])[0] || null;
  parts.push(h("div", { id: "operation" }, newest ? operationBox(newest) : []));
  parts.push(h("h2", {}, "Checkpoints"));
  parts.push(table("Checkpoints in the namespaces you may see", CHECKPOINT_HEADERS,
    checkpointRows(doc.checkpoints, refresh), "No checkpoints yet."));
  parts.push(h("h2", {}, "Recent failures"));
  parts.push(table("Failed checkpoints and restores, and restores that fell back",
    ["When", "Node", "Namespace", "Pod", "What", "Outcome", "Why"],
    doc.failures.map((r) => [when(r.time), r.node, r.namespace, r.pod, r.kind, r.outcome,
      r.detail || (r.skipped || []).join("; ")]), "None lately."));
  view.replaceChildren(...parts);
  if (!lastOperation && newest) {
    lastOperation = newest;
    if (newest.state === "running") follow(newest);
  }
}

function timeline(doc) {
  const points = doc.timeline.checkpoints.map((p) => ({ t: Date.parse(p.created), p }));
  const restores = doc.timeline.restores.map((r) => ({ t: r.time * 1000, r }));
  const all = points.concat(restores);
  const W = 1000, H = 200, pad = 30;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "timeline");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `Timeline: ${points.length} checkpoints, ${restores.length} restores`);
  if (!all.length) return svg;
  const t0 = Math.min(...all.map((a) => a.t)), t1 = Math.max(...all.map((a) => a.t)) || t0 + 1;
  const maxSize = Math.max(1, ...points.map((a) => a.p.size || 0));
  const x = (t) => pad + (W - 2 * pad) * (t1 === t0 ? 0.5 : (t - t0) / (t1 - t0));
  const mk = (name, attrs, title) => {
    const el = document.createElementNS("http://www.w3.org/2000/svg", name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (title) {
      const t = document.createElementNS("http://www.w3.org/2000/svg", "title");
      t.textContent = title;
      el.append(t);
    }
    svg.append(el);
  };
  mk("line", { x1: pad, x2: W - pad, y1: H - pad, y2: H - pad, stroke: "#aaa" });
  for (const { t, p } of points) {
    const y = H - pad - (H - 2 * pad) * (p.size || 0) / maxSize;
    const r = 4 + Math.min(10, 2 * (p.durationSeconds || 0));
    mk("circle", { cx: x(t), cy: y, r, fill: "#0b61c4", "fill-opacity": 0.7 },
      `${p.id} (${p.label}): ${bytes(p.size)}, ${secs(p.durationSeconds) || "duration unknown"}`);
  }
  for (const { t, r } of restores) {
    const color = { restored: "#1e7a3a", cold: "#8a94a3" }[r.outcome] || "#b3261e";
    mk("rect", { x: x(t) - 4, y: pad - 10, width: 8, height: 8, fill: color },
      `restore of ${r.pod} on ${r.node}: ${r.outcome} ${r.checkpointId || ""}`);
  }
  return svg;
}

async function namespaceView(ns, label) {
  const q = label ? `?label=${encodeURIComponent(label)}` : "";
  const doc = await api("GET", `/api/v1/namespaces/${ns}${q}`);
  const refresh = () => namespaceView(ns, label);
  const pick = h("select", { id: "label-pick", onchange: (e) => {
    location.hash = `#/ns/${ns}${e.target.value ? `/${e.target.value}` : ""}`;
  } }, h("option", { value: "" }, "(all labels)"),
  doc.labels.map((l) => h("option", { value: l, selected: l === label }, l)));
  $("#view").replaceChildren(
    h("h2", { id: "view-title", tabindex: "-1" }, `Namespace ${ns}`),
    h("label", { for: "label-pick" }, "Label "), pick,
    h("h2", {}, "Timeline"),
    h("p", { class: "muted" }, "Circles: checkpoints (height: size, radius: duration). " +
      "Squares: restores (green: restored, grey: a first, cold start, red: fell back or failed)."),
    timeline(doc),
    h("h2", {}, "Checkpoints"),
    table(`Checkpoints of ${ns}`, CHECKPOINT_HEADERS, checkpointRows(doc.checkpoints, refresh),
      "No checkpoints in this namespace."),
    h("h2", {}, "Policies"),
    await policiesSection(ns, refresh),
    h("h2", {}, "Restores and fall-backs"),
    table("Restores the node agents remember", ["When", "Node", "Pod", "Outcome", "From",
      "Took", "Passed over"], doc.timeline.restores.map((r) => [when(r.time), r.node, r.pod,
      r.outcome, r.checkpointId ? checkpointLink(r.checkpointId) : "", secs(r.durationSeconds),
      r.skipped.join("; ") || r.detail]), "No restores lately."));
}

async function policiesSection(ns, refresh) {
  const doc = await api("GET", `/api/v1/namespaces/${ns}/policies`);
  const field = (id, label, hint) => h("p", {},
    h("label", { for: id }, label), " ",
    h("input", { id, name: id, "aria-describedby": `${id}-hint` }), " ",
    h("span", { id: `${id}-hint`, class: "muted" }, hint));
  const form = h("form", { id: "policy-form", "aria-label": "Edit a policy" },
    field("policy-name", "Name", "a ConfigMap name, e.g. nightly"),
    field("policy-selector", "Selector", "pod labels, e.g. app=trainer (empty: every pod)"),
    field("policy-interval", "Interval", "e.g. 10m: a checkpoint when the newest is older"),
    field("policy-retain", "Retain", "keep the newest N per label on each node"),
    field("policy-pin", "Pin latest", "pin the newest N per label"),
    h("p", {},
      h("label", { for: "policy-eviction" }, "Before eviction"), " ",
      h("select", { id: "policy-eviction", name: "policy-eviction",
        "aria-describedby": "policy-eviction-hint" },
      h("option", { value: "" }, "as the node says"),
      h("option", { value: "checkpoint" }, "checkpoint, in the registry before it exits")), " ",
      h("span", { id: "policy-eviction-hint", class: "muted" },
        "an evicted or drained pod resumes elsewhere from the registry")),
    h("button", { type: "submit" }, "Save policy"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const v = (id) => form.querySelector(`#${id}`).value.trim();
    const name = v("policy-name");
    await act(`Saving policy ${name}`, () => api("POST", `/api/v1/namespaces/${ns}/policies/${name}`, {
      selector: v("policy-selector"), interval: v("policy-interval"), retain: v("policy-retain"),
      pinLatest: v("policy-pin"), beforeEviction: v("policy-eviction"),
    }), refresh);
  });
  const edit = (p) => {
    form.querySelector("#policy-name").value = p.name;
    form.querySelector("#policy-selector").value = p.data.selector || "";
    form.querySelector("#policy-interval").value = p.data.interval || "";
    form.querySelector("#policy-retain").value = p.data.retain || "";
    form.querySelector("#policy-pin").value = p.data.pinLatest || "";
    form.querySelector("#policy-eviction").value = p.data.beforeEviction || "";
    form.querySelector("#policy-selector").focus();
  };
  const rows = doc.policies.map((p) => [
    p.name, p.data.selector || "(every pod)", p.data.interval || "", p.data.retain || "",
    p.data.pinLatest || "", p.data.beforeEviction || "", p.error ? h("span", { class: "bad" }, p.error) : p.covers.join(", ") || "nothing",
    h("ul", { class: "applied" }, p.applied.map((a) => h("li", {},
      `${a.node}: `, a.error ? h("span", { class: "bad" }, a.error)
        : `${a.covered.length} covered; ${a.actions.slice(-3).join("; ") || "nothing to do yet"}`))),
    h("span", {},
      h("button", { type: "button", "aria-label": `Edit policy ${p.name}`, onclick: () => edit(p) }, "Edit"), " ",
      h("button", { type: "button", class: "danger", "aria-label": `Delete policy ${p.name}`,
        onclick: () => {
          if (confirm(`Delete policy ${p.name}? Its pins stay until unpinned.`)) {
            act(`Deleting policy ${p.name}`,
              () => api("POST", `/api/v1/namespaces/${ns}/policies/${p.name}/delete`), refresh);
          }
        } }, "Delete")),
  ]);
  return h("div", {},
    table(`Policies of ${ns}`, ["Policy", "Selector", "Interval", "Retain", "Pin latest",
      "Before eviction", "Covers", "Applied", ""], rows, "No policy in this namespace."),
    form);
}

async function checkpointView(id) {
  const doc = await api("GET", `/api/v1/checkpoints/${id}`);
  const c = doc.checkpoint;
  const refresh = () => checkpointView(id);
  $("#view").replaceChildren(
    h("h2", { id: "view-title", tabindex: "-1" }, `Checkpoint ${c.id}`),
    table("Metadata", ["Field", "Value"], [
      ["Namespace", c.namespace], ["Label", c.label], ["Pod", c.pod], ["Container", c.container],
      ["Image", c.image], ["Created", c.created], ["Size", bytes(c.size)],
      ["Took", secs(c.durationSeconds)], ["Trigger", c.trigger], ["State", c.state],
      ["Pinned", c.pinned ? "yes (exempt from retention)" : "no"],
      ["On nodes", c.nodes.join(", ")],
      ["Registry", doc.registry.length ? `${doc.registry.join(", ")} — ${doc.inRegistry ? "pushed" : "push pending"}` : "none configured"],
    ], ""),
    h("p", {}, checkpointActions(c, refresh), " ",
      h("button", { type: "button", onclick: () => act(`Starting a copy of ${c.pod} from ${c.id}`,
        () => api("POST", `/api/v1/checkpoints/${c.id}/copy`)).then((r) => r && say(
        `Started pod ${r.namespace}/${r.pod} from ${r.checkpoint}`)) }, "Start a copy of the pod")),
    h("h2", {}, "Restore by hand"),
    h("p", {}, "Add to the container's spec:"),
    h("pre", { id: "restore-by-hand" }, doc.restoreByHand),
    h("h2", {}, "Restores made from it"),
    table("Restores", ["When", "Node", "Pod", "Outcome", "Took"], doc.restores.map((r) => [
      when(r.time), r.node, r.pod, r.outcome, secs(r.duration_seconds)]),
    "None that the node agents remember."));
}

async function migrate(ns, pod) {
  if (!confirm(`Migrate ${ns}/${pod}? It is checkpointed, then evicted; its controller starts a new pod, which resumes.`)) return;
  let op;
  try {
    op = await api("POST", `/api/v1/namespaces/${ns}/pods/${pod}/migrate`, { avoidNode });
  } catch (err) {
    say(`Migrating ${ns}/${pod} failed: ${err.message}`, true);
    return;
  }
  await follow(op);
}

// Poll an operation until it ends, drawing its steps; after a reload of the page the
// cluster view picks up the newest one (kept by the controller across its restarts).
let following = null;
async function follow(op) {
  if (following === op.id) return;
  following = op.id;
  const draw = (o) => {
    lastOperation = o;
    const box = $("#operation");
    if (box) box.replaceChildren(...operationBox(o));
    say(`Migration of ${o.target}: ${o.state}`, o.state === "failed");
  };
  draw(op);
  while (op.state === "running" && following === op.id) {
    await new Promise((r) => setTimeout(r, 500));
    try { op = await api("GET", `/api/v1/operations/${op.id}`); } catch (err) { say(err.message, true); return; }
    draw(op);
  }
  if (following !== op.id) return;
  following = null;
  // The pod moved: show the cluster as it is now (the steps stay on the page).
  if ((location.hash || "#/cluster") === "#/cluster") await clusterView().catch(() => {});
  say(`Migration of ${op.target}: ${op.state}`, op.state === "failed");
}

let lastOperation = null;
let avoidNode = false;

// A migration's steps: checkpoint, push, evict, rescheduled, resumed.
function operationBox(o) {
  return [h("h2", {}, `Migration of ${o.target}`),
    h("ol", { class: "steps", "aria-label": "Migration steps" }, o.steps.map((s) =>
      h("li", { class: s.state, title: s.detail }, `${s.name}: ${s.state}`))),
    h("p", { class: o.state === "failed" ? "bad" : "muted" },
      o.state === "failed" ? o.error : o.steps.filter((s) => s.detail).map((s) => s.detail).join(" · "))];
}

async function route() {
  if (!me) return;
  say("");  // what the last action said belongs to the page it was done on
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  try {
    if (parts[0] === "ns" && parts[1]) {
      $("#ns-pick").value = parts[1];
      await namespaceView(parts[1], parts[2] || "");
    } else if (parts[0] === "checkpoint" && parts[1]) {
      await checkpointView(parts[1]);
    } else {
      $("#ns-pick").value = "";
      await clusterView();
    }
    const title = $("#view-title");
    if (title) title.focus();
  } catch (err) {
    say(err.message, true);
  }
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", () => {
  $("#sign-in-form").addEventListener("submit", signIn);
  $("#sign-out").addEventListener("click", () => signOut());
  $("#ns-pick").addEventListener("change", (e) => {
    if (e.target.value) location.hash = `#/ns/${e.target.value}`;
  });
  if (sessionStorage.getItem(TOKEN_KEY)) start().catch(() => signOut());
  else signOut();
});
