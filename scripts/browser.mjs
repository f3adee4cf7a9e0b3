// What the scripts that drive headless Chromium share (scripts/browser.sh
// runs them): a static server on localhost (WebGPU needs a secure context)
// and Chromium with WebGPU on SwiftShader.

import { chromium } from "playwright-core";
import { readFileSync, existsSync, statSync } from "node:fs";
import { createServer } from "node:http";
import { join, extname, normalize } from "node:path";

const types = { ".html": "text/html", ".js": "text/javascript", ".wasm": "application/wasm",
  ".json": "application/json" };

/** Serves `dir` on 127.0.0.1; resolves to { url, close }. */
export async function serve(dir) {
  const root = normalize(dir);
  const server = createServer((req, res) => {
    let path = normalize(join(root, new URL(req.url, "http://x").pathname));
    if (existsSync(path) && statSync(path).isDirectory()) path = join(path, "index.html");
    if (!path.startsWith(root) || !existsSync(path)) {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, { "Content-Type": types[extname(path)] || "application/octet-stream" });
    res.end(readFileSync(path));
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  return { url: `http://127.0.0.1:${server.address().port}/`, close: () => server.close() };
}

/** Headless Chromium ($CHROMIUM) with WebGPU on SwiftShader. */
export function launch() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: [
      "--no-sandbox", "--enable-unsafe-webgpu", "--enable-unsafe-swiftshader",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
      "--no-first-run",
    ],
  });
}
