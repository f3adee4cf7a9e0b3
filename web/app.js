// The chat page: picks a GGUF, loads it onto the browser's GPU through
// sieve's wasm, and streams answers. sieve_load and sieve_generate suspend
// while the GPU works (JSPI, jspi.js), so they are called through
// WebAssembly.promising; everything else is a plain wasm-bindgen call.
import init, * as sieve from "./sieve_web.js";

const $ = (id) => document.getElementById(id);
const problem = (text) => { $("problem").textContent = text; };
const mib = (bytes) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

// What this page needs, said plainly when a browser lacks it.
const missing = [];
if (!navigator.gpu) missing.push("WebGPU (navigator.gpu; in Chromium, --enable-unsafe-webgpu where it is off)");
if (typeof WebAssembly.promising !== "function") missing.push("WebAssembly JSPI (WebAssembly.promising; Chrome 137 or later)");
let wasm = null;
let adapterName = "";
if (missing.length) {
  problem(`This browser cannot run sieve: it lacks ${missing.join(" and ")}.`);
} else {
  try {
    wasm = await init();
  } catch (e) {
    problem(`sieve's wasm module did not start: ${e.message}`);
  }
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) problem("This browser offers WebGPU but no GPU adapter.");
  else adapterName = [adapter.info.vendor, adapter.info.architecture, adapter.info.description]
    .filter(Boolean).join(" ");
}
const load = wasm && WebAssembly.promising(wasm.sieve_load);
const generate = wasm && WebAssembly.promising(wasm.sieve_generate);
let busy = false;
let loaded = false;

// A call whose promise is rejected trapped (a panic; the console has it):
// the wasm instance is gone.
const trapped = (e) => new Error(`sieve stopped (${e.message}); reload the page`);
const call = async (f, ...args) => {
  let ok;
  try {
    ok = await f(...args);
  } catch (e) {
    throw trapped(e);
  }
  const s = JSON.parse(sieve.status());
  if (!ok) throw new Error(s.error);
  return s;
};

// Reads a file with its progress on the bar (the first half; the GPU upload
// takes the second).
async function readFile(file) {
  const bytes = new Uint8Array(file.size);
  let done = 0;
  const reader = file.stream().getReader();
  for (;;) {
    const { value, done: end } = await reader.read();
    if (end) break;
    bytes.set(value, done);
    done += value.length;
    $("progress").value = 0.5 * done / file.size;
  }
  return bytes;
}

async function loadFile(file) {
  if (!wasm || busy) return;
  busy = true;
  problem("");
  $("send").disabled = true;
  $("loaded").textContent = `reading ${file.name}`;
  const t0 = performance.now();
  try {
    sieve.set_cache($("policy").value, Number($("budget").value), Number($("chunk").value));
    sieve.set_model(file.name, await readFile(file));
    $("loaded").textContent = `uploading ${file.name} to the GPU`;
    sieve.set_load_progress((done, total) => {
      $("progress").value = 0.5 + 0.5 * done / total;
      document.body.dataset.uploaded = `${done}/${total}`;
    });
    const s = await call(load);
    loaded = true;
    $("progress").value = 1;
    const seconds = ((performance.now() - t0) / 1000).toFixed(1);
    $("loaded").textContent = `${file.name} on ${adapterName || s.adapter}, loaded in ${seconds} s: ` +
      `weights ${mib(s.weights_bytes)}, cache and buffers ${mib(s.buffers_bytes)}`;
    document.body.dataset.loadSeconds = seconds;
    $("send").disabled = false;
  } catch (e) {
    loaded = false;
    $("progress").value = 0;
    $("loaded").textContent = "";
    problem(`Loading ${file.name} failed: ${e.message}`);
  } finally {
    busy = false;
    $("file").value = ""; // the same file can be picked again
  }
}

// A changed cache starts a new conversation on the model loaded.
async function changeCache() {
  if (!wasm || !loaded || busy) return;
  busy = true;
  problem("");
  $("send").disabled = true;
  try {
    // A cache refused here leaves the conversation as it is.
    sieve.set_cache($("policy").value, Number($("budget").value), Number($("chunk").value));
  } catch (e) {
    problem(`The cache was not changed: ${e.message}`);
    busy = false;
    $("send").disabled = false;
    return;
  }
  try {
    await call(load);
    $("answer").textContent = "";
    $("status").textContent = `a new conversation with the ${$("policy").value} cache`;
  } catch (e) {
    loaded = false; // the old conversation is gone with the failed call
    problem(`A new conversation could not start (${e.message}); load the model again`);
  } finally {
    busy = false;
    $("send").disabled = !loaded;
  }
}
for (const id of ["policy", "budget", "chunk"]) $(id).addEventListener("change", changeCache);

$("file").addEventListener("change", () => $("file").files[0] && loadFile($("file").files[0]));
const drop = $("drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  if (e.dataTransfer.files[0]) loadFile(e.dataTransfer.files[0]);
});

$("send").addEventListener("click", async () => {
  if (busy) return;
  busy = true;
  problem("");
  $("send").disabled = true;
  $("stop").disabled = false;
  $("answer").textContent = "";
  $("status").textContent = "reading the prompt";
  const t0 = performance.now();
  let pieces = 0;
  sieve.set_prompt($("prompt").value, (piece) => {
    $("answer").textContent += piece;
    pieces++;
    const seconds = (performance.now() - t0) / 1000;
    $("status").textContent = `${pieces} pieces in ${seconds.toFixed(1)} s`;
    return true;
  });
  try {
    const s = await call(generate, Number($("max").value));
    $("status").textContent = `${s.generated_tokens} tokens (${s.stop}); prompt ` +
      `${s.prompt_tokens} tokens at ${s.prefill_tokens_per_second.toFixed(1)} tok/s, decode ` +
      `${s.decode_tokens_per_second.toFixed(2)} tok/s; conversation ${s.conversation_tokens} ` +
      `tokens; GPU memory ${mib(s.weights_bytes)} weights + ${mib(s.buffers_bytes)} cache and buffers`;
    document.body.dataset.lastStop = s.stop;
  } catch (e) {
    problem(`The answer failed: ${e.message}`);
  } finally {
    busy = false;
    $("send").disabled = false;
    $("stop").disabled = true;
    document.body.dataset.answers = String(Number(document.body.dataset.answers || 0) + 1);
  }
});
$("stop").addEventListener("click", () => sieve.stop());
