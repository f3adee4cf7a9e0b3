// The `sieve_jspi` module sieve's wasm imports (src/platform.rs): how the
// library waits for the GPU in a browser, where a thread cannot block.
// `yield_to_browser` is a JSPI import (WebAssembly.Suspending): the wasm
// stack that calls it is suspended, the page's event loop runs (WebGPU's
// promises settle, the page repaints, buttons work), and the stack resumes
// on the next task. A MessageChannel gives that task without setTimeout's
// 4 ms clamp.
const channel = new MessageChannel();
const waiting = [];
channel.port1.onmessage = () => waiting.shift()();

export const yield_to_browser = typeof WebAssembly.Suspending === "function"
  ? new WebAssembly.Suspending(() => new Promise((resume) => {
    waiting.push(resume);
    channel.port2.postMessage(0);
  }))
  : () => { throw new Error("this browser lacks JSPI (WebAssembly.Suspending)"); };
