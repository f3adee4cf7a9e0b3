// The check page: runs sieve's kernel checks (the kernel tests,
// sieve::kernels::checks) one by one on this browser's WebGPU, through
// sieve_check (called through WebAssembly.promising: it suspends while the
// GPU works, jspi.js).
//
// A failing check panics, which traps the wasm instance. The run's state
// (its id, the results so far, the check in progress) is kept in
// sessionStorage, so the page reloads and goes on with the next check.
//
// checks.html?run=ID starts run ID (a new ID: a fresh run); &skip=A,B
// leaves out the checks whose names contain A or B (as
// `cargo test -- --skip`), &only=A,B all but those. When a run ends, window.checksDone holds
// { passed, failed, skipped, seconds, results } and the title says it.
import init, * as sieve from "./sieve_web.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const runId = params.get("run");
const list = (key) => (params.get(key) || "").split(",").filter(Boolean);
const skip = list("skip");
const only = list("only");
const KEY = "sieve-checks";

// The last panic message (the wasm's panic hook writes it to console.error).
let lastError = "";
const consoleError = console.error.bind(console);
console.error = (...args) => {
  lastError = args.join(" ");
  consoleError(...args);
};

function show(state, names) {
  const byName = new Map(state.results.map((r) => [r.name, r]));
  $("rows").replaceChildren(...names.map((name) => {
    const r = byName.get(name);
    const tr = document.createElement("tr");
    const outcome = r ? r.outcome : name === state.running ? "running" : "";
    for (const [text, cls] of [[name], [outcome, outcome],
      [r && r.seconds !== undefined ? r.seconds.toFixed(2) : ""],
      [r ? (r.error || r.notes.join("; ")) : ""]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.append(td);
    }
    return tr;
  }));
  const count = (o) => state.results.filter((r) => r.outcome === o).length;
  $("summary").textContent = `${count("passed")} passed, ${count("failed")} failed, ` +
    `${count("skipped")} skipped of ${names.length}`;
}

async function main() {
  if (!navigator.gpu || typeof WebAssembly.promising !== "function") {
    $("problem").textContent = "This browser cannot run sieve: it lacks WebGPU or JSPI (WebAssembly.promising).";
    return;
  }
  const wasm = await init();
  const check = WebAssembly.promising(wasm.sieve_check);
  const names = JSON.parse(sieve.check_names());
  $("run").disabled = false;
  $("run").onclick = () => {
    sessionStorage.removeItem(KEY);
    location.search = `?run=${Date.now()}`;
  };
  let state = JSON.parse(sessionStorage.getItem(KEY) || "null");
  if (runId === null) {
    if (state) show(state, names);
    return;
  }
  if (!state || state.id !== runId) {
    state = { id: runId, results: [], next: 0, started: Date.now() };
  }
  const save = () => sessionStorage.setItem(KEY, JSON.stringify(state));
  // The check in progress when the page last stopped trapped.
  if (state.running) {
    state.results.push({ name: state.running, outcome: "failed",
      error: state.error || "the wasm instance trapped (see the console)" });
    state.running = null;
    state.error = null;
    state.next += 1;
  }
  for (; state.next < names.length; state.next += 1) {
    const name = names[state.next];
    if (skip.some((s) => name.includes(s)) || (only.length && !only.some((s) => name.includes(s)))) {
      state.results.push({ name, outcome: "skipped", notes: ["skipped by the URL"] });
      continue;
    }
    state.running = name;
    save();
    show(state, names);
    try {
      if (!await check(state.next)) throw new Error(JSON.parse(sieve.status()).error);
      const s = JSON.parse(sieve.status());
      state.results.push({ name, outcome: "passed", seconds: s.seconds, notes: s.notes });
      state.running = null;
    } catch (e) {
      // A trap: the panic's message, then a fresh instance (a reload).
      state.error = `${lastError || e.message}`;
      save();
      location.reload();
      return;
    }
  }
  state.running = null;
  state.seconds = (Date.now() - state.started) / 1000;
  save();
  show(state, names);
  const count = (o) => state.results.filter((r) => r.outcome === o).length;
  window.checksDone = { passed: count("passed"), failed: count("failed"),
    skipped: count("skipped"), seconds: state.seconds, results: state.results };
  document.title = `sieve checks: ${count("passed")} passed, ${count("failed")} failed`;
}

main().catch((e) => { $("problem").textContent = `the check page failed: ${e.message}`; });
