// sieve's kernel checks (the kernel tests cargo test runs) in headless
// Chromium on its WebGPU (Dawn and Tint on SwiftShader): opens the check
// page (target/web/checks.html, scripts/web-build.sh), waits for its run to
// end (the page reloads itself after a failing check) and fails unless
// every check that was not skipped passed. Writes OUT_DIR/checks.json.
//
// Usage: bash scripts/browser.sh scripts/web-checks.mjs PAGE_DIR OUT_DIR [SKIP,...] [ONLY,...]
// (scripts/web-test.sh does it).

import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { launch, serve } from "./browser.mjs";

const [dir, out, skip = "", only = ""] = process.argv.slice(2);
const server = await serve(dir);
const browser = await launch();
let done = null;
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 900 } });
  page.on("console", (m) => { if (m.type() === "error") console.log(`page: ${m.text()}`); });
  page.on("pageerror", (e) => console.log(`page error: ${e.message}`));
  await page.goto(`${server.url}checks.html?run=${Date.now()}&skip=${encodeURIComponent(skip)}` +
    `&only=${encodeURIComponent(only)}`);
  // Polled rather than waited for: a reload (after a failing check) ends
  // the context a wait runs in.
  const deadline = Date.now() + 20 * 60_000;
  let shown = "";
  while (!done) {
    if (Date.now() > deadline) throw new Error(`the checks did not end in 20 minutes (${shown})`);
    await new Promise((ok) => setTimeout(ok, 1000));
    try {
      done = await page.evaluate(() => window.checksDone || null);
      const problem = await page.textContent("#problem");
      if (problem) throw new Error(`the check page: ${problem}`);
      const summary = await page.textContent("#summary");
      if (summary !== shown) console.log(`web-checks: ${(shown = summary)}`);
    } catch (e) {
      if (e.message.startsWith("the check page")) throw e;
      // The page is reloading.
    }
  }
  await page.screenshot({ path: join(out, "checks.png"), fullPage: true });
} finally {
  await browser.close();
  server.close();
}
writeFileSync(join(out, "checks.json"), JSON.stringify(done, null, 1));
for (const r of done.results.filter((r) => r.outcome === "failed" ||
  (r.outcome === "passed" && r.notes.length))) {
  console.log(`web-checks: ${r.name}: ${r.outcome}${r.error ? `: ${r.error}` : ""}` +
    `${r.notes && r.notes.length ? ` (${r.notes.join("; ")})` : ""}`);
}
console.log(`web-checks: ${done.passed} passed, ${done.failed} failed, ${done.skipped} skipped ` +
  `in ${done.seconds} s`);
if (done.failed || !done.passed) process.exit(1);
