// The chat page (target/web, scripts/web-build.sh) in headless Chromium on
// its WebGPU (Dawn on SwiftShader): loads a GGUF through the file picker,
// checks that the upload's progress reached the bar, asks "What is the
// capital of France?" and checks that the answer names
// Paris, then stops a long answer with Stop; writes a screenshot and the
// figures (load time, tok/s).
//
// Usage: bash scripts/browser.sh scripts/web-test.mjs PAGE_DIR MODEL.gguf OUT_DIR
// (scripts/web-test.sh does it).

import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { launch, serve } from "./browser.mjs";

const [dir, model, out] = process.argv.slice(2);
const server = await serve(dir);
const browser = await launch();
const fail = (what) => { throw new Error(what); };
const figures = {};
try {
  const page = await browser.newPage({ viewport: { width: 900, height: 900 } });
  page.on("console", (m) => console.log(`page: ${m.text()}`));
  page.on("pageerror", (e) => console.log(`page error: ${e.message}`));
  await page.goto(server.url);
  const problem = () => page.textContent("#problem");
  const t0 = Date.now();
  await page.setInputFiles("#file", model);
  await page.waitForFunction(() => !document.querySelector("#send").disabled ||
    document.querySelector("#problem").textContent, null, { timeout: 600_000, polling: 500 });
  if (await problem()) fail(`loading: ${await problem()}`);
  figures.load_seconds = Number(await page.evaluate(() => document.body.dataset.loadSeconds));
  // The upload reported each layer to the bar (SmolLM2: 30 layers and 3
  // steps around them).
  const uploaded = await page.evaluate(() => document.body.dataset.uploaded);
  const [done, total] = (uploaded || "0/0").split("/").map(Number);
  if (!(total > 3 && done === total)) fail(`the upload's progress ended at ${uploaded}`);
  console.log(`web-test: ${await page.textContent("#loaded")} (${(Date.now() - t0) / 1000} s)`);

  // The question, whole.
  await page.fill("#prompt", "What is the capital of France?");
  await page.fill("#max", "32");
  await page.click("#send");
  await page.waitForFunction(() => document.body.dataset.answers === "1", null,
    { timeout: 600_000, polling: 500 });
  if (await problem()) fail(`answering: ${await problem()}`);
  const answer = await page.textContent("#answer");
  console.log(`web-test: answer ${JSON.stringify(answer)}; ${await page.textContent("#status")}`);
  if (!answer.includes("Paris")) fail(`the answer does not name Paris: ${answer}`);
  figures.answer = answer;
  figures.status = await page.textContent("#status");
  await page.screenshot({ path: join(out, "web-chat.png") });

  // Stop during a long answer: it ends early, cancelled, and the page works on.
  await page.fill("#prompt", "Write a long story about a dragon who learns to bake bread.");
  await page.fill("#max", "400");
  await page.click("#send");
  await page.waitForFunction(() => document.querySelector("#answer").textContent.length > 20,
    null, { timeout: 600_000, polling: 200 });
  await page.click("#stop");
  await page.waitForFunction(() => document.body.dataset.answers === "2", null,
    { timeout: 600_000, polling: 200 });
  if (await problem()) fail(`stopping: ${await problem()}`);
  const stop = await page.evaluate(() => document.body.dataset.lastStop);
  if (stop !== "Cancelled") fail(`Stop ended the answer with ${stop}, not Cancelled`);
  figures.stopped = await page.textContent("#status");
  console.log(`web-test: stopped: ${figures.stopped}`);

  // Another cache starts a new conversation on the loaded model; a budget
  // below the protected entries is refused, naming it, and changes nothing.
  await page.selectOption("#policy", "window");
  await page.waitForFunction(() => document.querySelector("#status").textContent
    .includes("window cache") || document.querySelector("#problem").textContent, null,
  { timeout: 600_000, polling: 200 });
  if (await problem()) fail(`changing the cache: ${await problem()}`);
  await page.fill("#budget", "8");
  await page.dispatchEvent("#budget", "change");
  await page.waitForFunction(() => document.querySelector("#problem").textContent, null,
    { timeout: 60_000, polling: 200 });
  const refused = await problem();
  if (!refused.includes("budget")) fail(`a budget of 8 was not refused by name: ${refused}`);
  if (await page.isDisabled("#send")) fail("a refused cache left Send disabled");
  console.log(`web-test: another cache: a new conversation; budget 8: ${refused}`);
} finally {
  await browser.close();
  server.close();
}
writeFileSync(join(out, "web-test.json"), JSON.stringify(figures, null, 1));
console.log("web-test: the page answers Paris, Stop works, and the cache can change");
