// Compiles every kernel module `sieve shaders --dump` wrote with a second
// WGSL compiler: Tint, in headless Chromium's WebGPU (Dawn on SwiftShader).
// Each module goes through createShaderModule (its compilation messages)
// and each of its entry points through createComputePipelineAsync (the
// override constants at their defaults). A module that needs a feature the
// adapter lacks (shader-f16, or wgpu's cooperative matrices, which no
// browser has) is listed as skipped, with the reason.
//
// Usage: bash scripts/browser.sh scripts/tint-check.mjs DUMP_DIR OUT_JSON
// (scripts/tint-check.sh does it). Exits 1 when a module fails.

import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { launch, serve } from "./browser.mjs";

const [dir, out] = process.argv.slice(2);
const index = JSON.parse(readFileSync(join(dir, "index.json"), "utf8"));
const modules = index.map((m) => ({ ...m, code: readFileSync(join(dir, m.file), "utf8") }));

// WebGPU needs a secure context: a page on localhost.
const server = await serve(dir);
const browser = await launch();
let result;
try {
  const page = await browser.newPage();
  await page.goto(`${server.url}index.json`);
  result = await page.evaluate(async (modules) => {
    if (!navigator.gpu) return { error: "this browser offers no WebGPU (navigator.gpu)" };
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) return { error: "no WebGPU adapter" };
    const info = adapter.info || {};
    const wanted = ["subgroups", "shader-f16"].filter((f) => adapter.features.has(f));
    const limits = {};
    for (const k of ["maxStorageBufferBindingSize", "maxBufferSize", "maxComputeWorkgroupStorageSize",
      "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX", "maxStorageBuffersPerShaderStage"]) {
      limits[k] = adapter.limits[k];
    }
    const device = await adapter.requestDevice({ requiredFeatures: wanted, requiredLimits: limits });
    // `enable` name -> the WebGPU feature it needs (null: none a browser has).
    const needs = { subgroups: "subgroups", f16: "shader-f16", wgpu_cooperative_matrix: null };
    const results = [];
    for (const m of modules) {
      const missing = m.enables.filter((e) => !(needs[e] && device.features.has(needs[e])));
      if (missing.length) {
        results.push({ file: m.file, status: "skipped", why: `needs ${missing.join(", ")}` });
        continue;
      }
      const errors = [];
      device.pushErrorScope("validation");
      device.pushErrorScope("internal");
      const module = device.createShaderModule({ code: m.code, label: m.file });
      const compiled = await module.getCompilationInfo();
      for (const msg of compiled.messages) {
        if (msg.type === "error") errors.push(`${msg.lineNum}:${msg.linePos}: ${msg.message}`);
      }
      for (const entryPoint of m.entry_points) {
        try {
          await device.createComputePipelineAsync({ layout: "auto", compute: { module, entryPoint } });
        } catch (e) {
          errors.push(`${entryPoint}: ${e.message}`);
        }
      }
      for (let i = 0; i < 2; i++) {
        const e = await device.popErrorScope();
        if (e) errors.push(e.message);
      }
      results.push({ file: m.file, status: errors.length ? "failed" : "ok", errors });
    }
    return {
      adapter: `${info.vendor || "?"} ${info.architecture || ""} ${info.description || ""}`.trim(),
      features: [...adapter.features].sort(),
      results,
    };
  }, modules);
} finally {
  await browser.close();
  server.close();
}
writeFileSync(out, JSON.stringify(result, null, 1));
if (result.error) {
  console.error(`tint-check: ${result.error}`);
  process.exit(1);
}
const count = (s) => result.results.filter((r) => r.status === s);
for (const r of count("failed")) console.error(`FAILED ${r.file}:\n  ${r.errors.join("\n  ")}`);
for (const r of count("skipped")) console.log(`skipped ${r.file}: ${r.why}`);
console.log(`tint-check on ${result.adapter}: ${count("ok").length} modules compile, ` +
  `${count("failed").length} fail, ${count("skipped").length} skipped (of ${result.results.length})`);
process.exit(count("failed").length ? 1 : 0);
