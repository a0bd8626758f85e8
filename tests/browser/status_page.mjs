// The admin status page in headless Chromium (Debian's `chromium`), driven by
// playwright-core:
//
//     NODE_PATH=target/ci-node/node_modules node tests/browser/status_page.mjs \
//         target/debug/prefixlb [SCREENSHOT.png]
//
// Starts four mock engines and a balancer with an admin token on loopback ports the OS
// picks, opens `/` on the admin port (polling every 500 ms) and checks that:
//  - the page asks for the admin token, and shows nothing without it;
//  - with it, every node of the pool is rendered, closed, with its cache hit rate;
//  - a node whose engine stalls shows `open` within two polls of its breaker opening;
//  - the drain button drains its node (and a drain without the token is refused);
//  - the page loads nothing from anywhere but the admin port.
// Writes a screenshot (default target/status-page.png; docs/status-page.png is one).
// Exits non-zero on the first failure.

import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

const require = createRequire(join(process.cwd(), "noop.js"));
const { chromium } = require("playwright-core");
const BIN = process.argv[2] ?? "target/debug/prefixlb";
const SHOT = process.argv[3] ?? "target/status-page.png";
const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";
const TOKEN = "status-page-check";
const POLL_MS = 500;
const procs = [];

function start(args) {
  const p = spawn(BIN, args, { env: { ...process.env, RUST_LOG: "warn" }, stdio: ["ignore", "pipe", "inherit"] });
  procs.push(p);
  return new Promise((resolve, reject) => {
    createInterface({ input: p.stdout }).once("line", (line) => {
      const addrs = [...line.matchAll(/http:\/\/([0-9.]+:[0-9]+)/g)].map((m) => m[1]);
      addrs.length ? resolve(addrs) : reject(new Error(`no address in ${line}`));
    });
    p.once("exit", (code) => reject(new Error(`${args[0]} exited with ${code}`)));
  });
}

function check(name, cond, detail = "") {
  if (!cond) throw new Error(`${name}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`);
  console.log(`ok  ${name}`);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function main() {
  const engines = [];
  for (const i of [0, 1, 2, 3]) {
    const [addr] = await start(["mock-engine", "--listen", "127.0.0.1:0", "--id", `e${i}`,
                                "--decode-ms-per-token", "2", "--prefill-us-per-token", "20"]);
    engines.push(addr);
  }
  const nodes = engines.map((a, i) => `[[pools.nodes]]\nid = "n${i}"\nurl = "http://${a}"\n`).join("");
  const path = join(mkdtempSync(join(tmpdir(), "prefixlb-status-")), "prefixlb.toml");
  writeFileSync(path,
    `[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\nadmin_token = "${TOKEN}"\n` +
    `[routing]\nkey = "hybrid"\n[health]\ninterval = "60s"\n[breaker]\nopen_for = "60s"\n` +
    `[[pools]]\nname = "chat"\nmodels = ["mock"]\nfirst_token_timeout = "400ms"\n${nodes}`);
  const [lb, admin] = await start(["serve", "--config", path]);
  const auth = { authorization: `Bearer ${TOKEN}` };
  const adminJson = async (p, init = {}) => {
    const r = await fetch(`http://${admin}${p}`, { ...init, headers: { ...auth, ...(init.headers ?? {}) } });
    return r.json();
  };
  const system = "You are the support assistant of a GPU cloud. Answer briefly and cite the runbook. ".repeat(16);
  const chat = async (session, user, stream = false) => {
    const r = await fetch(`http://${lb}/v1/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", ...(session ? { "x-session-id": session } : {}) },
      body: JSON.stringify({ model: "mock", stream, max_tokens: 4,
        messages: [{ role: "system", content: system }, { role: "user", content: user }] }),
    });
    await r.text();
    return r.status;
  };
  // Traffic that shares a system prompt, keyed by its text (a prefix group): cache hits.
  for (let i = 0; i < 40; i++) await chat(null, `question ${i % 10}`, true);

  const browser = await chromium.launch({
    executablePath: CHROMIUM,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1360, height: 900 } });
    const elsewhere = [];
    page.on("request", (req) => {
      if (!req.url().startsWith(`http://${admin}/`)) elsewhere.push(req.url());
    });
    const polls = async () => Number(await page.evaluate(() => document.body.dataset.polls || 0));
    await page.goto(`http://${admin}/?poll=${POLL_MS}`);

    // Without the token: asked for, nothing shown.
    await page.waitForSelector("#auth:not([hidden])", { timeout: 5000 });
    check("the page asks for the admin token", (await page.locator("tr[data-node]").count()) === 0);
    const refused = await fetch(`http://${admin}/admin/nodes/n0/drain`, { method: "POST" });
    check("a drain without the admin token is refused", refused.status === 401, String(refused.status));

    await page.fill("#token", TOKEN);
    await page.click("#save");
    await page.waitForFunction(() => document.querySelectorAll("tr[data-node]").length === 4, null, { timeout: 5000 });
    const states = await page.locator("tr[data-node] .state").allTextContents();
    check("every node is rendered, closed", states.length === 4 && states.every((s) => s === "closed"), states);
    const hits = await page.locator("tr[data-node] .hit").allTextContents();
    check("each node shows its realized cache hit rate", hits.some((h) => /^\d+\.\d%$/.test(h) && parseFloat(h) > 0), hits);
    const groups = await page.locator("table.groups tr").count();
    check("the learned prefix group is listed (hash tag and width)", groups >= 2, String(groups));
    const pageText = await page.locator("body").innerText();
    check("no prompt text on the page", !pageText.includes("support assistant"));

    // A stalled engine: its breaker opens; the page says so within two polls.
    await adminJson("/admin/nodes"); // (token works)
    const stalled = engines[1];
    await fetch(`http://${stalled}/mock/fault`, { method: "POST", headers: { "content-type": "application/json" },
                                                  body: JSON.stringify({ mode: "stall", ttft_ms: 0 }) });
    let opened = false;
    for (let i = 0; i < 60 && !opened; i++) {
      await chat(`stall-${i}`, `probe ${i}`, true);
      const n1 = (await adminJson("/admin/nodes")).nodes.find((n) => n.id === "n1");
      opened = n1.state === "open";
    }
    check("the stalled engine's breaker opens", opened);
    const pollsAtOpen = await polls();
    await page.waitForSelector('tr[data-node="n1"] .state.open', { timeout: 10 * POLL_MS });
    const took = (await polls()) - pollsAtOpen;
    check("the page shows it open within two polls", took <= 2, `${took} polls`);

    // The drain button drains its node.
    await page.click('tr[data-node="n2"] button.drain');
    let draining = false;
    for (let i = 0; i < 20 && !draining; i++) {
      draining = (await adminJson("/admin/nodes")).nodes.find((n) => n.id === "n2").draining === true;
      if (!draining) await sleep(100);
    }
    check("the drain button drains the node", draining);
    await page.waitForSelector('tr[data-node="n2"] .state.draining', { timeout: 4 * POLL_MS });
    check("the page shows it draining, with an undrain button",
      (await page.locator('tr[data-node="n2"] button.drain').textContent()) === "undrain");

    // Some history for the sparklines, then the picture.
    for (let i = 0; i < 12; i++) {
      await chat(null, `question ${i % 10}`, true);
      await sleep(150);
    }
    await sleep(2 * POLL_MS);
    await page.screenshot({ path: SHOT, fullPage: true });
    console.log(`    screenshot: ${SHOT}`);
    check("the page loaded nothing from elsewhere", elsewhere.length === 0, elsewhere);
  } finally {
    await browser.close();
  }
}

main()
  .then(() => {
    console.log("status page checks passed");
  })
  .catch((e) => {
    console.error(`FAILED ${e.message}`);
    process.exitCode = 1;
  })
  .finally(() => procs.forEach((p) => p.kill()));
